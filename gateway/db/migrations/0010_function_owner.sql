-- Whose code made an invocation's result: the owner of the registered function that ran,
-- kept on the invocation (function_id is set NULL when the function is unregistered). The
-- sdk unpickles a result only for the user whose code made it, unless told to trust them.
ALTER TABLE invocations ADD COLUMN function_owner text;
UPDATE invocations i SET function_owner = u.name
    FROM functions f JOIN users u ON u.id = f.owner_id
    WHERE f.id = i.function_id;

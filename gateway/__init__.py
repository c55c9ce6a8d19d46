"""The HTTP gateway: Starlette app, auth, all SQL (``gateway.db``), long-poll endpoints, and
the host of the scheduler loop. Stateless: any number of replicas may share one database."""

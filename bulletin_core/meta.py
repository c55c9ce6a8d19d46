"""What a type's ``msgspec.Meta`` says: its description and its rule in words.

The wire Structs (:mod:`bulletin_core.wire`) and the settings Structs
(:mod:`bulletin_core.settings`) carry both in ``Meta``; the gateway's 422s, ``--help`` and
the sdk's argument checks read them here, from ``msgspec.inspect`` types.
"""

from __future__ import annotations

import msgspec
import msgspec.inspect

Type = msgspec.inspect.Type


def kinds(node: Type) -> list[Type]:
    """The types a value at ``node`` may be: its union's members, without their metadata."""
    while isinstance(node, msgspec.inspect.Metadata):
        node = node.type
    if isinstance(node, msgspec.inspect.UnionType):
        return [kind for member in node.types for kind in kinds(member)]
    return [node]


def bare(node: Type) -> Type:
    """``node`` without its metadata, and without ``None`` when it is optional: the type whose
    bounds the rule is made of."""
    found = [k for k in kinds(node) if not isinstance(k, msgspec.inspect.NoneType)]
    return found[0] if len(found) == 1 else node


def description(node: Type) -> str:
    """The outermost description of ``node``: a field's own before its type alias's."""
    while isinstance(node, msgspec.inspect.Metadata):
        text = (node.extra_json_schema or {}).get("description")
        if text:
            return str(text)
        node = node.type
    if isinstance(node, msgspec.inspect.UnionType):
        return next(filter(None, map(description, node.types)), "")
    return ""


def rule(node: Type) -> str:
    """``node``'s constraints in words ("above 0", "at least 1 and at most 10"); "" if none."""
    kind = bare(node)
    words = []
    bounds = (("gt", "above"), ("ge", "at least"), ("lt", "below"), ("le", "at most"))
    for attribute, text in bounds:
        bound = getattr(kind, attribute, None)
        if bound is not None:
            whole = float(bound).is_integer() and abs(bound) < 1e15
            words.append(f"{text} {int(bound) if whole else bound}")
    min_length = getattr(kind, "min_length", None)
    if min_length:
        words.append(f"at least {min_length} characters")
    pattern = getattr(kind, "pattern", None)
    if pattern:
        words.append(f"matching {pattern}")
    return " and ".join(words)

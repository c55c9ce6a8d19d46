"""Regenerate the ``components/schemas`` of ``openapi.yaml`` from the wire Structs.

The message schemas of the HTTP contract are what msgspec generates for the Structs of
``bulletin_core/wire.py``, constraints and descriptions (``msgspec.Meta``) included; the rest of
the file (info, paths, parameters, responses, security schemes) is written by hand and left
byte for byte as it is. Run it after changing a wire Struct, from the repository root::

    .venv/bin/python scripts/openapi.py          # rewrite openapi.yaml
    .venv/bin/python scripts/openapi.py --check  # exit 1 (naming the schemas) if out of date

``tests/integration/test_openapi.py`` fails while the file is out of date. The output is
deterministic: a second run changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import yaml  # noqa: E402

from bulletin_core import wire  # noqa: E402

SPEC_PATH = ROOT / "openapi.yaml"
REF_TEMPLATE = "#/components/schemas/{name}"
#: The line that opens the generated block (under ``components:``), and the comment lines
#: after it that are kept as they are.
SCHEMAS_LINE = "  schemas:\n"
COMMENT = "    #"

#: The Structs that travel over HTTP, in the order of the file: the schemas are generated
#: from these (with the Structs and enums they refer to).
HTTP_STRUCTS: list[type[msgspec.Struct]] = [
    wire.SubmitRequest,
    wire.SubmitResponse,
    wire.CallSpec,
    wire.Invocation,
    wire.Timeline,
    wire.WatchRequest,
    wire.WatchItem,
    wire.WatchResponse,
    wire.CancelRequest,
    wire.CancelResponse,
    wire.LogChunk,
    wire.BlobRef,
    wire.Problem,
    wire.ClusterInfo,
    wire.RegisterRequest,
    wire.RegisterResponse,
    wire.GpuInfo,
    wire.HeartbeatRequest,
    wire.GpuHealthReport,
    wire.HeartbeatResponse,
    wire.Attempt,
    wire.PollRequest,
    wire.PollResponse,
    wire.Assignment,
    wire.StartRequest,
    wire.ReleaseRequest,
    wire.LogsRequest,
    wire.NodeLogChunk,
    wire.CompleteRequest,
    wire.CompleteManyRequest,
    wire.Completion,
    wire.CompleteManyResponse,
    wire.Preemption,
    wire.ModelQuota,
    wire.GroupQuota,
    wire.Group,
    wire.UserGroup,
    wire.UsageEntry,
    wire.WarmWorker,
    wire.FunctionResources,
    wire.FunctionResourcesInfo,
    wire.FunctionRegistration,
    wire.FunctionInfo,
    wire.InvokeRequest,
    wire.LogEvent,
    wire.LogEnd,
]


def schemas() -> dict[str, Any]:
    """The ``components/schemas`` of the Structs, as msgspec generates them."""
    _, components = msgspec.json.schema_components(HTTP_STRUCTS, ref_template=REF_TEMPLATE)
    return components


class _Dumper(yaml.SafeDumper):
    """Strings as the hand-written parts of the file have them: multi-line ones (the Structs'
    docstrings) literal (``|``), long descriptions folded (``>``), the rest plain."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else ">" if len(value) > 60 and " " in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)
#: Where yaml folds lines: the block is indented by 4 more, and a line stays near 100.
_WIDTH = 92


def render(text: str) -> str:
    """``text`` (openapi.yaml) with its generated block replaced by :func:`schemas`: the
    lines indented under ``components: schemas:`` after its comment, up to the next line that
    is not (blank lines before it are kept)."""
    lines = text.splitlines(keepends=True)
    try:
        start = lines.index(SCHEMAS_LINE) + 1
    except ValueError:
        raise SystemExit(f"{SPEC_PATH.name} has no {SCHEMAS_LINE.strip()!r} line") from None
    while start < len(lines) and lines[start].startswith(COMMENT):
        start += 1
    end = start
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    # ASCII only (yaml escapes the rest): the gateway reads the file in the locale's encoding.
    dumped = yaml.dump(schemas(), Dumper=_Dumper, sort_keys=False, width=_WIDTH)
    block = [f"    {line}" if line.strip() else line for line in dumped.splitlines(True)]
    return "".join(lines[:start] + block + lines[end:])


def changed(documented: dict[str, Any], generated: dict[str, Any]) -> list[str]:
    """The schema names that differ: ``+Name`` (generated, not in the file), ``-Name`` (in
    the file, no longer generated) and ``~Name`` (different)."""

    def mark(name: str) -> str:
        return "+" if name not in documented else "-" if name not in generated else "~"

    return [
        mark(name) + name
        for name in sorted(documented.keys() | generated.keys())
        if documented.get(name) != generated.get(name)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the file is out of date"
    )
    args = parser.parse_args(argv)
    text = SPEC_PATH.read_text()
    fresh = render(text)
    if fresh == text:
        return 0
    if args.check:
        documented = yaml.safe_load(text)["components"]["schemas"]
        names = ", ".join(changed(documented, schemas())) or "(formatting only)"
        print(f"{SPEC_PATH.name} components/schemas are out of date: {names}", file=sys.stderr)
        return 1
    SPEC_PATH.write_text(fresh)
    print(f"rewrote the components/schemas of {SPEC_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

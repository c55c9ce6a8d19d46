"""The envelope: how a pickled call or result is laid out in bytes, a file or a blob.

``MAGIC | header length (4 bytes, big-endian) | header (msgpack wire.PickleHeader) | pickle |
buffer 0 | buffer 1 | ...``, where the pickle and each buffer start at a multiple of
``ALIGN`` bytes (zero padding between). Buffers are the out-of-band data of pickle protocol 5
(tensor and array memory): they are written straight from the objects' memory and read back
as views of the envelope (an ``mmap`` of a file, or the downloaded bytes), never copied in
between. The header is read and checked (:func:`skew`) before anything is unpickled.
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import cloudpickle
import msgspec

from bulletin_core import wire

MAGIC = b"BLTNENV1"
ALIGN = 64
_PREFIX = len(MAGIC) + 4
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(wire.PickleHeader)
_ZEROS = bytes(ALIGN)


class EnvelopeError(ValueError):
    """The bytes are not a whole envelope (truncated, or something else entirely)."""


def _padding(offset: int) -> int:
    return -offset % ALIGN


@dataclass
class Packed:
    """An envelope ready to send: header, pickle and buffers, not yet joined."""

    header: wire.PickleHeader
    pickle: bytes
    buffers: Sequence[memoryview]
    # Objects whose memory the buffers point into: alive until the envelope is written.
    keep: list[Any] = field(default_factory=list)

    def pieces(self) -> Iterator[bytes | memoryview]:
        """The envelope as consecutive pieces, buffers as zero-copy views."""
        head = _header_encoder.encode(self.header)
        yield MAGIC + len(head).to_bytes(4, "big") + head
        offset = _PREFIX + len(head)
        for piece in (memoryview(self.pickle), *self.buffers):
            pad = _padding(offset)
            if pad:
                yield _ZEROS[:pad]
            yield piece
            offset += pad + piece.nbytes

    @property
    def nbytes(self) -> int:
        """Total size of the envelope in bytes."""
        return sum(memoryview(p).nbytes for p in self.pieces())

    @property
    def state_bytes(self) -> int:
        """Size of the pickle plus its buffers (what size limits are about)."""
        return len(self.pickle) + sum(b.nbytes for b in self.buffers)

    def tobytes(self) -> bytes:
        """The whole envelope in one ``bytes`` (for small envelopes sent inline)."""
        return b"".join(self.pieces())

    def write(self, path: str) -> None:
        """Write the envelope to ``path`` (through a temporary name, so a reader never sees
        half a file)."""
        temp = f"{path}.part"
        with open(temp, "wb") as file:
            for piece in self.pieces():
                file.write(piece)
        os.replace(temp, path)


@dataclass
class Opened:
    """A received envelope: its header, and views of its pickle and buffers."""

    header: wire.PickleHeader
    pickle: memoryview
    buffers: list[memoryview]
    # The mapping or buffer the views point into (kept alive by the views as well).
    source: Any = None


def open_bytes(data: bytes | bytearray | memoryview) -> Opened:
    """Open an envelope held in memory. Read-only memory is copied once (tensors are built
    over the buffers and must be writable): only small inline envelopes arrive as ``bytes``."""
    view = memoryview(data).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    return _parse(view, view)


def open_file(path: str) -> Opened:
    """Open an envelope file as a private (copy-on-write) mapping: nothing is read until
    used, and changes made to tensors built over it never reach the file."""
    return open_fd(os.open(path, os.O_RDONLY | os.O_CLOEXEC), path)


def open_fd(fd: int, what: str = "the envelope file") -> Opened:
    """Like :func:`open_file`, for a file already open as ``fd`` (which is closed)."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise EnvelopeError(f"{what} is empty, not a Bulletin envelope")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return _parse(memoryview(mapping), mapping)


def _parse(view: memoryview, source: Any) -> Opened:
    if view.nbytes < _PREFIX or bytes(view[: len(MAGIC)]) != MAGIC:
        raise EnvelopeError("not a Bulletin envelope (wrong magic bytes)")
    head_len = int.from_bytes(view[len(MAGIC) : _PREFIX], "big")
    offset = _PREFIX + head_len
    if offset > view.nbytes:
        raise EnvelopeError("truncated Bulletin envelope (header cut off)")
    try:
        header = _header_decoder.decode(view[_PREFIX:offset])
    except msgspec.DecodeError as exc:
        raise EnvelopeError(f"unreadable Bulletin envelope header: {exc}") from None
    pieces = []
    for size in (header.pickle_size, *header.buffers):
        offset += _padding(offset)
        if size < 0 or offset + size > view.nbytes:
            raise EnvelopeError(
                f"truncated Bulletin envelope: {view.nbytes} bytes, expected at least "
                f"{offset + max(size, 0)}"
            )
        pieces.append(view[offset : offset + size])
        offset += size
    return Opened(header=header, pickle=pieces[0], buffers=pieces[1:], source=source)


# ------------------------------------------------------------------------------ versions


@functools.cache
def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


@functools.cache
def torch_version() -> str | None:
    """The installed torch's version without its local part (``2.13.0+cpu`` -> ``2.13.0``),
    looked up without importing torch; None when torch is not installed."""
    try:
        return metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def header(
    *, pickle_size: int, buffers: list[int], uses_torch: bool, **flags: Any
) -> wire.PickleHeader:
    """The header describing this side's versions."""
    return wire.PickleHeader(
        python=python_version(),
        cloudpickle=cloudpickle.__version__,
        torch=torch_version() if uses_torch else None,
        pickle_size=pickle_size,
        buffers=buffers,
        **flags,
    )


def skew(theirs: wire.PickleHeader, *, they: str, we: str) -> str | None:
    """Why an envelope written on the other side cannot be loaded here, or None.

    ``they`` and ``we`` name the sides in the message ("the notebook", "node 'gpu-3'").
    """
    ours = python_version()
    if theirs.python != ours:
        return (
            f"{they} runs Python {theirs.python} but {we} runs Python {ours}: functions "
            f"pickled on one cannot be loaded on the other. Use Python {ours} on both sides "
            "(the cluster's workers use the nodelet's Python)."
        )
    if theirs.cloudpickle != cloudpickle.__version__:
        return (
            f"{they} has cloudpickle {theirs.cloudpickle} but {we} has cloudpickle "
            f"{cloudpickle.__version__}: install the same version on both sides "
            f"(pip install cloudpickle=={cloudpickle.__version__})."
        )
    if theirs.torch is not None:
        here = torch_version()
        if here is None:
            return (
                f"{they} sends torch objects (torch {theirs.torch}) but {we} has no torch "
                f"installed: install torch=={theirs.torch} there."
            )
        if _minor(here) != _minor(theirs.torch):
            return (
                f"{they} has torch {theirs.torch} but {we} has torch {here}: tensors and "
                "modules may not load across torch versions; install the same version on "
                "both sides."
            )
    return None


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


#: Modules of ours that were renamed, old name -> new: a pickle names the globals it uses
#: (the tensor rebuild helper, the sdk's classes) by module, so an envelope made before the
#: rename (a call still queued at an upgrade, a registered function) names the old ones.
RENAMED_MODULES = {
    "bulletin.pickling": "bulletin_core.pickling",
    "bulletin.wire": "bulletin_core.wire",
    "bulletin.shared": "bulletin_core.shared",
    "bulletin.pickling.frame": "bulletin_core.pickling.envelope",
}
#: sdk modules made private (``sdk.errors`` is ``sdk._errors``; its public names are also on
#: ``sdk`` itself).
_SDK_MODULES = frozenset(
    {"call", "client", "config", "errors", "fanout", "function", "liveness", "outcome"}
    | {"serialize", "watcher"}
)


#: RENAMED_MODULES, longest old name first (``bulletin.pickling.frame`` before its package).
_RENAMES = sorted(RENAMED_MODULES.items(), key=lambda item: -len(item[0]))


def current_module(module: str) -> str:
    """Where the globals of ``module``, as an older Bulletin pickled them, live now."""
    top, _, rest = module.partition(".")
    if top not in ("bulletin", "sdk"):
        return module  # every global of user code and libraries: nothing to look up
    if top == "sdk" and rest in _SDK_MODULES:
        return f"sdk._{rest}"  # where every name of the old module is still defined
    for old, new in _RENAMES:
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return module


class RenamingUnpickler(pickle.Unpickler):
    """An unpickler that finds the globals of our renamed modules under their new names."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(current_module(module), name)

"""Tensors in envelopes, and moving call state to the call's device and back.

torch pickles a tensor by ``torch.save``-ing its storage into an in-memory file: two full
copies, in-band. Here a dense tensor is reduced to its raw bytes as one protocol-5
out-of-band buffer (a view of its memory, no copy when it is already a contiguous CPU
tensor) plus dtype, shape and ``requires_grad``; it is rebuilt over the received buffer
without a copy. Tensors on a GPU are copied to the CPU as they are pickled, so what comes back
from a worker is always on the CPU. Everything else about a tensor (its ``grad``, autograd
history, views sharing storage with other tensors) does not travel.

torch is never imported here: a tensor can only exist if the user's code imported it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import pickle
import sys
import types
import zlib
from collections import deque
from collections.abc import Iterable
from typing import Any

_CONTAINERS = (list, tuple, set, frozenset, deque)


def torch_module() -> Any | None:
    """The torch module if something already imported it, else None."""
    return sys.modules.get("torch")


def is_plain_tensor(obj: Any) -> bool:
    torch = torch_module()
    return torch is not None and type(obj) is torch.Tensor


def dense(tensor: Any) -> bool:
    """Whether a tensor has plain memory (strided, not quantized, nested or meta)."""
    torch = torch_module()
    assert torch is not None
    return bool(
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type != "meta"
    )


#: Fingerprint rows: 512 64-bit words (4 KiB) are xor-reduced to one word on the tensor's
#: device; the row hashes (1/512 of the tensor) are checksummed on the CPU.
_ROW = 512


def fingerprint(tensor: Any) -> int:
    """A checksum of a dense tensor's contents, computed where it lives (a GPU tensor is not
    copied to the CPU whole). It changes when any 64-bit word changes; reordering words
    within one 4 KiB row goes unnoticed."""
    torch = torch_module()
    assert torch is not None
    data = tensor.detach()
    if data.numel() == 0:
        return 0
    data = data.contiguous().reshape(-1)
    nbytes = data.numel() * data.element_size()
    if nbytes % 8 or not hasattr(torch, "hash_tensor"):
        return zlib.crc32(_cpu_bytes(data))
    words = data.view(torch.int64)
    rows = words.numel() // _ROW * _ROW
    parts = [torch.hash_tensor(words[:rows].view(-1, _ROW), dim=1)] if rows else []
    if rows < words.numel():
        parts.append(torch.hash_tensor(words[rows:]).reshape(1))
    return zlib.crc32(_cpu_bytes(torch.cat(parts)))


def _cpu_bytes(data: Any) -> bytes:
    data = data.to("cpu").contiguous()
    size = data.numel() * data.element_size()
    return bytes((ctypes.c_char * size).from_address(data.data_ptr()))


def reduce(tensor: Any, keep: list[Any]) -> Any:
    """A pickle reduction of a plain tensor as raw out-of-band bytes, or NotImplemented for
    what only torch knows how to pickle (sparse, quantized, meta, nested tensors)."""
    torch = torch_module()
    assert torch is not None
    data = tensor.detach()
    if not dense(data) or 0 in data.stride():
        # torch's own pickling keeps a broadcast (expanded) tensor's storage small.
        return NotImplemented
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.resolve_conj().resolve_neg().contiguous()
    dtype = str(data.dtype).removeprefix("torch.")
    shape = tuple(data.shape)
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return rebuild_empty, (dtype, shape, tensor.requires_grad)
    raw = (ctypes.c_char * nbytes).from_address(data.data_ptr())
    raw._tensor = data  # the view keeps the memory alive
    keep.append(raw)
    return rebuild, (pickle.PickleBuffer(raw), dtype, shape, tensor.requires_grad)


#: Tensors smaller than this are copied out of the received envelope, so that a few small
#: tensors kept by the caller do not keep a whole downloaded envelope alive.
COPY_BELOW = 1 << 20


def rebuild(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """A tensor over ``buffer``'s memory (no copy), or a copy of it when it is small."""
    import torch

    view = memoryview(buffer).cast("B")
    if view.readonly or view.nbytes < COPY_BELOW:
        view = memoryview(bytearray(view))
    tensor = torch.frombuffer(view, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def rebuild_empty(dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), requires_grad=requires_grad)


def move(roots: Iterable[Any], device: str) -> dict[int, Any]:
    """Move every tensor and module reachable from ``roots`` to ``device``, in place.

    Reached through lists, tuples, sets, dicts, instances of classes defined in the
    notebook, optimizers' state, and the closures and defaults of notebook functions. A
    tensor keeps its identity (its data is swapped), so aliases and containers still hold
    it, and keeps ``requires_grad`` and being a leaf. A module is moved with ``Module.to``;
    parameters and buffers that it replaced by new objects are returned as
    ``{id(old): new}``.
    """
    torch = torch_module()
    if torch is None:
        return {}
    target = torch.device(device)
    replaced: dict[int, Any] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device != target and obj.device.type != "meta" and obj.layout == torch.strided:
                _move_tensor(obj, target)
        elif isinstance(obj, torch.nn.Module):
            replaced.update(_move_module(obj, target))
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(_optimizer_state(obj))
        elif isinstance(obj, types.FunctionType):
            # What a notebook function carries: closure cells and default values.
            if obj.__module__ == "__main__":
                stack.extend(_cells(obj))
                stack.extend(obj.__defaults__ or ())
                stack.extend((obj.__kwdefaults__ or {}).values())
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, _CONTAINERS):
            stack.extend(obj)
        elif _defined_in_notebook(obj):
            stack.extend(vars(obj).values())
    return replaced


def set_default_device(device: str | None, torch_used: str | None) -> bool:
    """Make ``device`` torch's default device (None: back to the CPU). Only when torch is
    in use (imported, or named by the call's header) and the device is not the CPU; returns
    whether it was set."""
    if device is not None and (device == "cpu" or (torch_used is None and not torch_module())):
        return False
    if device is None and torch_module() is None:
        return False
    import torch

    torch.set_default_device(device)
    return True


def _move_tensor(tensor: Any, target: Any) -> None:
    """Move ``tensor`` keeping the Python object: swap its data (CPU to CUDA), or swap the
    whole tensor where torch cannot (other devices)."""
    try:
        tensor.data = tensor.data.to(target)
    except RuntimeError:
        import torch

        moved = tensor.detach().to(target).requires_grad_(tensor.requires_grad)
        torch.utils.swap_tensors(tensor, moved)


def _optimizer_state(optimizer: Any) -> list[Any]:
    """An optimizer's per-parameter state tensors, except the step counts torch keeps on the
    CPU unless the group is capturable or fused (as Optimizer.load_state_dict does)."""
    found = []
    for group in optimizer.param_groups:
        on_device = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if key != "step" or on_device:
                    found.append(value)
    return found


def _cells(fn: types.FunctionType) -> list[Any]:
    found = []
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            found.append(cell.cell_contents)
    return found


def _move_module(module: Any, target: Any) -> dict[int, Any]:
    """``Module.to`` with parameters swapped in place (as they are between CPU and CUDA by
    default, and for every device here), so optimizers keyed by them still find them."""
    import torch

    before = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to(target)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    after = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {
        id(old): after[name]
        for name, old in before.items()
        if name in after and after[name] is not old
    }


def _defined_in_notebook(obj: Any) -> bool:
    cls = type(obj)
    return cls.__module__ == "__main__" and hasattr(obj, "__dict__") and not isinstance(obj, type)

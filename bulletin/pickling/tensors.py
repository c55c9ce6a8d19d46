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

import ctypes
import pickle
import sys
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


def reduce(tensor: Any, keep: list[Any]) -> Any:
    """A pickle reduction of a plain tensor as raw out-of-band bytes, or NotImplemented for
    what only torch knows how to pickle (sparse, quantized, meta, nested tensors)."""
    torch = torch_module()
    assert torch is not None
    data = tensor.detach()
    if (
        data.layout != torch.strided
        or data.is_quantized
        or data.is_nested
        or data.device.type == "meta"
    ):
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


def rebuild(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """A tensor over ``buffer``'s memory (no copy)."""
    import torch

    view = memoryview(buffer).cast("B")
    if view.readonly:  # only when loaded without out-of-band buffers
        view = memoryview(bytearray(view))
    tensor = torch.frombuffer(view, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def rebuild_empty(dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), requires_grad=requires_grad)


def move(roots: Iterable[Any], device: str) -> dict[int, Any]:
    """Move every tensor and module reachable from ``roots`` to ``device``, in place.

    Reached through lists, tuples, sets, dicts and instances of classes defined in the
    notebook. A tensor keeps its identity (its ``.data`` is replaced), so aliases and
    containers still hold it, and keeps ``requires_grad`` and being a leaf. A module is moved
    with ``Module.to``; parameters and buffers that it replaced by new objects are returned
    as ``{id(old): new}``.
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


def _move_module(module: Any, target: Any) -> dict[int, Any]:
    before = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    module.to(target)
    after = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {
        id(old): after[name]
        for name, old in before.items()
        if name in after and after[name] is not old
    }


def _defined_in_notebook(obj: Any) -> bool:
    cls = type(obj)
    return cls.__module__ == "__main__" and hasattr(obj, "__dict__") and not isinstance(obj, type)

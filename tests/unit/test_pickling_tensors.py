"""Tensors and arrays in envelopes, and device moves, with the CPU torch wheel. The "meta"
device stands in for a GPU: moving to it is a real device move that CPU torch can do."""

from __future__ import annotations

from typing import Any

import pytest

from bulletin_core.pickling import caller, envelope, remote, tensors
from tests.unit.test_pickling_sync import notebook, remote_run

torch = pytest.importorskip("torch")
numpy = pytest.importorskip("numpy")


def roundtrip(value: Any) -> Any:
    packed = caller.pack_call(lambda: None, (value,), {}, sync=False).packed
    call = remote.open_call(packed.tobytes(), where="node 'test'")
    _, args, _ = call.load()
    return args[0], packed


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(3, 4, dtype=torch.float64).t(),  # not contiguous
        torch.arange(10, dtype=torch.int64)[::2],
        torch.tensor([True, False]),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor(3.5),  # 0-dim
        torch.empty(0, 3),
        torch.randn(2, 2, requires_grad=True),
    ],
    ids=["float32", "transposed", "strided", "bool", "bfloat16", "scalar", "empty", "grad"],
)
def test_tensors_survive_with_dtype_shape_and_requires_grad(tensor: Any) -> None:
    back, _ = roundtrip(tensor)
    assert type(back) is torch.Tensor
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.requires_grad == tensor.requires_grad and back.is_leaf
    assert torch.equal(back.detach(), tensor.detach())


def test_tensor_memory_travels_out_of_band_and_loads_without_a_copy(tmp_path: Any) -> None:
    tensor = torch.randn(1024, 1024)  # 4 MiB
    packed = caller.pack_call(lambda: None, (tensor,), {}, sync=False).packed
    assert len(packed.pickle) < 4096
    assert [b.nbytes for b in packed.buffers] == [4 << 20]
    path = str(tmp_path / "payload.bin")
    packed.write(path)
    opened = envelope.open_file(path)
    _, (back,), _ = remote.RemoteCall(opened).load()
    # Built over the file's mapping: writes go to private pages, never to the file.
    back += 1
    assert torch.equal(back, tensor + 1)
    again = remote.RemoteCall(envelope.open_file(path)).load()[1][0]
    assert torch.equal(again, tensor)


def test_numpy_arrays_travel_out_of_band_and_are_updated_in_place() -> None:
    ns = notebook(
        """
        import numpy
        grid = numpy.zeros((256, 256))
        view = grid

        def paint():
            grid[0, :] = 7
        """
    )
    grid = ns["grid"]
    packed = caller.pack_call(ns["paint"], (), {}, sync=True).packed
    assert sum(b.nbytes for b in packed.buffers) == grid.nbytes
    remote_run(ns["paint"])
    assert ns["grid"] is grid and ns["view"] is grid
    assert (grid[0] == 7).all() and (grid[1:] == 0).all()


def test_training_remotely_updates_the_notebooks_model_and_optimizer_in_place() -> None:
    ns = notebook(
        """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        images = []

        def train(steps):
            for _ in range(steps):
                loss = model(torch.randn(8, 4)).pow(2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
            images.append(model(torch.randn(1, 4)))
            return loss.item()
        """
    )
    weight, before = ns["model"].weight, ns["model"].weight.detach().clone()
    returned = remote_run(ns["train"], 3)
    assert isinstance(returned.value, float)
    assert ns["model"].weight is weight and not torch.equal(weight.detach(), before)
    assert weight.requires_grad and weight.is_leaf and isinstance(weight, torch.nn.Parameter)
    # The optimizer's state is keyed by the notebook's own parameters: training goes on here.
    assert ns["opt"].param_groups[0]["params"][0] is weight
    assert ns["opt"].state[weight]["step"].item() == 3
    assert len(ns["images"]) == 1 and ns["images"][0].device.type == "cpu"


def test_untouched_tensors_do_not_travel_back() -> None:
    ns = notebook(
        """
        import torch
        weights = torch.randn(512, 512)

        def read():
            return float(weights.sum())
        """
    )
    returned = remote_run(ns["read"])
    assert returned.changed == {}


def test_move_puts_tensors_and_modules_on_the_device_keeping_identity() -> None:
    ns = notebook(
        """
        import torch

        class Holder:
            def __init__(self):
                self.t = torch.ones(2)

        model = torch.nn.BatchNorm1d(3)  # parameters and buffers
        leaf = torch.ones(2, requires_grad=True)
        nested = {"xs": [torch.zeros(1)], "pair": (torch.zeros(2),)}
        holder = Holder()
        """
    )
    leaf, inner = ns["leaf"], ns["nested"]["xs"][0]
    buffer = ns["model"].running_mean
    replaced = tensors.move([ns[n] for n in ("model", "leaf", "nested", "holder")], "meta")
    assert ns["leaf"] is leaf and leaf.device.type == "meta"
    assert leaf.requires_grad and leaf.is_leaf
    assert ns["nested"]["xs"][0] is inner and inner.device.type == "meta"
    assert ns["nested"]["pair"][0].device.type == "meta"
    assert ns["holder"].t.device.type == "meta"
    assert all(p.device.type == "meta" for p in ns["model"].parameters())
    assert replaced[id(buffer)] is ns["model"].running_mean


def test_the_call_runs_with_its_state_on_the_assigned_device_unless_opted_out() -> None:
    ns = notebook(
        """
        import torch
        weights = torch.ones(3, requires_grad=True)

        def where(x):
            made = torch.zeros(1)  # made by the function: on the default device
            return str(x.device), str(weights.device), weights.requires_grad, str(made.device)
        """
    )
    moved = remote_run(ns["where"], torch.zeros(2), device="meta")
    assert moved.value == ("meta", "meta", True, "meta")
    assert ns["weights"].device.type == "cpu"
    assert torch.zeros(1).device.type == "cpu"  # the default device is restored after
    kept = remote_run(ns["where"], torch.zeros(2), device="meta", move_to_device=False)
    assert kept.value == ("cpu", "cpu", True, "cpu")


def test_header_names_torch_only_when_the_call_holds_torch_objects() -> None:
    plain = caller.pack_call(lambda x: x, ("a torch",), {}, sync=False).packed
    assert plain.header.torch is None
    with_tensor = caller.pack_call(lambda x: x, (torch.ones(1),), {}, sync=False).packed
    assert with_tensor.header.torch == torch.__version__.split("+")[0]
    with_module = caller.pack_call(lambda m: m, (torch.nn.ReLU(),), {}, sync=False).packed
    assert with_module.header.torch == torch.__version__.split("+")[0]


def test_writes_the_version_counter_misses_still_come_back() -> None:
    ns = notebook(
        """
        import numpy, torch
        w = torch.zeros(3, requires_grad=True)
        bn = torch.nn.BatchNorm1d(2)
        fortran = numpy.zeros((3, 3), order="F")

        def step():
            (w * 2).sum().backward()
            w.data -= 0.5 * w.grad  # a manual SGD step: invisible to w._version
            bn.train()
            bn(torch.randn(8, 2) + 5)  # running statistics updated in the kernel
            fortran[0, 0] = 7
        """
    )
    mean = ns["bn"].running_mean
    remote_run(ns["step"])
    assert torch.equal(ns["w"].detach(), torch.full((3,), -1.0))
    assert ns["bn"].running_mean is mean and float(mean.mean()) > 0.1
    assert ns["fortran"][0, 0] == 7


def test_a_broadcast_tensor_travels_at_its_storage_size_and_sparse_ones_travel() -> None:
    ns = notebook(
        """
        import torch
        wide = torch.zeros(1).expand(1 << 24)  # 64 MiB as a dense tensor, 4 bytes stored
        sparse = torch.eye(3).to_sparse()

        def use():
            return float(wide.sum()), int(sparse.to_dense().sum())
        """
    )
    packed = caller.pack_call(ns["use"], (), {}, sync=True).packed
    assert packed.nbytes < 1 << 20
    assert remote_run(ns["use"]).value == (0.0, 3)


def test_optimizer_state_and_closures_move_to_the_device() -> None:
    ns = notebook(
        """
        import torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 2)).sum().backward()
        opt.step()

        def make():
            scale = torch.ones(2)

            def where():
                state = opt.state[model.weight]
                return str(state["exp_avg"].device), str(state["step"].device), str(scale.device)

            return where
        where = make()
        """
    )
    assert remote_run(ns["where"], device="meta").value == ("meta", "cpu", "meta")

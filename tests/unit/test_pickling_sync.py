"""Notebook state round trips through the real envelope code: the caller packs a call, the
"worker" side (bulletin_core.pickling.remote, in this process) loads, runs and packs the outcome,
and the caller applies it. Objects on the two sides are distinct (everything is unpickled),
as they are across machines; transport is covered by the cluster and notebook tests."""

from __future__ import annotations

import importlib
import io
import pickle
import textwrap
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bulletin_core import wire
from bulletin_core.pickling import caller, envelope, remote


def remote_run(fn: Any, *args: Any, device: str = "cpu", **flags: Any) -> caller.Returned:
    sent = caller.pack_call(fn, args, {}, sync=flags.pop("sync", True), **flags)
    call = remote.open_call(sent.packed.tobytes(), where="node 'test'")
    rfn, rargs, rkwargs = call.load()
    call.prepare(device)
    value, error = None, None
    try:
        value = rfn(*rargs, **rkwargs)
    except Exception as exc:
        error = exc
    finally:
        call.finish()
    packed = call.pack_outcome(value, error).packed
    return caller.load_outcome(envelope.open_bytes(packed.tobytes()), sent.sync)


def notebook(source: str) -> dict[str, Any]:
    """A namespace like a notebook's: its functions are pickled by value."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)
    return namespace


def test_in_place_mutation_rebinding_and_global_creation() -> None:
    ns = notebook(
        """
        images = []
        alias = images
        config = {"lr": 0.1, "sizes": [1]}
        sizes = config["sizes"]
        tags = {"a"}
        raw = bytearray(b"ab")
        step = 0
        untouched = [1, 2]

        def helper(n):
            images.extend(range(n))
            config["sizes"].append(n)

        def sample(n):
            global step, created
            helper(n)
            tags.add("b")
            raw.extend(b"c")
            step += n
            created = "made remotely"
            return len(images)
        """
    )
    untouched = ns["untouched"]
    returned = remote_run(ns["sample"], 3)
    assert returned.value == 3 and returned.error is None
    assert ns["images"] == [0, 1, 2] and ns["alias"] is ns["images"]
    assert ns["sizes"] == [1, 3] and ns["config"]["sizes"] is ns["sizes"]
    assert ns["tags"] == {"a", "b"} and ns["raw"] == bytearray(b"abc")
    assert ns["step"] == 3 and ns["created"] == "made remotely"
    assert ns["untouched"] is untouched
    assert set(returned.changed) == {"images", "config", "tags", "raw", "step", "created"}


def test_instances_of_notebook_classes_are_updated_in_place() -> None:
    ns = notebook(
        """
        class Counter:
            def __init__(self):
                self.n = 0
                self.history = []

            def bump(self):
                self.n += 1
                self.history.append(self.n)

        counter = Counter()
        same = counter
        history = counter.history

        def work():
            counter.bump()
            counter.bump()
            counter.label = "new attribute"
        """
    )
    remote_run(ns["work"])
    assert ns["counter"] is ns["same"]
    assert ns["counter"].n == 2 and ns["counter"].label == "new attribute"
    assert ns["history"] == [1, 2] and ns["counter"].history is ns["history"]
    assert type(ns["counter"]) is ns["Counter"]


def test_deleted_global_is_deleted_and_function_defined_remotely_lives_here() -> None:
    ns = notebook(
        """
        doomed = 1

        def work():
            global doomed, made
            del doomed

            def made(x):
                return x + offset

            return None

        offset = 10
        """
    )
    remote_run(ns["work"])
    assert "doomed" not in ns
    assert ns["made"](1) == 11
    assert ns["made"].__globals__ is ns  # rebuilt over the notebook's namespace
    ns["offset"] = 20
    assert ns["made"](1) == 21


def test_state_changed_before_an_exception_is_applied_and_the_exception_returned() -> None:
    ns = notebook(
        """
        losses = []

        def train():
            losses.append(0.5)
            raise ValueError("diverged")
        """
    )
    returned = remote_run(ns["train"])
    assert isinstance(returned.error, ValueError) and str(returned.error) == "diverged"
    assert ns["losses"] == [0.5]


def test_the_notebook_value_wins_when_rebound_while_the_call_ran() -> None:
    ns = notebook(
        """
        result = None

        def work():
            global result
            result = "remote"
        """
    )
    sent = caller.pack_call(ns["work"], (), {}, sync=True)
    call = remote.open_call(sent.packed.tobytes(), where="node 'test'")
    fn, _, _ = call.load()
    call.prepare("cpu")
    fn()
    packed = call.pack_outcome(None, None).packed
    ns["result"] = "local"  # the notebook rebinds it while the call runs
    returned = caller.load_outcome(envelope.open_bytes(packed.tobytes()), sent.sync)
    assert ns["result"] == "local"
    assert returned.changed["result"] == "remote"
    assert any("'result' was changed in the notebook" in note for note in returned.notes)


def test_a_changed_global_that_cannot_come_back_is_named_and_the_rest_comes_back() -> None:
    ns = notebook(
        """
        import threading
        lock = None
        count = 0

        def work():
            global lock, count
            lock = threading.Lock()
            count += 1
        """
    )
    returned = remote_run(ns["work"])
    assert ns["count"] == 1 and ns["lock"] is None
    assert len(returned.notes) == 1
    assert "global 'lock' (_thread.lock)" in returned.notes[0]
    assert "cannot be sent back" in returned.notes[0]


def test_untouched_globals_do_not_travel_back() -> None:
    ns = notebook(
        """
        big = list(range(100_000))
        table = {"k": [1, 2]}

        def read():
            return sum(big) + len(table["k"])
        """
    )
    sent = caller.pack_call(ns["read"], (), {}, sync=True)
    call = remote.open_call(sent.packed.tobytes(), where="node 'test'")
    fn, _, _ = call.load()
    call.prepare("cpu")
    packed = call.pack_outcome(fn(), None).packed
    assert packed.nbytes < 2_000  # the value and an empty set of changes
    returned = caller.load_outcome(envelope.open_bytes(packed.tobytes()), sent.sync)
    assert returned.changed == {} and returned.value == sum(range(100_000)) + 2


def test_a_returned_global_is_the_notebooks_own_object() -> None:
    ns = notebook(
        """
        items = [1]

        def grow():
            items.append(2)
            return items
        """
    )
    returned = remote_run(ns["grow"])
    assert returned.value is ns["items"] and ns["items"] == [1, 2]


def test_without_sync_nothing_is_applied() -> None:
    ns = notebook(
        """
        items = []

        def grow():
            items.append(1)
            return len(items)
        """
    )
    returned = remote_run(ns["grow"], sync=False)
    assert returned.value == 1 and ns["items"] == [] and returned.changed == {}


def test_version_skew_is_reported_before_unpickling() -> None:
    ns = notebook("def f():\n    return 1\n")
    packed = caller.pack_call(ns["f"], (), {}, sync=True).packed
    for field, value, words in [
        ("python", "3.99", "Python 3.99"),
        ("cloudpickle", "0.0.1", "cloudpickle 0.0.1"),
        ("torch", "1.0.0", "torch 1.0.0"),
    ]:
        header = wire.PickleHeader(**{**_fields(packed.header), field: value})
        skewed = envelope.Packed(header, packed.pickle, packed.buffers)
        with pytest.raises(remote.VersionSkew, match=words) as info:
            remote.open_call(skewed.tobytes(), where="node 'gpu-1'")
        assert "node 'gpu-1'" in str(info.value)


def _fields(header: wire.PickleHeader) -> dict[str, Any]:
    return {name: getattr(header, name) for name in header.__struct_fields__}


def test_a_truncated_or_foreign_envelope_is_refused_clearly(tmp_path: Any) -> None:
    ns = notebook("def f(x):\n    return x\n")
    data = caller.pack_call(ns["f"], (b"x" * 1000,), {}, sync=False).packed.tobytes()
    with pytest.raises(envelope.EnvelopeError, match="truncated"):
        envelope.open_bytes(data[:-10])
    with pytest.raises(envelope.EnvelopeError, match="not a Bulletin envelope"):
        envelope.open_bytes(b"\x80\x05K\x01.")
    path = tmp_path / "payload.bin"
    path.write_bytes(data)
    opened = envelope.open_file(str(path))
    assert opened.header.pickle_size == len(opened.pickle)


# ------------------------------------------------------------------ property: sync == local

SOURCE = """
data = None
alias = None


def containers(root):
    found, seen, stack = [], set(), [root]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack.extend(reversed(item))
        elif isinstance(item, (list, dict)) and id(item) not in seen:
            seen.add(id(item))
            found.append(item)
            stack.extend(reversed(list(item.values()) if isinstance(item, dict) else item))
    return found


def mutate(ops):
    global data, created
    for kind, i, j, value in ops:
        found = containers(data)
        target, other = found[i % len(found)], found[j % len(found)]
        if kind == "add":
            if isinstance(target, list):
                target.append(value)
            else:
                target[str(value)] = value
        elif kind == "link":
            if isinstance(target, list):
                target.insert(0, other)
            else:
                target["link"] = other
        elif kind == "fresh":
            if isinstance(target, list):
                target.append([value])
            else:
                target[str(value)] = {"v": value}
        elif kind == "pop" and target:
            if isinstance(target, list):
                target.pop(0)
            else:
                target.pop(next(iter(target)))
        elif kind == "clear":
            target.clear()
        elif kind == "rebind":
            data = [data, value]
        elif kind == "create":
            created = value
    return len(containers(data))
"""

leaves = st.integers(-3, 3) | st.text(max_size=2)
trees = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=2), inner, max_size=3)
        | st.tuples(inner, inner)
    ),
    max_leaves=12,
)
ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "link", "fresh", "pop", "clear", "rebind", "create"]),
        st.integers(0, 30),
        st.integers(0, 30),
        st.integers(-5, 5),
    ),
    max_size=8,
)


def canonical(value: Any, ids: dict[int, int]) -> Any:
    """The value with object identity made visible (shared and cyclic containers)."""
    if isinstance(value, tuple):
        return ("tuple", [canonical(v, ids) for v in value])
    if isinstance(value, (list, dict)):
        if id(value) in ids:
            return ("same as", ids[id(value)])
        ids[id(value)] = len(ids)
        if isinstance(value, list):
            return ("list", [canonical(v, ids) for v in value])
        return ("dict", [(k, canonical(v, ids)) for k, v in value.items()])
    return value


def build(tree: Any, alias_pick: int) -> dict[str, Any]:
    ns = notebook(SOURCE)
    ns["data"] = [__import__("copy").deepcopy(tree)]
    found = ns["containers"](ns["data"])
    ns["alias"] = found[alias_pick % len(found)]
    return ns


def view(ns: dict[str, Any]) -> Any:
    return canonical([ns["data"], ns["alias"], ns.get("created", "<unset>")], {})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees, alias_pick=st.integers(0, 30), program=ops)
def test_remote_mutations_leave_the_same_state_as_running_locally(
    tree: Any, alias_pick: int, program: list[Any]
) -> None:
    local, synced = build(tree, alias_pick), build(tree, alias_pick)
    expected = local["mutate"](program)
    returned = remote_run(synced["mutate"], program)
    assert returned.value == expected
    assert view(synced) == view(local)


def test_an_outcome_over_the_limit_names_its_biggest_parts() -> None:
    ns = notebook(
        """
        blob = b""

        def grow():
            global blob
            blob = bytes(3 << 20)
            return "small"
        """
    )
    sent = caller.pack_call(ns["grow"], (), {}, sync=True, max_result_bytes=2 << 20)
    call = remote.open_call(sent.packed.tobytes(), where="node 'test'")
    fn, _, _ = call.load()
    call.prepare("cpu")
    value = fn()
    with pytest.raises(remote.ResultError) as info:
        call.pack_outcome(value, None)
    message = str(info.value)
    assert "over the limit of 2.0 MiB (max_state_bytes)" in message
    assert "global 'blob' (bytes): 3.0 MiB" in message


def test_counter_slots_and_partial_attribute_state_are_applied_exactly() -> None:
    ns = notebook(
        """
        from collections import Counter
        from dataclasses import dataclass

        @dataclass(slots=True)
        class Point:
            x: int
            y: int

        class Cached:
            def __init__(self):
                self.n = 0
                self.cache = {"warm": True}

            def __getstate__(self):  # the cache is not pickled
                return {"n": self.n}

        counts = Counter(a=1)
        point = Point(1, 2)
        cached = Cached()

        def work():
            counts["b"] += 2
            point.x = 10
            cached.n += 1
        """
    )
    point, cached = ns["point"], ns["cached"]
    remote_run(ns["work"])
    assert ns["counts"] == {"a": 1, "b": 2}
    assert ns["point"] is point and (point.x, point.y) == (10, 2)
    assert ns["cached"] is cached and cached.n == 1 and cached.cache == {"warm": True}


def test_state_comes_back_when_the_exception_cannot_or_the_value_cannot() -> None:
    ns = notebook(
        """
        import threading
        losses = []

        class Diverged(Exception):
            def __init__(self, step, loss):  # unpicklable: Exception.args is (message,)
                super().__init__(f"step {step}: loss {loss}")

        def train():
            losses.append(0.5)
            raise Diverged(3, 0.5)

        def make_lock():
            losses.append(0.25)
            return threading.Lock()
        """
    )
    returned = remote_run(ns["train"])
    assert returned.error is None and ns["losses"] == [0.5]  # the error travels as text
    sent = caller.pack_call(ns["make_lock"], (), {}, sync=True)
    call = remote.open_call(sent.packed.tobytes(), where="node 'test'")
    fn, _, _ = call.load()
    call.prepare("cpu")
    outcome = call.pack_outcome(fn(), None)
    assert outcome.problem is not None and "return value (a _thread.lock)" in outcome.problem
    caller.load_outcome(envelope.open_bytes(outcome.packed.tobytes()), sent.sync)
    assert ns["losses"] == [0.5, 0.25]


def test_an_argument_changed_in_place_comes_back_unless_it_cannot() -> None:
    ns = notebook(
        """
        import threading

        def grow(items):
            items.append(len(items))
            return "grown"

        def spoil(items):
            items.append(threading.Lock())
            return "spoilt"
        """
    )
    items: list[Any] = []
    assert remote_run(ns["grow"], items).value == "grown"
    returned = remote_run(ns["spoil"], items)
    assert returned.value == "spoilt" and items == [0]
    assert any("list of the notebook was changed" in note for note in returned.notes)


def test_everything_but_tensors_works_without_torch() -> None:
    import subprocess
    import sys

    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        from tests.unit.test_pickling_sync import notebook, remote_run
        ns = notebook(
            '''
            items = []
            def grow(n):
                items.extend(range(n))
                return len(items)
            '''
        )
        returned = remote_run(ns["grow"], 3)
        assert returned.value == 3 and ns["items"] == [0, 1, 2], returned
        assert returned.error is None
        import nodelet.worker_main, sdk  # the worker and the sdk import without torch
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout == "ok\n", done.stderr


@pytest.mark.parametrize(
    ("module", "name", "now"),
    [
        ("bulletin.pickling.tensors", "rebuild", "bulletin_core.pickling.tensors"),
        ("bulletin.wire", "State", "bulletin_core.wire"),
        ("sdk.errors", "RateLimited", "sdk._errors"),
        ("sdk.function", "Options", "sdk._function"),
        ("bulletin.pickling.frame", "EnvelopeError", "bulletin_core.pickling.envelope"),
    ],
)
def test_an_envelope_made_before_the_modules_were_renamed_still_loads(
    module: str, name: str, now: str
) -> None:
    # A call queued before an upgrade, or a registered function, names the globals its
    # pickle uses by their old modules (GLOBAL opcode: module and name, then STOP).
    old = b"c" + module.encode() + b"\n" + name.encode() + b"\n."
    loaded = envelope.RenamingUnpickler(io.BytesIO(old)).load()
    assert loaded is getattr(importlib.import_module(now), name)
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(old)  # what a plain unpickler (the old worker's) did

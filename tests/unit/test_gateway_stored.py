"""Rows another version stored (gateway/db/_common.py _Stored): fields this one does not know are
ignored, never a failure of every scheduling round."""

from __future__ import annotations

import msgspec
import pytest

from bulletin_core import wire
from gateway.db._common import _GPU_LIST, _HEALTH_LIST, _WARM_LIST, _Stored


def test_a_stored_gpu_with_a_field_this_version_does_not_know_still_reads() -> None:
    stored = '[{"index": 0, "uuid": "g0", "name": "Fake", "memory_mb": 1, "fake": true,' \
        ' "mig_profile": "1g.10gb"}]'
    assert _GPU_LIST.decode(stored) == [
        wire.GpuInfo(index=0, uuid="g0", name="Fake", memory_mb=1, fake=True)
    ]
    # A request is still strict about the same type.
    with pytest.raises(msgspec.ValidationError, match="mig_profile"):
        msgspec.json.decode(stored, type=list[wire.GpuInfo])


def test_stored_warm_workers_and_health_reports_read_the_same_way() -> None:
    assert _WARM_LIST.decode('[{"owner": "alice", "function": "f", "since": 1}]') == [
        wire.WarmWorker(owner="alice", function="f")
    ]
    assert _HEALTH_LIST.decode("[]") == []
    with pytest.raises(msgspec.ValidationError):
        _WARM_LIST.decode('[{"function": "f"}]')  # what is missing is still an error


def test_a_list_read_again_is_the_same_and_each_read_has_its_own() -> None:
    # Planning rounds read every node's lists each time: kept by their text, never shared.
    stored = '[{"index": 0, "uuid": "g0", "name": "Fake", "memory_mb": 1, "fake": true}]'
    first = _GPU_LIST.decode(stored)
    first.append(wire.GpuInfo(index=1, uuid="g1", name="Fake", memory_mb=1, fake=True))
    again = _GPU_LIST.decode(stored)
    assert again == [wire.GpuInfo(index=0, uuid="g0", name="Fake", memory_mb=1, fake=True)]
    assert again is not _GPU_LIST.decode(stored)
    # The bound holds: many different texts keep at most KEEP of them.
    stored_list = _Stored(wire.WarmWorker)
    for n in range(stored_list.KEEP + 10):
        assert stored_list.decode(f'[{{"owner": "u{n}", "function": "f"}}]')[0].owner == f"u{n}"
    assert len(stored_list._read) <= stored_list.KEEP
    with pytest.raises(msgspec.ValidationError):  # an error is not kept as a result
        stored_list.decode('[{"function": "f"}]')
    with pytest.raises(msgspec.ValidationError):
        stored_list.decode('[{"function": "f"}]')

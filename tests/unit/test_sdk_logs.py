"""Remote output printed live: exactly what came, once, in order, decoded per stream, into
whatever sys.stdout is at the moment of the write; and a finished call's log is drained."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pytest

from bulletin_core import wire
from sdk._watcher import LogPrinter, Watcher

OUT, ERR = wire.Stream.STDOUT, wire.Stream.STDERR


def chunk(n: int, data: bytes, stream: wire.Stream = OUT, iid: str = "a") -> wire.LogChunk:
    return wire.LogChunk(invocation_id=iid, n=n, stream=stream, data=data)


def test_split_characters_progress_bars_and_streams(capsys: pytest.CaptureFixture[str]) -> None:
    text = "épo 1\r10%|█\r100%|██████\n".encode()
    printer = LogPrinter()
    printer.write([chunk(1, text[:1]), chunk(2, text[1:12]), chunk(3, b"warn\xe2", ERR)])
    printer.write([chunk(4, text[12:]), chunk(5, b"\x82\xac\n", ERR)])
    assert capsys.readouterr() == ("épo 1\r10%|█\r100%|██████\n", "warn€\n")


def test_duplicates_and_reordered_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    printer = LogPrinter()
    assert printer.write([chunk(2, b"b"), chunk(1, b"a")]) == {"a"}
    assert printer.write([chunk(2, b"b"), chunk(3, b"c")]) == {"a"}
    assert printer.write([chunk(3, b"c")]) == set()
    assert capsys.readouterr().out == "abc"
    assert printer.printed("a") == 3


class Flushes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


def test_stdout_is_looked_up_and_flushed_at_each_write(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = Flushes(), Flushes()
    printer = LogPrinter()
    monkeypatch.setattr("sys.stdout", first)
    printer.write([chunk(1, b"cell 1\n")])
    monkeypatch.setattr("sys.stdout", second)  # what Jupyter does for the next cell
    printer.write([chunk(2, b"cell 2\n")])
    assert (first.flushed, second.flushed) == (["cell 1\n"], ["cell 2\n"])


def test_invalid_utf8_is_replaced_and_a_cut_character_flushed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    printer = LogPrinter()
    printer.write([chunk(1, b"ok \xff "), chunk(2, b"\xe2\x82")])
    printer.close("a")
    assert capsys.readouterr().out == "ok \ufffd \ufffd"


class ScriptedClient:
    """Stands in for sdk.Client's watch(): plays back prepared answers in order."""

    watch_timeout_s = 10.0

    def __init__(self, answers: list[wire.WatchResponse]) -> None:
        self.answers = answers
        self.asked: list[list[tuple[str, int]]] = []

    def watch(
        self, items: Sequence[wire.WatchItem], *, timeout_s: float | None = None
    ) -> wire.WatchResponse:
        self.asked.append([(item.id, item.log_after) for item in items])
        return self.answers.pop(0)


def test_a_finished_call_is_reported_only_once_its_log_is_drained(
    capsys: pytest.CaptureFixture[str],
) -> None:
    done = wire.Invocation(id="a", state=wire.State.SUCCEEDED, log_count=3)
    client = ScriptedClient(
        [
            wire.WatchResponse(invocations=[], logs=[chunk(1, b"1\n")]),
            wire.WatchResponse(invocations=[done], logs=[chunk(2, b"2\n")]),
            wire.WatchResponse(invocations=[done], logs=[chunk(3, b"3\n")]),
        ]
    )
    watcher = Watcher(client)  # type: ignore[arg-type]
    assert watcher.poll(["a"], 10.0) == {}
    assert watcher.poll(["a"], 10.0) == {}
    assert watcher.poll(["a"], 10.0) == {"a": done}
    assert client.asked == [[("a", 0)], [("a", 1)], [("a", 2)]]
    assert capsys.readouterr().out == "1\n2\n3\n"


def test_a_log_that_never_comes_does_not_hang_the_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    done = wire.Invocation(id="a", state=wire.State.FAILED, log_count=5)
    client = ScriptedClient([wire.WatchResponse(invocations=[done], logs=[])] * 2)
    watcher = Watcher(client)  # type: ignore[arg-type]
    assert watcher.poll(["a"], 1.0) == {}
    assert watcher.poll(["a"], 1.0) == {"a": done}


def test_many_ids_are_watched_in_batches(capsys: pytest.CaptureFixture[str]) -> None:
    ids = [f"i{n}" for n in range(wire.MAX_WATCH + 5)]
    client = ScriptedClient([wire.WatchResponse(invocations=[], logs=[])] * 2)
    Watcher(client).poll(ids, 10.0)  # type: ignore[arg-type]
    assert [len(batch) for batch in client.asked] == [wire.MAX_WATCH, 5]

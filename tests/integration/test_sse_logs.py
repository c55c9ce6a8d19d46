"""``GET /v1/invocations/{id}/logs``: an invocation's output as Server-Sent Events, live and
resumable, against a real gateway, PostgreSQL, nodelet and workers (only the GPUs are fake).
Calls go in with the sdk; the stream is read with plain httpx and a small SSE parser."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import cloudpickle
import httpx
import pytest

import sdk
from gateway.logs import BATCH
from tests.conftest import Cluster, wait_until

# Functions below travel by value, as a notebook's would (this module is not on the nodes).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass
class Event:
    event: str
    data: str
    id: str | None = None

    @property
    def json(self) -> dict[str, object]:
        value: dict[str, object] = json.loads(self.data)
        return value


@dataclass
class Stream:
    response: httpx.Response
    events: Iterator[Event]
    comments: list[str]


def parse(lines: Iterator[str], comments: list[str]) -> Iterator[Event]:
    """The SSE wire format, as a browser's EventSource reads it (only what this route uses)."""
    fields: dict[str, list[str]] = {}
    for line in lines:
        if not line:
            if "data" in fields:
                event = fields.get("event", ["message"])[-1]
                ids = fields.get("id")
                yield Event(event, "\n".join(fields["data"]), ids[-1] if ids else None)
            fields = {}
        elif line.startswith(":"):
            comments.append(line[1:].strip())
        else:
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))


@contextlib.contextmanager
def open_logs(
    cluster: Cluster,
    invocation_id: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> Iterator[Stream]:
    with (
        httpx.Client(base_url=cluster.url, timeout=httpx.Timeout(30)) as client,
        client.stream(
            "GET",
            f"/v1/invocations/{invocation_id}/logs",
            headers={"authorization": f"Bearer {token or cluster.token}", **(headers or {})},
            params=params,
        ) as response,
    ):
        comments: list[str] = []
        events = parse(response.iter_lines(), comments) if response.status_code == 200 else iter(())
        yield Stream(response, events, comments)


def read_all(cluster: Cluster, invocation_id: str, **kw: object) -> list[Event]:
    """Every event up to and including ``end``; the stream must close right after it."""
    with open_logs(cluster, invocation_id, **kw) as stream:  # type: ignore[arg-type]
        assert stream.response.status_code == 200, stream.response.read()
        events = list(stream.events)
    assert events and events[-1].event == "end", events
    return events


def chunks(events: list[Event]) -> list[Event]:
    """The log events, checked: ids are their chunk numbers, data names the same number and
    the same stream as the event."""
    found = [e for e in events if e.event != "end"]
    for e in found:
        assert e.event in {"stdout", "stderr"}, e
        assert e.json["n"] == int(e.id or "") and e.json["stream"] == e.event, e
    return found


def text(events: list[Event], stream: str = "stdout") -> str:
    return "".join(str(e.json["text"]) for e in events if e.event == stream)


def ids(events: list[Event]) -> list[int]:
    return [int(e.id or "") for e in chunks(events)]


@sdk.function()
def ticker(n: int, pause: float) -> int:
    for i in range(n):
        print(f"tick {i}", flush=True)
        time.sleep(pause)
    return n


def test_a_running_call_streams_its_lines_live_in_order_then_ends_with_its_state(
    cluster: Cluster,
) -> None:
    call = ticker.spawn(4, 0.5)
    with open_logs(cluster, call.id) as stream:
        assert stream.response.status_code == 200
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        assert stream.response.headers["cache-control"] == "no-cache"
        assert stream.response.headers["x-accel-buffering"] == "no"
        first = next(stream.events)
        # Live: the first line arrives while the call still runs (2 s of it are left).
        assert call.status() == "running"
    assert (first.event, first.id, first.json) == (
        "stdout",
        "1",
        {"n": 1, "stream": "stdout", "text": "tick 0\n"},
    )
    # A reconnect, as a browser's EventSource makes it, gets the rest and nothing again.
    rest = read_all(cluster, call.id, headers={"Last-Event-ID": "1"})
    assert rest[-1].json == {"state": "succeeded", "log_count": ids(rest)[-1]}
    assert rest[-1].id is None
    assert text([first, *rest]) == "".join(f"tick {i}\n" for i in range(4))
    assert ids([first, *rest]) == list(range(1, ids(rest)[-1] + 1))
    assert call.result(timeout=30) == 4
    assert call.status() == "succeeded"


def test_a_finished_call_streams_its_whole_log_at_once_and_ends(cluster: Cluster) -> None:
    call = ticker.spawn(3, 0.2)
    assert call.result(timeout=30) == 3
    started = time.monotonic()
    events = read_all(cluster, call.id)
    assert time.monotonic() - started < 1.0  # no waiting for anything
    assert text(events) == "tick 0\ntick 1\ntick 2\n"
    assert ids(events) == list(range(1, len(events)))
    assert events[-1].json == {"state": "succeeded", "log_count": len(events) - 1}


def test_a_cursor_resumes_after_exactly_that_chunk(cluster: Cluster) -> None:
    call = ticker.spawn(4, 0.2)
    call.result(timeout=30)
    whole = read_all(cluster, call.id)
    count = len(whole) - 1
    assert count >= 4  # a line every 0.2 s: one chunk each at least
    for k in range(count + 1):
        expected = [(e.id, e.event, e.data) for e in whole[k:]]
        for how in ({"headers": {"Last-Event-ID": str(k)}}, {"params": {"after": str(k)}}):
            resumed = read_all(cluster, call.id, **how)
            assert [(e.id, e.event, e.data) for e in resumed] == expected, (k, how)
    # The header wins: an EventSource opened on ?after=N reconnects with its last id.
    both = read_all(cluster, call.id, headers={"Last-Event-ID": "3"}, params={"after": "1"})
    assert ids(both) == list(range(4, count + 1))
    # A cursor past the end of a finished log: nothing but the end.
    past = read_all(cluster, call.id, params={"after": str(count + 10)})
    assert [e.event for e in past] == ["end"]


@sdk.function()
def both_streams(n: int) -> None:
    for i in range(n):
        print(f"out {i}", flush=True)
        time.sleep(0.15)
        print(f"err {i}", file=sys.stderr, flush=True)
        time.sleep(0.15)
    raise ValueError("the last word")


def test_stderr_comes_as_stderr_events_in_order_with_stdout(cluster: Cluster) -> None:
    call = both_streams.spawn(3)
    events = read_all(cluster, call.id)
    with pytest.raises(ValueError, match="the last word"):
        call.result(timeout=30)
    lines = [(e.event, str(e.json["text"])) for e in chunks(events)]
    assert lines == [
        (stream, f"{stream[3:]} {i}\n") for i in range(3) for stream in ("stdout", "stderr")
    ]
    assert events[-1].json == {"state": "failed", "log_count": 6}


@sdk.function()
def awkward() -> None:
    import os

    def out(data: bytes) -> None:
        os.write(1, data)
        time.sleep(0.15)

    out(b"\rprogress 10%")
    out(b"\rprogress 100%")
    out(b"\n")
    out(b"data: not an event\r\n\n")
    out("é and 😀\n".encode())
    out(b"\xe2\x82")  # the euro sign, split between two chunks
    out(b"\xac split\n")
    out(b"bad \xff byte\n")
    out(b"no newline at the end")


def test_text_comes_through_exactly_whatever_its_newlines_and_chunk_boundaries(
    cluster: Cluster,
) -> None:
    call = awkward.spawn()
    call.result(timeout=30)
    events = read_all(cluster, call.id)
    assert text(events) == (
        "\rprogress 10%\rprogress 100%\n"
        "data: not an event\r\n\n"
        "é and 😀\n"
        "€ split\n"
        "bad \ufffd byte\n"
        "no newline at the end"
    )
    log = chunks(events)
    assert all("\n" not in e.data for e in log)  # one data line each: the text is JSON
    split = next(e for e in log if "split" in str(e.json["text"]))
    assert log[log.index(split) - 1].json["text"] == ""  # the first half alone is no text
    # Resumed between the halves, the character still comes whole.
    resumed = read_all(cluster, call.id, headers={"Last-Event-ID": str(int(split.id or "") - 1)})
    assert resumed[0].json["text"] == "€ split\n"
    assert text(resumed).startswith("€ split\nbad")


@sdk.function()
def interleaved(n: int) -> None:
    import os

    for i in range(n):
        os.write(1 + i % 2, b"%d\n" % i)  # turn by turn: chunks do not merge across streams
        if i % 2:
            time.sleep(0.0005)


def test_a_log_of_many_batches_streams_whole_and_in_order(cluster: Cluster) -> None:
    n = 4000
    call = interleaved.spawn(n)
    events = read_all(cluster, call.id)  # opened while it runs
    count = len(events) - 1
    assert count > BATCH, "the log should take several reads"
    assert ids(events) == list(range(1, count + 1))
    assert text(events, "stdout") == "".join(f"{i}\n" for i in range(0, n, 2))
    assert text(events, "stderr") == "".join(f"{i}\n" for i in range(1, n, 2))
    resumed = read_all(cluster, call.id, params={"after": str(BATCH - 5)})
    assert [e.data for e in resumed] == [e.data for e in events[BATCH - 5 :]]


@sdk.function()
def quiet(pause: float) -> str:
    print("before", flush=True)
    time.sleep(pause)
    print("after", flush=True)
    return "done"


def test_an_idle_stream_sends_keep_alive_comments(cluster: Cluster) -> None:
    # The test gateway's long_poll_s is 5: keep-alives come at most that far apart.
    call = quiet.spawn(6.5)
    with open_logs(cluster, call.id) as stream:
        events = list(stream.events)
    assert stream.comments and set(stream.comments) == {"keep-alive"}
    assert text(events) == "before\nafter\n"
    assert events[-1].json["state"] == "succeeded"


def test_closing_the_stream_mid_call_leaves_the_call_and_the_gateway_well(
    cluster: Cluster,
) -> None:
    call = ticker.spawn(3, 0.4)
    for _ in range(3):
        with open_logs(cluster, call.id) as stream:
            next(stream.events)
    assert call.result(timeout=30) == 3
    assert text(read_all(cluster, call.id)) == "tick 0\ntick 1\ntick 2\n"
    # The gateway let go of each stream (its subscription, its reads): 3 cut short, 1 ended.
    log = cluster.dir / "gateway.log"
    closed = f"log stream of {call.id} closed"
    wait_until(lambda: log.read_text().count(closed) == 4, 10, "the streams to close")


def test_others_and_unknown_invocations_are_not_found_and_bad_cursors_refused(
    cluster: Cluster,
) -> None:
    call = ticker.spawn(1, 0)
    call.result(timeout=30)
    bob = cluster.add_user("bob")
    for who, invocation_id in [
        (bob, call.id),
        (cluster.token, str(uuid.uuid4())),
        (cluster.token, "not-an-id"),
    ]:
        with open_logs(cluster, invocation_id, token=who) as stream:
            r = stream.response
            assert r.status_code == 404, invocation_id
            assert r.headers["content-type"] == "application/problem+json"
            assert r.read() and r.json()["status"] == 404
    for how in (
        {"headers": {"Last-Event-ID": "x"}},
        {"headers": {"Last-Event-ID": "-1"}},
        {"params": {"after": "x"}},
        {"params": {"after": "-1"}},
    ):
        with open_logs(cluster, call.id, **how) as stream:  # type: ignore[arg-type]
            assert stream.response.status_code == 400, how
            assert stream.response.headers["content-type"] == "application/problem+json"
    r = httpx.get(f"{cluster.url}/v1/invocations/{call.id}/logs")
    assert r.status_code == 401
    head = httpx.head(
        f"{cluster.url}/v1/invocations/{call.id}/logs",
        headers={"authorization": f"Bearer {cluster.token}"},
    )
    assert head.status_code == 200
    assert head.headers["content-type"].startswith("text/event-stream")

"""nodelet.completions.Completions: outcomes handed in while a request is in flight go in one
batch; a lone outcome that is no map item's takes the single-attempt route (one statement at
the gateway instead of a batch's lock, completion, top-up and wake)."""

from __future__ import annotations

import asyncio
from typing import Any

from bulletin_core import wire
from nodelet.completions import Completions


class RecordingClient:
    """Stands in for GatewayClient: records what was sent, answers every outcome done."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[str]]] = []
        self.release = asyncio.Event()

    async def complete(self, invocation_id: str, request: wire.CompleteRequest) -> None:
        self.sent.append(("single", [invocation_id]))
        await self.release.wait()

    async def complete_many(
        self, completions: list[wire.Completion], *, take_more: bool
    ) -> wire.CompleteManyResponse:
        self.sent.append(("batch", [c.invocation_id for c in completions]))
        await self.release.wait()
        return wire.CompleteManyResponse(
            done=[c.invocation_id for c in completions], stale=[], assignments=[]
        )


def outcome() -> wire.CompleteRequest:
    return wire.CompleteRequest(epoch=1, state="succeeded", result=b"r")


def test_a_lone_outcome_of_no_map_takes_the_single_route_and_the_rest_go_in_batches() -> None:
    async def main() -> list[tuple[str, list[str]]]:
        client = RecordingClient()
        completions = Completions(client, lambda _: None, lambda: True)  # type: ignore[arg-type]
        first = asyncio.create_task(completions.complete("a", outcome(), mapped=False))
        await asyncio.sleep(0.01)  # "a" is in flight: the next ones wait for it, together
        rest: list[asyncio.Task[Any]] = [
            asyncio.create_task(completions.complete(i, outcome(), mapped=False))
            for i in ("b", "c")
        ]
        await asyncio.sleep(0.01)
        client.release.set()
        await asyncio.gather(first, *rest)
        client.release.clear()
        # A map item alone still goes by the batch route: its answer brings the next items.
        item = asyncio.create_task(completions.complete("d", outcome(), mapped=True))
        await asyncio.sleep(0.01)
        client.release.set()
        await item
        await completions.aclose()
        return client.sent

    assert asyncio.run(main()) == [
        ("single", ["a"]),
        ("batch", ["b", "c"]),
        ("batch", ["d"]),
    ]

"""The nodelet's HTTP client for the gateway's node routes (docs/protocol.md).

Every request carries the node token and an explicit timeout; every failure is mapped to a
:mod:`nodelet.errors` exception in :func:`_error_for`, so transport errors never leave this
module. The short JSON exchanges (poll, heartbeat, start, logs, complete...) go through
:mod:`bulletin_core.http1`, which costs a tenth of httpx's CPU per request; payload
downloads and result uploads, which stream, through httpx.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import TypeVar
from urllib.parse import quote

import httpx
import msgspec

from bulletin_core import http1, tls, wire
from nodelet import userfiles
from nodelet.errors import (
    AuthRejected,
    GatewayRejected,
    GatewayUnavailable,
    NodeletError,
    StaleAttempt,
    Superseded,
)

_T = TypeVar("_T")

#: Payload downloads and result uploads are streamed in chunks of at most this size.
TRANSFER_CHUNK = 4 * 1024 * 1024
#: Many attempts' outcomes in one request.
COMPLETE_MANY = "/v1/node/complete"

_register_decoder = msgspec.json.Decoder(wire.RegisterResponse)
_heartbeat_decoder = msgspec.json.Decoder(wire.HeartbeatResponse)
_poll_decoder = msgspec.json.Decoder(wire.PollResponse)
_complete_many_decoder = msgspec.json.Decoder(wire.CompleteManyResponse)
_blob_decoder = msgspec.json.Decoder(wire.BlobRef)
_cluster_decoder = msgspec.json.Decoder(wire.ClusterInfo)
_problem_decoder = msgspec.json.Decoder(wire.Problem)
_encoder = msgspec.json.Encoder()


class GatewayClient:
    """Async client for ``/v1/node/...``; one per nodelet, closed with :meth:`aclose`."""

    def __init__(
        self, base_url: str, token: str, *, timeout_s: float = 10.0, ca_file: str = ""
    ) -> None:
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            verify=tls.verify(ca_file),
        )
        self._fast = http1.Pool(
            base_url, headers={"Authorization": f"Bearer {token}"}, tls=tls.context(ca_file)
        )

    async def aclose(self) -> None:
        await self._fast.aclose()
        await self._http.aclose()

    async def register(self, request: wire.RegisterRequest) -> wire.RegisterResponse:
        try:
            response = await self._post("/v1/node/register", request)
        except StaleAttempt as exc:
            # 409 here is not about an attempt: the token was made for a node of another name.
            raise GatewayRejected(
                f"registration refused: {exc.detail}; start the nodelet with the node name "
                "its token was made for",
                status=exc.status,
                detail=exc.detail,
            ) from exc
        registration = _decode(_register_decoder, response, "POST", "/v1/node/register")
        # Every later request names this incarnation: the gateway refuses an earlier one's.
        self._http.headers[wire.INCARNATION_HEADER] = str(registration.incarnation)
        self._fast.headers[wire.INCARNATION_HEADER] = str(registration.incarnation)
        return registration

    async def cluster(self) -> wire.ClusterInfo:
        """What the gateway tells this node of the cluster, its name (the token's) included.
        Read only, and needs no registration: it may be asked while a nodelet of the node
        runs."""
        response = await self._send("GET", "/v1/node/cluster")
        return _decode(_cluster_decoder, response, "GET", "/v1/node/cluster")

    async def heartbeat(
        self,
        running: list[wire.Attempt],
        *,
        gpu_health: list[wire.GpuHealthReport] | None = None,
        warm: list[wire.WarmWorker] | None = None,
        timeout_s: float | None = None,
    ) -> wire.HeartbeatResponse:
        request = wire.HeartbeatRequest(
            running=running, gpu_health=gpu_health or [], warm=warm or []
        )
        response = await self._post("/v1/node/heartbeat", request, timeout_s=timeout_s)
        return _decode(_heartbeat_decoder, response, "POST", "/v1/node/heartbeat")

    async def poll(
        self,
        running: list[wire.Attempt],
        *,
        hold_s: float,
        preempting: list[wire.Attempt] | None = None,
    ) -> wire.PollResponse:
        """Long-poll for work; the gateway holds the request up to ``hold_s`` seconds.
        ``preempting``: attempts of ``running`` already being preempted."""
        request = wire.PollRequest(running=running, timeout_s=hold_s, preempting=preempting or [])
        response = await self._post("/v1/node/poll", request, timeout_s=hold_s + self.timeout_s)
        return _decode(_poll_decoder, response, "POST", "/v1/node/poll")

    async def start(self, invocation_id: str, epoch: int) -> None:
        await self._post(_route(invocation_id, "start"), wire.StartRequest(epoch=epoch))

    async def payload_to_file(self, invocation_id: str, epoch: int, fd: int) -> int:
        """Stream the payload of an assignment that was not inline into the file open as
        ``fd`` (emptied first, so a retry starts afresh), a chunk at a time; returns its
        size. Never the whole payload in memory."""
        route = _route(invocation_id, "payload")
        size = 0
        try:
            async with self._http.stream(
                "GET", route, params={"epoch": epoch}, timeout=self.timeout_s
            ) as response:
                if response.is_error:
                    await response.aread()
                    raise _error_for("GET", route, _answer(response))
                await asyncio.to_thread(os.ftruncate, fd, 0)
                pending = bytearray()
                async for piece in response.aiter_bytes():
                    pending += piece
                    if len(pending) >= TRANSFER_CHUNK:
                        size += await _write(fd, size, pending)
                size += await _write(fd, size, pending)
        except httpx.HTTPError as exc:
            raise _unavailable("GET", route, exc) from exc
        return size

    async def logs(self, invocation_id: str, request: wire.LogsRequest) -> None:
        await self._post(_route(invocation_id, "logs"), request)

    async def upload_result(self, invocation_id: str, epoch: int, data: bytes) -> wire.BlobRef:
        """Stream a result too big to inline; the answer names the blob for ``complete``."""
        return await self._put_result(invocation_id, epoch, _chunks(data), len(data))

    async def upload_result_file(
        self, invocation_id: str, epoch: int, file: userfiles.Opened
    ) -> wire.BlobRef:
        """Stream the result in an opened file up as a blob, a chunk at a time (never the
        whole file in memory), as long as it was when opened. Each call reads it from the
        start, so it may be retried."""
        chunks = _file_chunks(file.fd, file.size)
        return await self._put_result(invocation_id, epoch, chunks, file.size)

    async def _put_result(
        self, invocation_id: str, epoch: int, content: AsyncIterator[bytes], size: int
    ) -> wire.BlobRef:
        route = _route(invocation_id, "result")
        try:
            response = await self._http.request(
                "PUT",
                route,
                params={"epoch": epoch},
                content=content,
                headers={"Content-Type": wire.OCTET_STREAM, "Content-Length": str(size)},
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise _unavailable("PUT", route, exc) from exc
        answer = _answer(response)
        if answer.is_error:
            raise _error_for("PUT", route, answer)
        return _decode(_blob_decoder, answer, "PUT", route)

    async def leave(self, *, timeout_s: float) -> None:
        """Tell the gateway this node is stopping: no more work for it."""
        await self._send("POST", "/v1/node/leave", timeout_s=timeout_s)

    async def release(self, invocation_id: str, epoch: int, *, timeout_s: float) -> None:
        await self._post(
            _route(invocation_id, "release"), wire.ReleaseRequest(epoch=epoch), timeout_s=timeout_s
        )

    async def complete(self, invocation_id: str, request: wire.CompleteRequest) -> None:
        await self._post(_route(invocation_id, "complete"), request)

    async def complete_many(
        self, completions: list[wire.Completion], *, take_more: bool
    ) -> wire.CompleteManyResponse:
        """Many outcomes in one request (``nodelet.completions`` batches them); the answer
        says which were committed and brings the next items of the maps completed."""
        request = wire.CompleteManyRequest(completions=completions, take_more=take_more)
        response = await self._post(COMPLETE_MANY, request)
        return _decode(_complete_many_decoder, response, "POST", COMPLETE_MANY)

    async def _post(
        self, path: str, body: msgspec.Struct, *, timeout_s: float | None = None
    ) -> http1.Answer:
        return await self._send(
            "POST",
            path,
            body=_encoder.encode(body),
            headers={"Content-Type": "application/json"},
            timeout_s=timeout_s,
        )

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> http1.Answer:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            answer = await self._fast.request(
                method, path, body=body, headers=headers, timeout_s=timeout
            )
        except http1.TransportError as exc:
            raise _unavailable(method, path, exc) from exc
        if answer.is_error:
            raise _error_for(method, path, answer)
        return answer


async def _write(fd: int, offset: int, pending: bytearray) -> int:
    """Write out and empty ``pending`` at ``offset``, in a thread: a slow disk must not stall
    heartbeats."""
    data = bytes(pending)
    pending.clear()
    done = 0
    while done < len(data):
        done += await asyncio.to_thread(os.pwrite, fd, data[done:] if done else data, offset + done)
    return len(data)


def _answer(response: httpx.Response) -> http1.Answer:
    return http1.Answer(
        response.status_code, response.reason_phrase, dict(response.headers), response.content
    )


def _unavailable(
    method: str, path: str, exc: httpx.HTTPError | http1.TransportError
) -> GatewayUnavailable:
    if untrusted := tls.untrusted(exc):
        # Retried like an outage (a MITM gets nothing either way), but saying what to do.
        reason = (
            f"the gateway's TLS certificate is not trusted ({untrusted}): if the cluster has "
            "its own CA, give its certificate with --ca-file"
        )
        return GatewayUnavailable(f"{method} {path} failed: {reason}")
    # Timeouts stringify as "": the type name alone says what happened.
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return GatewayUnavailable(f"{method} {path} failed: {reason}")


def _route(invocation_id: str, action: str) -> str:
    return f"/v1/node/invocations/{quote(invocation_id, safe='')}/{action}"


def _decode(
    decoder: msgspec.json.Decoder[_T], answer: http1.Answer, method: str = "", path: str = ""
) -> _T:
    try:
        return decoder.decode(answer.body)
    except msgspec.DecodeError as exc:
        raise GatewayRejected(
            f"{method} {path} answered a malformed body: {exc}", status=answer.status
        ) from exc


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for offset in range(0, len(data), TRANSFER_CHUNK):
        yield bytes(view[offset : offset + TRANSFER_CHUNK])


async def _file_chunks(fd: int, size: int) -> AsyncIterator[bytes]:
    for offset in range(0, size, TRANSFER_CHUNK):
        length = min(TRANSFER_CHUNK, size - offset)
        yield await asyncio.to_thread(userfiles.read_exactly, fd, offset, length)


def _error_for(method: str, path: str, answer: http1.Answer) -> NodeletError:
    """The one place that maps an HTTP error answer to a nodelet exception."""
    status = answer.status
    detail, code = _detail(answer)
    where = f"{method} {path} answered {status}"
    if status in (401, 403):
        return AuthRejected(
            f"{where}: the gateway rejected the node token ({detail}); "
            "check the node token file and that the node is still enrolled",
            status=status,
            detail=detail,
        )
    if status == 409 and code == "superseded":
        return Superseded(f"{where}: {detail}", status=status, detail=detail)
    if status == 409:
        return StaleAttempt(f"{where}: {detail}", status=status, detail=detail)
    if status == 429 or status >= 500:
        return GatewayUnavailable(f"{where}: {detail}", status=status, detail=detail, code=code)
    return GatewayRejected(f"{where}: {detail}", status=status, detail=detail)


def _detail(answer: http1.Answer) -> tuple[str, str]:
    """The problem's detail (or what the answer says) and its code."""
    try:
        problem = _problem_decoder.decode(answer.body)
    except msgspec.DecodeError:
        return answer.text[:200] or answer.reason, ""
    return problem.detail or problem.title, problem.code

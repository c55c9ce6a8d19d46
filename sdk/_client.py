"""The HTTP client of the gateway's user routes (``docs/protocol.md``).

Every request goes through ``Client._request``: it retries transport errors, 502/503/504 and
429 (the per-user rate limit) with the project's backoff (``bulletin_core.backoff``: exponential,
full jitter) until a deadline, waiting at least what an answer's ``Retry-After`` asks (every
user route is idempotent: submissions carry idempotency keys, the rest read or cancel), and
``error_for`` turns every other error answer into an sdk exception, so no httpx exception
ever reaches the user.
"""

from __future__ import annotations

import email.utils
import logging
import math
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast
from urllib.parse import quote, urlencode, urlsplit
from urllib.request import getproxies_environment

import httpx
import msgspec

from bulletin_core import http1, shared, tls, wire
from bulletin_core.backoff import Backoff
from sdk._errors import (
    AuthError,
    ConfigError,
    GatewayError,
    GatewayUnreachable,
    InvalidRequest,
    NotFoundError,
    RateLimited,
)
from sdk._liveness import Liveness

T = TypeVar("T")
Body = bytes | Callable[[], Iterable[bytes]] | None
Pieces = Callable[[], Iterable[bytes | bytearray | memoryview]]

_log = logging.getLogger(__name__)

_ENCODER = msgspec.json.Encoder()
_SUBMITTED = msgspec.json.Decoder(wire.SubmitResponse)
_INVOCATION = msgspec.json.Decoder(wire.Invocation)
_CANCELLED = msgspec.json.Decoder(wire.CancelResponse)
_FUNCTION = msgspec.json.Decoder(wire.FunctionInfo)
_FUNCTIONS = msgspec.json.Decoder(list[wire.FunctionInfo])
_INVOCATIONS = msgspec.json.Decoder(list[wire.Invocation])
_WATCHED = msgspec.json.Decoder(wire.WatchResponse)
_BLOB = msgspec.json.Decoder(wire.BlobRef)
_CLUSTER = msgspec.json.Decoder(wire.ClusterInfo)
_PROBLEM = msgspec.json.Decoder(wire.Problem)

_JSON = {"Content-Type": "application/json"}
#: Largest piece of a streamed upload: httpx's sync client sends one big bytes body in
#: quadratic time, so blobs go as an iterator of slices of at most this size.
UPLOAD_CHUNK = 4 * 1024 * 1024
_RETRY_STATUS = frozenset({429, 502, 503, 504})
# Worth retrying: the gateway may be restarting or a replica going away. Not retried: errors
# that will not heal by themselves (bad URL scheme, local protocol misuse).
_TRANSIENT = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    httpx.ProxyError,
)
#: How many of the cluster's shared_ttl_s a payload file of ours may be left before we
#: delete it (results: one).
PAYLOAD_AGE_TTLS = 7
#: How long whether this machine sees the shared directory is taken as known.
SHARED_CHECK_S = 5.0
# Headroom of the HTTP read timeout over the gateway's long-poll hold.
_LONG_POLL_MARGIN_S = 15.0


class _Retry(Exception):
    """A transient failure of one attempt (internal to ``Client._request``): ``after`` is
    the least to wait before the next (the answer's Retry-After), ``final`` the error to raise
    when there is no time left for one (None: GatewayUnreachable)."""

    def __init__(
        self, reason: str, *, after: float = 0.0, final: GatewayError | None = None
    ) -> None:
        super().__init__(reason)
        self.after = after
        self.final = final


def retry_schedule(initial_s: float, max_s: float) -> Backoff:
    """The backoff of ``Client.backoff_initial_s`` and ``backoff_max_s``, whatever a user set
    them to: a first delay above the maximum waits the maximum, none waits a millisecond."""
    most = max(0.001, max_s)
    return Backoff(min(max(0.001, initial_s), most), most)


class Client:
    """A connection to one gateway, authenticated by a user token. Thread-safe.

    Attributes that tune behaviour (class defaults, set them on an instance to change):
    ``inline_limit`` (bytes; larger payloads are uploaded as blobs first),
    ``watch_timeout_s`` (long-poll hold asked of the gateway), ``retry_deadline_s``,
    ``backoff_initial_s`` and ``backoff_max_s`` (retrying transient failures: each wait is
    drawn between 0 and a cap that doubles from the first to the second),
    ``outage_patience_s`` (how long waiting for calls rides through an unreachable gateway),
    ``use_shared_dir`` (pass big state through the cluster's shared directory when this
    machine sees it; False: always through the gateway).
    """

    inline_limit: int = 1024 * 1024
    watch_timeout_s: float = 10.0
    retry_deadline_s: float = 30.0
    #: How long a wait for calls keeps waiting through an unreachable gateway (one being
    #: restarted) before it raises GatewayUnreachable.
    outage_patience_s: float = 300.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    use_shared_dir: bool = True

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30.0,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"The gateway URL must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._cluster: wire.ClusterInfo | None = None
        self._shared_unusable = False
        #: Whether the shared directory was seen here, and when (``_sees``).
        self._seen: tuple[bool, float] | None = None
        self._own_dir = False
        self._swept = False
        # Threads share a client: what it sets up once is set up under these, by one of them.
        self._asking = threading.Lock()  # GET /v1/cluster
        self._setting_up = threading.Lock()  # our directory of the shared directory, the sweep
        # ca: the PEM of the CA that signed an https:// gateway's certificate. One context
        # for both paths: they trust the same CAs (httpx's: certifi's, or SSL_CERT_FILE).
        verify = httpx.create_ssl_context(verify=tls.verify(ca))
        headers = {"Authorization": f"Bearer {token}", "User-Agent": "bulletin-sdk"}
        # Streams (blobs) go through httpx, and everything does when the environment names
        # a proxy for the gateway's scheme (httpx honours it).
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            verify=verify,
        )
        #: Small JSON exchanges (a blocking call is one) go through this leaner client
        #: (bulletin_core/http1.py: a few tens of µs of CPU where httpx spends ~0.7 ms).
        self._fast = None
        if not _proxied(self.url):
            self._fast = http1.SyncPool(self.url, headers=headers, tls=verify)
        #: Called with (method, path) as each request is sent (tests and benchmarks count
        #: them).
        self.request_hooks: list[Callable[[str, str], None]] = []
        #: The caller session of the calls this client waits for (sdk/_liveness.py).
        self.session = str(uuid.uuid4())
        self.liveness = Liveness(self.keep_alive)

    def __repr__(self) -> str:
        return f"<sdk.Client {self.url}>"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool. The client cannot be used afterwards."""
        self._http.close()
        if self._fast is not None:
            self._fast.close()

    # ------------------------------------------------------------------ routes

    def submit(
        self,
        calls: Sequence[wire.CallSpec],
        *,
        deadline_s: float | None = None,
        map_id: str | None = None,
    ) -> list[str]:
        """Submit calls (at most ``wire.MAX_SUBMIT``); returns their ids in input order.
        ``map_id``: they are items of that map (``SubmitRequest.map_id``)."""
        body = _ENCODER.encode(wire.SubmitRequest(calls=list(calls), map_id=map_id))
        answer = self._request(
            "POST",
            "/v1/invocations",
            body=body,
            headers=_JSON,
            read=_Json(_SUBMITTED),
            deadline_s=deadline_s,
        )
        if len(answer.ids) != len(calls):
            raise GatewayError(f"The gateway returned {len(answer.ids)} ids for {len(calls)} calls")
        if any(c.caller_session is not None for c in calls):
            self.liveness.set_interval(answer.keepalive_s)
        return answer.ids

    def submit_waiting(self, spec: wire.CallSpec, wait_s: float) -> wire.SubmitResponse:
        """Submit one call and wait in the same request, up to ``wait_s``, for its first news
        (finished, with its result, or log chunks): a blocking call's first watch round. Its
        session is kept alive meanwhile: the keepalive interval is known before the answer
        (``ClusterInfo.keepalive_s``)."""
        if spec.caller_session is not None:
            self.liveness.set_interval(self.cluster().keepalive_s)
        body = _ENCODER.encode(wire.SubmitRequest(calls=[spec]))
        answer = self._request(
            "POST",
            f"/v1/invocations?wait={wait_s:g}",
            body=body,
            headers=_JSON,
            read=_Json(_SUBMITTED),
            timeout=max(self.timeout, wait_s + _LONG_POLL_MARGIN_S),
        )
        if len(answer.ids) != 1:
            raise GatewayError(f"The gateway returned {len(answer.ids)} ids for 1 call")
        if spec.caller_session is not None:
            self.liveness.set_interval(answer.keepalive_s)
        return answer

    def keep_alive(self) -> None:
        """Tell the gateway this client still waits for its session's calls."""
        path = f"/v1/sessions/{quote(self.session, safe='')}/keepalive"
        self._request("POST", path, read=_NOTHING, deadline_s=self.liveness.interval_s)

    def get(self, invocation_id: str) -> wire.Invocation:
        """The current state of one invocation."""
        return self._request("GET", _path(invocation_id), read=_Json(_INVOCATION))

    def invocations(self, *, limit: int = 100) -> list[wire.Invocation]:
        """The caller's invocations, newest first."""
        params = {"limit": str(limit)}
        return self._request("GET", "/v1/invocations", params=params, read=_Json(_INVOCATIONS))

    def cancel(self, invocation_id: str, *, deadline_s: float | None = None) -> wire.Invocation:
        """Cancel one invocation; a finished one is returned unchanged."""
        path = _path(invocation_id) + "/cancel"
        return self._request("POST", path, read=_Json(_INVOCATION), deadline_s=deadline_s)

    def cancel_many(self, ids: Sequence[str], *, deadline_s: float | None = None) -> list[str]:
        """Cancel up to ``wire.MAX_WATCH`` invocations in one request; returns those it
        cancelled (finished ones are left as they are)."""
        body = _ENCODER.encode(wire.CancelRequest(ids=list(ids)))
        answer = self._request(
            "POST",
            "/v1/invocations/cancel",
            body=body,
            headers=_JSON,
            read=_Json(_CANCELLED),
            deadline_s=deadline_s,
        )
        return answer.cancelled

    def register_function(
        self, name: str, registration: wire.FunctionRegistration
    ) -> wire.FunctionInfo:
        """Register a function version under ``name`` (a no-op when it is already there)."""
        return self._request(
            "PUT",
            "/v1/functions/" + quote(name, safe=""),
            body=_ENCODER.encode(registration),
            headers=_JSON,
            read=_Json(_FUNCTION),
        )

    def functions(self, owner: str | None = None) -> list[wire.FunctionInfo]:
        """The latest version of each registered function of ``owner`` (None: yours) that
        you may see."""
        params = {} if owner is None else {"owner": owner}
        return self._request("GET", "/v1/functions", params=params, read=_Json(_FUNCTIONS))

    def unregister_function(self, name: str) -> None:
        """Remove every version of your registered function ``name``."""
        self._request("DELETE", "/v1/functions/" + quote(name, safe=""), read=_NOTHING)

    def watch(
        self, items: Sequence[wire.WatchItem], *, timeout_s: float | None = None
    ) -> wire.WatchResponse:
        """Long-poll for news (state changes, log chunks) on at most ``wire.MAX_WATCH`` items."""
        hold = self.watch_timeout_s if timeout_s is None else timeout_s
        body = _ENCODER.encode(wire.WatchRequest(items=list(items), timeout_s=hold))
        return self._request(
            "POST",
            "/v1/invocations/watch",
            body=body,
            headers=_JSON,
            read=_Json(_WATCHED),
            timeout=max(self.timeout, hold + _LONG_POLL_MARGIN_S),
        )

    def cluster(self) -> wire.ClusterInfo:
        """What the gateway says about the cluster (limits, shared directory); asked once."""
        if self._cluster is None:
            with self._asking:
                if self._cluster is None:
                    self._cluster = self._request("GET", "/v1/cluster", read=_Json(_CLUSTER))
        return self._cluster

    def shared_dir(self) -> str | None:
        """The cluster's shared directory if this machine sees it (and ``use_shared_dir``),
        and our own directory there can be used."""
        info = self.cluster()
        if self._shared_unusable or not self.use_shared_dir or not info.user:
            return None
        if not shared.valid_user(info.user) or not self._sees(info):
            return None
        assert info.shared_dir is not None  # sees() it
        with self._setting_up:  # by one thread; the others wait for it to be there
            if not self._own_dir and not self._shared_unusable:
                # Made now, as this account, so that results can come back through it too (a
                # worker that runs as another account than ours never makes it for us).
                try:
                    os.close(shared.open_user_dir(info.shared_dir, info.user, create=True))
                except OSError as exc:
                    self._unusable(exc)
                else:
                    self._own_dir = True
        return None if self._shared_unusable else info.shared_dir

    def _sees(self, info: wire.ClusterInfo) -> bool:
        """Whether this machine sees the cluster's shared directory: looked at again after
        ``SHARED_CHECK_S`` (a mount may come or go; reading its marker on every call cost a
        blocking call a tenth of a millisecond)."""
        now = time.monotonic()
        if self._seen is None or now - self._seen[1] > SHARED_CHECK_S:
            self._seen = (shared.sees(info.shared_dir, info.shared_dir_id), now)
        return self._seen[0]

    def _unusable(self, exc: OSError) -> None:
        self._shared_unusable = True
        warnings.warn(
            f"Bulletin: the cluster's shared directory cannot be used from here ({exc}); "
            "big call state goes through the gateway instead (slower)",
            UserWarning,
            stacklevel=5,
        )

    def write_payload_file(self, pieces: Iterable[bytes | memoryview]) -> tuple[str, str] | None:
        """Write a payload file into our own directory of the shared directory: its name
        (relative to the root) and path; None when the shared directory cannot be used (a
        warning says why, once, and big state goes through the gateway from then on)."""
        root, user = self.shared_dir(), self.cluster().user
        if root is None or user is None:
            return None
        name = shared.payload_name(user)
        try:
            path = shared.write_file(root, name, pieces)
        except OSError as exc:  # not our own directory, a full or read-only NAS...
            self._unusable(exc)
            return None
        self._sweep_once(root, user)
        return name, path

    def _sweep_once(self, root: str, user: str) -> None:
        """Delete our own files left in the shared directory (a user's directory is theirs
        alone: the gateway may not enter it), in the background, once per client: results
        older than the cluster keeps them, and payloads older than
        ``PAYLOAD_AGE_TTLS`` times that (one of a call still queued must stay; a notebook
        that died before its call ended leaves its payload behind)."""
        ttl = self.cluster().shared_ttl_s
        with self._setting_up:
            if self._swept or ttl is None:
                return
            self._swept = True

        def sweep() -> None:
            shared.sweep(root, ttl, user=user, kinds=("result",))
            shared.sweep(root, ttl * PAYLOAD_AGE_TTLS, user=user, kinds=("payload",))

        threading.Thread(target=sweep, name="bulletin-sweep", daemon=True).start()

    def get_result(self, invocation_id: str) -> bytearray:
        """Download an invocation's pickled outcome (``GET /v1/invocations/{id}/result``)."""
        return self._request("GET", _path(invocation_id) + "/result", read=_collect)

    def put_blob(
        self, data: bytes | bytearray | memoryview | Pieces, size: int = -1
    ) -> wire.BlobRef:
        """Upload a blob, streamed in slices of at most ``UPLOAD_CHUNK``: raw bytes, or a
        function giving the pieces (called again on a retry) and their total ``size``."""
        if callable(data):
            pieces = data
        else:
            view = memoryview(data).cast("B")
            size = view.nbytes

            def pieces() -> Iterable[memoryview]:
                return [view]

        headers = {"Content-Type": wire.OCTET_STREAM, "Content-Length": str(size)}
        return self._request(
            "PUT",
            "/v1/blobs",
            body=lambda: _slices(pieces()),
            headers=headers,
            read=_Json(_BLOB),
        )

    def get_blob(self, blob_id: str) -> bytearray:
        """Download a blob, streamed into one buffer (allocated once, at its full size)."""
        return self._request("GET", "/v1/blobs/" + quote(blob_id, safe=""), read=_collect)

    # ------------------------------------------------------------------ transport

    def _request(
        self,
        method: str,
        path: str,
        *,
        read: Callable[[httpx.Response], T],
        body: Body = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
        deadline_s: float | None = None,
    ) -> T:
        """Send one request, retrying transient failures with backoff until the deadline."""
        budget = self.retry_deadline_s if deadline_s is None else deadline_s
        start = time.monotonic()
        backoff = retry_schedule(self.backoff_initial_s, self.backoff_max_s)
        if deadline_s is not None:
            timeout = min(timeout or self.timeout, deadline_s)
        while True:
            try:
                return self._attempt(method, path, read, body, headers, params, timeout)
            except _Retry as failure:
                retry = failure
            # Drawn before sleeping, not by Backoff.sleep_sync: a wait that would end past
            # the deadline is not waited at all.
            wait = max(backoff.next_delay(), retry.after)
            if time.monotonic() - start + wait > budget:
                if retry.final is not None:
                    raise retry.final from None
                raise GatewayUnreachable(_unreachable(self.url, str(retry), budget)) from None
            _log.debug("%s %s failed (%s); retrying in %.2f s", method, path, retry, wait)
            time.sleep(wait)

    def _attempt(
        self,
        method: str,
        path: str,
        read: Callable[[httpx.Response], T],
        body: Body,
        headers: dict[str, str] | None,
        params: dict[str, str] | None,
        timeout: float | None,
    ) -> T:
        """One try. Raises ``_Retry`` for a transient failure, an sdk exception otherwise."""
        if self._http.is_closed:
            raise GatewayError(f"{self!r} is closed")
        for hook in self.request_hooks:
            hook(method, path)
        if self._fast is not None and isinstance(read, _Json) and not callable(body):
            wait = self.timeout if timeout is None else timeout
            return self._attempt_fast(method, path, read, body or b"", headers, params, wait)
        content = body() if callable(body) else body
        request = self._http.build_request(
            method,
            path,
            content=content,
            headers=headers,
            params=params,
            timeout=self.timeout if timeout is None else timeout,
        )
        try:
            return self._exchange(request, read)
        except _TRANSIENT as exc:
            if untrusted := tls.untrusted(exc):
                raise ConfigError(_untrusted(self.url, untrusted)) from None
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:
            raise GatewayError(f"{method} {self.url}{path} failed: {exc}") from None
        except msgspec.DecodeError as exc:
            raise GatewayError(f"Unexpected answer to {method} {path}: {exc}") from None

    def _attempt_fast(
        self,
        method: str,
        path: str,
        read: _Json[T],
        body: bytes,
        headers: dict[str, str] | None,
        params: dict[str, str] | None,
        timeout: float,
    ) -> T:
        """One try through the lean client (``_fast``), answered and refused as ``_attempt``."""
        assert self._fast is not None
        target = f"{path}{'&' if '?' in path else '?'}{urlencode(params)}" if params else path
        try:
            answer = self._fast.request(
                method, target, body=body, headers=headers, timeout_s=timeout
            )
        except http1.TransportError as exc:
            if untrusted := tls.untrusted(exc):
                raise ConfigError(_untrusted(self.url, untrusted)) from None
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        if answer.is_error:
            _refuse(httpx.Response(answer.status, headers=answer.headers, content=answer.body))
        try:
            return read.decode(answer.body)
        except msgspec.DecodeError as exc:
            raise GatewayError(f"Unexpected answer to {method} {path}: {exc}") from None

    def _exchange(self, request: httpx.Request, read: Callable[[httpx.Response], T]) -> T:
        response = self._http.send(request, stream=True)
        try:
            if response.is_error:
                response.read()
                _refuse(response)
            return read(response)
        finally:
            response.close()


def _refuse(response: httpx.Response) -> None:
    """Raise for an error answer (read whole): ``_Retry`` when it may heal by itself."""
    if response.status_code in _RETRY_STATUS:
        after = retry_after(response)
        final = error_for(response) if response.status_code == 429 else None
        raise _Retry(f"HTTP {response.status_code}", after=after, final=final)
    raise error_for(response)


def _proxied(url: str) -> bool:
    """Whether the environment names a proxy for ``url``'s scheme (NO_PROXY aside: httpx
    decides those)."""
    proxies = getproxies_environment()
    return bool(proxies.get(urlsplit(url).scheme) or proxies.get("all"))


def error_for(response: httpx.Response) -> GatewayError:
    """The sdk exception for an error answer of the gateway (the one place they are mapped)."""
    status = response.status_code
    detail = _detail(response)
    if status in (401, 403):
        message = (
            f"The gateway refused the token ({status}: {detail}). Check BULLETIN_TOKEN, or the "
            "token in the client.toml that `bulletin up` wrote (BULLETIN_CONFIG)."
        )
        return AuthError(message, status=status, detail=detail)
    if status == 404:
        return NotFoundError(f"Not found: {detail}", status=status, detail=detail)
    if status in (400, 413, 415, 422):
        return InvalidRequest(detail, status=status, detail=detail)
    if status == 429:
        message = f"Rate limited by the gateway ({detail}); slow down or retry later"
        return RateLimited(message, status=status, detail=detail, retry_after=retry_after(response))
    if status in (502, 503, 504):
        return GatewayUnreachable(f"Gateway unavailable ({status}): {detail}", status=status)
    return GatewayError(f"The gateway answered {status}: {detail}", status=status, detail=detail)


def retry_after(response: httpx.Response) -> float:
    """Seconds the answer's ``Retry-After`` asks to wait (seconds or an HTTP date); 0 when
    it has none or it cannot be read."""
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else 0.0
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:
        return 0.0
    return max(0.0, when.timestamp() - time.time())


def _detail(response: httpx.Response) -> str:
    """The problem+json ``detail`` (or title) of an error answer, else its text."""
    try:
        problem = _PROBLEM.decode(response.content)
    except msgspec.DecodeError:
        return response.text[:500] or response.reason_phrase
    return problem.detail or problem.title


def _untrusted(url: str, why: str) -> str:
    return (
        f"The gateway {url} presented a TLS certificate this machine does not trust ({why}). "
        'If the cluster has its own CA, give its certificate: `ca = "/path/to/ca.pem"` in '
        "client.toml, BULLETIN_CA, or sdk.connect(..., ca=...)."
    )


def _unreachable(url: str, reason: str, budget: float) -> str:
    return (
        f"Cannot reach the Bulletin gateway at {url} ({reason}; gave up after {budget:g} s). "
        "Check that the cluster is up (`bulletin up`) and that BULLETIN_URL or the client.toml "
        "in BULLETIN_CONFIG points at it."
    )


def _path(invocation_id: str) -> str:
    return "/v1/invocations/" + quote(invocation_id, safe="")


class _Json(Generic[T]):
    """Reads an answer's JSON body (a small one: such requests may take the lean client)."""

    def __init__(self, decoder: msgspec.json.Decoder[T] | None) -> None:
        self._decoder = decoder

    def decode(self, body: bytes) -> T:
        return cast(T, None) if self._decoder is None else self._decoder.decode(body)

    def __call__(self, response: httpx.Response) -> T:
        return self.decode(response.read())


#: Reads nothing of the answer (its status says it all).
_NOTHING: _Json[None] = _Json(None)


def _collect(response: httpx.Response) -> bytearray:
    try:
        size = int(response.headers.get("Content-Length", ""))
    except ValueError:
        size = -1
    if size < 0:
        buffer = bytearray()
        for piece in response.iter_raw():
            buffer += piece
        return buffer
    buffer = bytearray(size)
    view = memoryview(buffer)
    offset = 0
    for piece in response.iter_raw():
        end = offset + len(piece)
        if end > size:
            raise GatewayError(f"the blob is longer than its Content-Length of {size} bytes")
        view[offset:end] = piece
        offset = end
    if offset != size:
        raise _Retry(f"the blob download ended after {offset} of {size} bytes")
    return buffer


def _slices(pieces: Iterable[bytes | bytearray | memoryview]) -> Iterable[bytes]:
    # memoryview slices are zero-copy; the transport accepts any bytes-like chunk.
    def generate() -> Iterator[Any]:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            for start in range(0, view.nbytes, UPLOAD_CHUNK):
                yield view[start : start + UPLOAD_CHUNK]

    return cast(Iterator[bytes], generate())

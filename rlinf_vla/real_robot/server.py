"""A websocket policy server: any registered policy behind the protocol of :mod:`.protocol`.

The server is thin: it validates requests, batches the ones that arrive together from
concurrent connections into one ``policy.act(obs, greedy=True)`` call, and sends back each
robot's action chunk ``float32 [K, A]``. A bad request gets an ``error`` reply naming what was
wrong and the connection stays open; an inference failure sends the remote traceback. Frames
over ``max_message_bytes`` close that connection with code 1009 (the websocket "message too
big" code and a reason); other connections are unaffected. ``GET /healthz`` answers ``OK``.

``ServerConfig(protocol="openpi")`` speaks openpi's protocol instead (:mod:`.openpi`): the same
validation, batching and limits; the observation keys of ``openpi_layout`` are mapped onto the
native request first, replies are ``{"actions": ...}`` and an error is a text frame followed by a
close with code 1011, as openpi's own server does, so a stock openpi client raises.

>>> server = PolicyServer(policy, "openvla_oft", ServerConfig(port=0))
>>> with server.run_in_thread() as url:          # ws://127.0.0.1:<port>
...     client = PolicyClient(url)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import numpy as np

from rlinf_vla.real_robot import codec, openpi
from rlinf_vla.real_robot.protocol import (
    CONTROL_RATE_RANGE_HZ,
    InferRequest,
    PolicyMetadata,
    RequestError,
    parse_infer_request,
    policy_metadata,
)
from rlinf_vla.real_robot.validation import require_finite

__all__ = ["PolicyServer", "ServerConfig"]

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """The ``server`` section of ``rlinf-vla serve``.

    Attributes:
        host: interface to bind; ``127.0.0.1`` (default) serves only this machine. Bind
            ``0.0.0.0`` only on a trusted robot network, with a ``token``.
        port: TCP port (``0``: any free port, printed at start).
        token: shared secret; clients send ``Authorization: Bearer <token>`` (or openpi's
            ``Api-Key <token>``). ``None``: none.
        max_message_bytes: the largest frame read from a client; bigger ones close the
            connection (1009). Two 224 px cameras need about 0.3 MB.
        max_batch_size: at most this many concurrent requests go into one ``act`` call.
        batch_window_ms: after the first request arrives, wait this long for others to batch
            (``0``: batch only what queued up while the previous batch ran).
        control_rate_hz: the control rate advertised to clients (the policy's training rate).
        greedy: ``act(obs, greedy=...)``; deterministic actions for deployment.
        auth_failure_delay_s: after a failed authentication, further wrong tokens from the
            peer's address are refused (HTTP 429, not logged) for this long, doubling with each
            further failure up to :data:`MAX_AUTH_BACKOFF_S`; ``0`` turns throttling off. The
            right token is always answered, so a guesser on the robot's address (or behind
            the same NAT) slows only its own guesses. One warning is logged per checked
            failure, so at most one per back-off window.
        allow_unauthenticated: serve a host other than this machine (``0.0.0.0``, a LAN
            address) without a ``token``; refused unless set, since anyone who reaches the
            port could then drive the robot's policy.
        protocol: ``native`` (:mod:`.protocol`) or ``openpi`` (:mod:`.openpi`).
        openpi_layout: with ``protocol=openpi``, the robot family whose observation keys are
            mapped (:data:`.openpi.LAYOUTS`: ``libero``, ``droid``, ``aloha``).
        openpi_default_prompt: with ``protocol=openpi``, the instruction used when a request
            has no ``prompt`` (openpi's ALOHA client sends none; its server has the same option).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    max_message_bytes: int = 8 * 1024 * 1024
    max_batch_size: int = 8
    batch_window_ms: float = 0.0
    control_rate_hz: float = 10.0
    greedy: bool = True
    auth_failure_delay_s: float = 1.0
    protocol: str = "native"
    openpi_layout: str = "libero"
    openpi_default_prompt: str | None = None
    allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        require_finite(self, "server")
        if self.protocol not in openpi.PROTOCOLS:
            raise ValueError(
                f"server.protocol must be one of {', '.join(openpi.PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.openpi_layout not in openpi.LAYOUTS:
            raise ValueError(
                f"server.openpi_layout must be one of {', '.join(openpi.LAYOUTS)}, "
                f"got {self.openpi_layout!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in 0..65535, got {self.port}")
        if not _valid_host(self.host):
            raise ValueError(
                f"server.host must be an IP address or a host name, got {self.host!r} "
                "(e.g. 127.0.0.1, 0.0.0.0, ::1 or localhost)"
            )
        if self.max_message_bytes < 1024:
            raise ValueError(
                f"server.max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"server.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.batch_window_ms < 0:
            raise ValueError(f"server.batch_window_ms must be >= 0, got {self.batch_window_ms}")
        low, high = CONTROL_RATE_RANGE_HZ
        if not low <= self.control_rate_hz <= high:
            raise ValueError(
                f"server.control_rate_hz must be in [{low:g}, {high:g}] Hz, got "
                f"{self.control_rate_hz}"
            )
        if self.auth_failure_delay_s < 0:
            raise ValueError(
                f"server.auth_failure_delay_s must be >= 0, got {self.auth_failure_delay_s}"
            )
        if self.token is not None and len(self.token) < 8:
            raise ValueError("server.token must have at least 8 characters")
        if self.token is None and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"server.host={self.host} serves other machines: set server.token=<secret> "
                "(clients send it), or server.allow_unauthenticated=true on a network you trust"
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (``localhost``, ``127.x.x.x``, ``::1``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: The longest a peer is refused after repeated authentication failures (s).
MAX_AUTH_BACKOFF_S = 60.0


@dataclass
class _AuthFailures:
    """Failed authentications of one peer address: how many in a row, refused until when."""

    count: int = 0
    blocked_until: float = 0.0


@dataclass
class _Pending:
    request: InferRequest
    future: asyncio.Future
    received: float


class PolicyServer:
    """Serve ``policy`` (a :class:`~rlinf_vla.policies.Policy`) over websockets.

    Args:
        policy: the loaded policy; its ``config`` gives the handshake metadata.
        name: its registered name (sent in the metadata).
        config: the server settings.
    """

    def __init__(self, policy: Any, name: str, config: ServerConfig) -> None:
        self.policy = policy
        self.config = config
        self.metadata: PolicyMetadata = policy_metadata(
            name, policy.config, config.control_rate_hz, config.max_message_bytes
        )
        self._wire = _WIRES[config.protocol](self.metadata, config)
        self.stats = {
            "requests": 0,
            "errors": 0,
            "batches": 0,
            "rejected_auth": 0,
            "throttled_auth": 0,
            "non_finite_actions": 0,
        }
        self._auth_failures: dict[str, _AuthFailures] = {}
        self.clock = time.monotonic  # replaceable in tests
        self._queue: asyncio.Queue[_Pending] | None = None
        self._waiting: set[asyncio.Future] = set()
        # One inference thread: torch modules are not re-entrant, and the event loop stays free.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-act")
        self.port: int | None = None

    # ------------------------------------------------------------------ inference
    def _act(self, batch: list[InferRequest]) -> np.ndarray:
        """Stack equal-shaped requests into one Observation and call ``act``: ``[B, K, A]``."""
        import torch

        from rlinf_vla.types import Observation

        first = batch[0]
        images = {k: torch.from_numpy(np.stack([r.images[k] for r in batch])) for k in first.images}
        state = None
        if first.state is not None:
            state = torch.from_numpy(np.stack([r.state for r in batch]).astype(np.float32))
        obs = Observation(images=images, state=state, instruction=[r.instruction for r in batch])
        with torch.inference_mode():
            out = self.policy.act(obs, greedy=self.config.greedy)
        return out.actions.detach().float().cpu().numpy()

    def warmup(self) -> float:
        """One ``act`` on a blank observation of the advertised sizes, so the first robot
        request does not pay for lazy initialisation; returns its time in ms."""
        meta = self.metadata
        size = meta.image_size or 224
        state = None if meta.state_dim is None else np.zeros(meta.state_dim, np.float32)
        request = InferRequest(
            id=None,
            images={k: np.zeros((size, size, 3), np.uint8) for k in meta.image_keys},
            state=state,
            instruction="warm up",
        )
        start = time.perf_counter()
        self._act([request])
        return (time.perf_counter() - start) * 1000.0

    async def _batcher(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        window = self.config.batch_window_ms / 1000.0
        while True:
            pending = [await self._queue.get()]
            deadline = loop.time() + window
            while len(pending) < self.config.max_batch_size:
                timeout = deadline - loop.time()
                try:
                    if timeout <= 0:
                        pending.append(self._queue.get_nowait())
                    else:
                        pending.append(await asyncio.wait_for(self._queue.get(), timeout))
                except (asyncio.QueueEmpty, TimeoutError):
                    break
            groups: dict[tuple, list[_Pending]] = {}
            for p in pending:
                groups.setdefault(p.request.signature(), []).append(p)
            for group in groups.values():
                await self._run_group(group)

    async def _run_group(self, group: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            actions = await loop.run_in_executor(
                self._executor, self._act, [p.request for p in group]
            )
            error = None
        except Exception as e:
            actions, error = (
                None,
                (f"inference failed: {type(e).__name__}: {e}", traceback.format_exc()),
            )
        infer_ms = (time.perf_counter() - start) * 1000.0
        self.stats["batches"] += 1
        for i, p in enumerate(group):
            if p.future.done():
                continue
            if error is not None:
                p.future.set_exception(_InferenceError(*error))
            else:
                p.future.set_result(
                    (
                        actions[i],
                        {
                            "queue_ms": (start - p.received) * 1000.0,
                            "infer_ms": infer_ms,
                            "batch_size": len(group),
                        },
                    )
                )

    # ------------------------------------------------------------------ websocket side
    def _process_request(self, connection: Any, request: Any) -> Any:
        """Health check and token authentication, before the websocket handshake."""
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        if self.config.token is not None:
            peer = str((connection.remote_address or ("?",))[0])
            now = self.clock()
            header = request.headers.get("Authorization", "").encode()
            token = self.config.token
            # Both compared (no early exit): native clients send Bearer, openpi's Api-Key.
            matches = [
                hmac.compare_digest(header, f"{scheme} {token}".encode())
                for scheme in ("Bearer", "Api-Key")
            ]
            if any(matches):  # the right token is always answered: back-off slows guesses only
                return None
            # A wrong token from an address inside its back-off window is refused (429) without
            # counting or logging it; outside, it is a failure that doubles the window. The
            # failures are the address's guesses: a right token does not reset them.
            failures = self._auth_failures.get(peer)
            if failures is not None and now < failures.blocked_until:
                self.stats["throttled_auth"] += 1
                return connection.respond(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"too many failed authentications; retry in "
                    f"{failures.blocked_until - now:.1f} s\n",
                )
            self.stats["rejected_auth"] += 1
            failures = self._auth_failures.setdefault(peer, _AuthFailures())
            failures.count += 1
            delay = 0.0
            if self.config.auth_failure_delay_s > 0:
                delay = min(
                    self.config.auth_failure_delay_s * 2.0 ** (failures.count - 1),
                    MAX_AUTH_BACKOFF_S,
                )
                failures.blocked_until = now + delay
            log.warning(
                "rejected a connection from %s: bad or missing token (%d in a row; "
                "refused for %.1f s)",
                peer,
                failures.count,
                delay,
            )
            return connection.respond(
                HTTPStatus.UNAUTHORIZED,
                "missing or wrong token (send 'Authorization: Bearer <token>' or "
                "'Authorization: Api-Key <token>')\n",
            )
        return None

    async def _handler(self, connection: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        assert self._queue is not None
        wire = self._wire
        await connection.send(wire.metadata())
        try:
            async for frame in connection:
                received = time.perf_counter()
                self.stats["requests"] += 1
                req_id = None
                try:
                    msg = wire.decode(frame)
                    req_id = wire.request_id(msg)
                    request = wire.parse(msg)
                    future = asyncio.get_running_loop().create_future()
                    self._waiting.add(future)
                    future.add_done_callback(self._waiting.discard)
                    await self._queue.put(_Pending(request, future, received))
                    actions, timing = await future
                    timing["server_ms"] = (time.perf_counter() - received) * 1000.0
                    with np.errstate(over="ignore", invalid="ignore"):
                        actions = np.asarray(actions, dtype=np.float32)
                    if not np.isfinite(actions).all():
                        self.stats["non_finite_actions"] += 1
                        raise _InferenceError(
                            "the policy returned non-finite actions (NaN or inf in float32); "
                            "nothing to execute",
                            None,
                        )
                    await connection.send(wire.reply(req_id, actions, timing))
                    continue
                except (codec.DecodeError, RequestError) as e:
                    reason, tb = str(e), None
                except _InferenceError as e:
                    reason, tb = e.reason, e.tb
                except _WrongProtocol as e:
                    self.stats["errors"] += 1
                    _log_refusal(connection, str(e))
                    await _send_error_and_close(connection, str(e), None)
                    return
                self.stats["errors"] += 1
                _log_refusal(connection, reason)
                if not await wire.send_error(connection, req_id, reason, tb):
                    return
        except ConnectionClosed:
            pass

    async def serve(
        self, ready: threading.Event | None = None, stop: asyncio.Event | None = None
    ) -> None:
        """Serve until ``stop`` is set (forever when ``None``)."""
        from websockets.asyncio.server import serve

        self._queue = asyncio.Queue()
        batcher = asyncio.create_task(self._batcher())
        async with serve(
            self._handler,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            max_size=self.config.max_message_bytes,
            compression=None,
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            log.info("serving %s on ws://%s:%d", self.metadata.policy, self.config.host, self.port)
            if ready is not None:
                ready.set()
            try:
                await (stop.wait() if stop is not None else asyncio.Future())
            finally:
                batcher.cancel()
                for future in list(self._waiting):  # requests in flight get an answer
                    if not future.done():
                        future.set_exception(_InferenceError("the server is shutting down", ""))

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}"

    @contextlib.contextmanager
    def run_in_thread(self) -> Iterator[str]:
        """Serve from a background thread (tests, benchmarks); yields the ``ws://`` URL."""
        ready = threading.Event()
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        errors: list[BaseException] = []

        def target() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.serve(ready, stop))
            except BaseException as e:  # surfaced to the caller below
                errors.append(e)
                ready.set()

        thread = threading.Thread(target=target, name="policy-server", daemon=True)
        thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        try:
            yield self.url
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
            if not thread.is_alive():
                loop.close()


class _WrongProtocol(Exception):
    """The peer speaks the other protocol: it gets a text frame (which both openpi's client
    and the native one report) and the connection is closed."""


def _log_refusal(connection: Any, reason: str) -> None:
    """Log why a request was refused (the client gets the same reason)."""
    peer = ":".join(str(p) for p in (connection.remote_address or ("?",))[:2])
    log.warning("refused a request from %s: %s", peer, reason.splitlines()[0] if reason else "?")


async def _send_error_and_close(connection: Any, reason: str, tb: str | None) -> None:
    """openpi's way of answering an error: the text (and traceback) as a text frame, then a
    close with code 1011 (internal error); openpi's client raises on the text frame."""
    from websockets.exceptions import ConnectionClosed
    from websockets.frames import CloseCode

    text = reason + (f"\n--- remote traceback ---\n{tb}" if tb else "")
    with contextlib.suppress(ConnectionClosed):
        await connection.send(text)
        await connection.close(
            CloseCode.INTERNAL_ERROR, "request refused; reason in the previous frame"
        )


class _NativeWire:
    """The native protocol (:mod:`.protocol`): typed, id-tagged maps; errors keep the
    connection open."""

    def __init__(self, meta: PolicyMetadata, config: ServerConfig) -> None:
        self.meta = meta

    def metadata(self) -> bytes:
        return codec.packb(self.meta.to_message())

    def decode(self, frame: Any) -> Any:
        msg = codec.unpackb(frame)
        if openpi.looks_like_openpi_request(msg):
            raise _WrongProtocol(
                "this rlinf-vla server speaks its native protocol; for openpi clients start it "
                "with server.protocol=openpi (and server.openpi_layout=libero|droid|aloha)"
            )
        return msg

    def request_id(self, msg: Any) -> Any:
        if isinstance(msg, dict) and isinstance(msg.get("id"), int | str):
            return msg["id"]
        return None

    def parse(self, msg: Any) -> InferRequest:
        return parse_infer_request(msg, self.meta)

    def reply(self, req_id: Any, actions: np.ndarray, timing: dict[str, Any]) -> bytes:
        return codec.packb({"type": "actions", "id": req_id, "actions": actions, "timing": timing})

    async def send_error(self, connection: Any, req_id: Any, reason: str, tb: str | None) -> bool:
        """Answer an error; ``False`` when the connection is closed after it."""
        reply = {"type": "error", "id": req_id, "reason": reason, "traceback": tb}
        await connection.send(codec.packb(reply))
        return True


class _OpenpiWire(_NativeWire):
    """openpi's protocol (:mod:`.openpi`): flat observations mapped onto the native request,
    then the same validation; ``{"actions": ...}`` replies; errors as openpi's server sends
    them (a text frame, then close 1011)."""

    def __init__(self, meta: PolicyMetadata, config: ServerConfig) -> None:
        super().__init__(meta, config)
        self.layout = config.openpi_layout
        self.default_prompt = config.openpi_default_prompt
        openpi.check_layout(self.layout, meta.image_keys)
        self.mapping = openpi.describe(self.layout, meta.image_keys)

    def metadata(self) -> bytes:
        return codec.packb(openpi.metadata_message(self.meta, self.layout), openpi=True)

    def decode(self, frame: Any) -> Any:
        return codec.unpackb(frame, openpi=True)

    def request_id(self, msg: Any) -> Any:
        return None

    def parse(self, msg: Any) -> InferRequest:
        obs = openpi.to_native_obs(msg, self.layout, self.meta, self.default_prompt)
        try:
            return parse_infer_request({"type": "infer", "obs": obs}, self.meta)
        except RequestError as e:
            raise RequestError(f"{e} (openpi layout {self.layout}: {self.mapping})") from None

    def reply(self, req_id: Any, actions: np.ndarray, timing: dict[str, Any]) -> bytes:
        return codec.packb({"actions": actions, "server_timing": timing}, openpi=True)

    async def send_error(self, connection: Any, req_id: Any, reason: str, tb: str | None) -> bool:
        await _send_error_and_close(connection, reason, tb)
        return False


#: ``server.protocol`` -> how requests are read and answered.
_WIRES: dict[str, type[_NativeWire]] = {"native": _NativeWire, "openpi": _OpenpiWire}


class _InferenceError(Exception):
    def __init__(self, reason: str, tb: str | None) -> None:
        super().__init__(reason)
        self.reason, self.tb = reason, tb


def _valid_host(host: str) -> bool:
    """An IPv4/IPv6 address, or a host name (RFC 1123 labels, not all-numeric like an address)."""
    import ipaddress
    import re

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or all(label.isdigit() for label in labels):
        return False
    label = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
    return all(label.match(part) for part in labels)

"""Channel: a named, keyed, bounded FIFO between worker groups (and the driver).

A channel is one async Ray actor holding a queue per key. Any process that has the
:class:`Channel` handle (pass it to workers as an argument, or ``Channel.connect(name)``) can
put and get::

    ch = Channel.create("obs", maxsize=8)
    ch.put("stage0", obs)          # returns once the previous put was accepted
    obs = ch.get("stage0")         # blocks until an item is there
    batch = ch.get_batch("stage0", 4)
    item = await ch.async_get("stage0")

Semantics:
- FIFO per key; items put by one handle arrive in the order they were put, across keys too.
- Back-pressure: with ``maxsize > 0`` a key holds at most ``maxsize`` items. ``put`` is
  pipelined one item deep: it sends the item and then waits until the channel accepted the
  *previous* item from this handle, so a producer never runs more than one item ahead of a
  full channel, and a put costs no round trip when the channel has room. On an unbounded
  channel ``put`` returns at once. ``async_put`` and ``flush`` wait for the item itself.
- Transport: small items travel inside the call; items holding more than
  ``inline_max_bytes`` of array data are placed in Ray's object store by the producer and
  only their reference passes through the channel, so the payload is copied once, from the
  producer into shared memory, and read by the consumer (never through the channel actor).
  The CPU tensors of such an item (in dicts, lists, tuples and dataclasses such as an
  ``Observation``) travel as NumPy arrays, which Ray writes and reads without pickling their
  bytes; the consumer gets tensors again (its own, writable copies). On the 2-core machine a
  put and a get of an observation of 4 images of 128 px took 5.6 ms instead of 6.2 as
  pickled tensors, and of 32 images of 256 px 11.2 ms instead of 24.1 (round trips included).
- A ``get`` with a timeout that expires leaves the channel untouched (no item is lost).
- Hosting: ``Channel.create(name, host=actor)`` keeps the queues inside a worker's process (an
  actor of a :class:`~rlinf_vla.runtime.WorkerGroup` made with ``channels=True``) instead of
  an actor of their own. The handles in that process use the queues directly (no Ray call;
  small items are not even copied); the others call the host, whose channel calls run in threads of their own beside the
  worker's calls. A pipeline whose consumer hosts its channel pays one call per request and
  response instead of two and one process less: on the 2-core machine a put and get of 0.8 MB
  through a separate channel actor took 9.3-11 ms of CPU in all processes, a direct call to
  the consumer 4.4 ms (docs/experiments/2026-11-30-channel-costs.md).
- Same-node pipes: a process on the host's node (``pipes=True``, the default) talks to a
  hosted channel over a Unix socket of its own instead of Ray calls: each thread of a handle
  opens a connection to the host's pipe server, which answers it from a thread of its own.
  ``exchange``, ``get``, ``get_batch`` and an unbounded channel's ``put`` go that way; items
  travel pickled (protocol 5, their arrays as out-of-band buffers), never through the object
  store. A round trip is then one socket write and one read on each side, where a Ray call
  passes several threads of both processes and, for a big item, the object store. A host that
  ends closes the connections: a waiting producer gets :class:`ChannelHostLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import os
import pickle
import struct
import threading
import time
import uuid
from collections import defaultdict, deque
from typing import Any

DEFAULT_KEY = "default"
INLINE_MAX_BYTES = 100 * 1024
# Calls a channel can hold at once: every blocked get or put (full queue) holds one thread.
MAX_BLOCKED_CALLS = 256


class _ChannelActor:
    """The actor behind a channel: one deque per key, guarded by one condition.

    It is a threaded actor (a blocked ``get`` or ``put`` holds one thread), which answers a
    call faster than an asyncio actor. Payloads are opaque: ``("v", value)`` or
    ``("r", [ref])``.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.queues: dict[str, deque[Any]] = defaultdict(deque)
        self.next_seq: dict[int, int] = defaultdict(int)
        self.cond = threading.Condition()

    # Each call takes one tuple: Ray serialises every argument separately, so one argument
    # is measurably cheaper than four for small messages.
    def put(self, packet: tuple[str, int, int, Any]) -> None:
        key, producer, seq, payload = packet
        queue = self.queues[key]
        with self.cond:
            # Ray may start calls of a threaded actor out of submission order; the
            # per-producer sequence number restores it.
            self.cond.wait_for(
                lambda: (
                    self.next_seq[producer] == seq
                    and (self.maxsize <= 0 or len(queue) < self.maxsize)
                )
            )
            queue.append(payload)
            self.next_seq[producer] = seq + 1
            self.cond.notify_all()

    def get(self, request: tuple[str, int, float | None]) -> list[Any] | None:
        key, n, timeout = request
        queue = self.queues[key]
        with self.cond:
            if not self.cond.wait_for(lambda: len(queue) >= n, timeout):
                return None
            out = [queue.popleft() for _ in range(n)]
            self.cond.notify_all()
            return out

    def exchange(
        self, call: tuple[tuple[str, int, int, Any], tuple[str, int, float | None]]
    ) -> list[Any] | None:
        """``put(packet)`` then ``get(request)`` in one call (one round trip instead of two)."""
        packet, request = call
        self.put(packet)
        return self.get(request)

    def wait_applied(self, request: tuple[int, int, float | None]) -> bool:
        """Wait until ``producer``'s puts up to sequence number ``seq - 1`` were applied."""
        producer, seq, timeout = request
        with self.cond:
            return self.cond.wait_for(lambda: self.next_seq[producer] >= seq, timeout)

    def get_maxsize(self) -> int:
        return self.maxsize

    def qsize(self, key: str | None) -> int | dict[str, int]:
        with self.cond:
            if key is None:
                return {k: len(q) for k, q in self.queues.items() if q}
            return len(self.queues[key]) if key in self.queues else 0


#: The queues of the channels hosted by this process (:func:`host_queues`), by name.
_HOSTED: dict[str, _ChannelActor] = {}


def host_queues(name: str, maxsize: int) -> None:
    """Make the queues of channel ``name`` in this process (called in the host worker)."""
    if name in _HOSTED:
        raise ValueError(f"a channel named {name!r} is already hosted in this process")
    _HOSTED[name] = _ChannelActor(maxsize)


def hosted_call(name: str, op: str, *arg: Any) -> Any:
    """``op`` on the queues of the hosted channel ``name`` (the host's channel calls);
    ``host`` makes them, ``close`` drops them."""
    if op == "host":
        host_queues(name, *arg)
        return None
    if op == "close":
        _HOSTED.pop(name, None)
        return None
    if op == "pipe":  # where producers on this node connect (the server starts on first use)
        return _pipe_server().info()
    return getattr(_queues(name), op)(*arg)


class ChannelHostLost(ConnectionError):
    """The process hosting a channel ended while a same-node pipe waited for its answer."""


def _queues(name: str) -> _ChannelActor:
    if name not in _HOSTED:
        raise KeyError(f"no channel named {name!r} is hosted here (it was closed)")
    return _HOSTED[name]


def _send(conn: Any, obj: Any) -> None:
    """``obj`` over ``conn``: one message with the pickle (protocol 5), then one per
    out-of-band buffer (the bytes of its NumPy arrays, never copied into the pickle)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    conn.send_bytes(struct.pack("!I", len(buffers)) + head)
    for buffer in buffers:
        conn.send_bytes(buffer.raw())


def _recv(conn: Any) -> Any:
    message = conn.recv_bytes()
    (count,) = struct.unpack_from("!I", message)
    buffers = [conn.recv_bytes() for _ in range(count)]
    return pickle.loads(memoryview(message)[4:], buffers=buffers)


def _encode(payload: tuple[str, Any]) -> tuple[str, Any]:
    """A ``("v", item)`` payload for a pipe: its CPU tensors as NumPy arrays."""
    kind, value = payload
    return (kind, _map_tensors(value, _to_array)) if kind == "v" else payload


def _decode(payload: tuple[str, Any]) -> tuple[str, Any]:
    kind, value = payload
    return (kind, _map_tensors(value, _from_array)) if kind == "v" else payload


def _fetched(payloads: list[tuple[str, Any]]) -> list[Any]:
    """The items of ``payloads``, the object-store ones fetched (as tensors again)."""
    import ray

    refs = [value[0] for kind, value in payloads if kind == "r"]
    fetched = [_map_tensors(x, _from_array) for x in ray.get(refs)] if refs else []
    return _merge(payloads, fetched)


def _resolved(payloads: list[tuple[str, Any]] | None) -> list[tuple[str, Any]] | None:
    """``payloads`` with the object-store ones fetched, for a pipe's answer."""
    if payloads is None or all(kind == "v" for kind, _ in payloads):
        return payloads
    return [("v", item) for item in _fetched(payloads)]


class _PipeServer:
    """The same-node pipes of a host process: one listening Unix socket, a thread per
    connection, each answering the requests of one producer thread in order."""

    def __init__(self) -> None:
        from multiprocessing.connection import Listener

        self.authkey = os.urandom(16)
        self.listener = Listener(family="AF_UNIX", authkey=self.authkey)
        threading.Thread(target=self._accept, name="channel-pipes", daemon=True).start()

    def info(self) -> tuple[str, str, bytes]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        return node, self.listener.address, self.authkey

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:  # the listener was closed
                return
            except Exception:  # a peer that failed the handshake
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="channel-pipe", daemon=True
            ).start()

    @staticmethod
    def _serve(conn: Any) -> None:
        with contextlib.suppress(EOFError, OSError), conn:
            while True:
                name, op, arg = _recv(conn)
                try:
                    if op == "put":  # unbounded: no answer (as a Ray put without an ack)
                        key, producer, seq, payload = arg
                        _queues(name).put((key, producer, seq, _decode(payload)))
                        continue
                    if op == "get":
                        got = _queues(name).get(arg)
                    else:  # exchange
                        (key, producer, seq, payload), request = arg
                        got = _queues(name).exchange(
                            ((key, producer, seq, _decode(payload)), request)
                        )
                    got = _resolved(got)
                    answer = ("ok", None if got is None else [_encode(p) for p in got])
                except Exception as e:  # the producer raises it
                    if op == "put":
                        continue
                    answer = ("error", f"{type(e).__name__}: {e}")
                _send(conn, answer)


_PIPE_SERVER: _PipeServer | None = None
_PIPE_SERVER_LOCK = threading.Lock()


def _pipe_server() -> _PipeServer:
    global _PIPE_SERVER
    with _PIPE_SERVER_LOCK:
        if _PIPE_SERVER is None:
            _PIPE_SERVER = _PipeServer()
        return _PIPE_SERVER


class _HostedQueues:
    """A hosted channel's queues seen from another process: each call goes to the host
    actor's ``channel_call`` with the same arguments as a channel actor's method."""

    def __init__(self, host: Any, name: str) -> None:
        self.host, self.name = host, name

    def __getattr__(self, op: str) -> _HostedOp:
        if op.startswith("__"):
            raise AttributeError(op)
        return _HostedOp(self.host, self.name, op)

    def __reduce__(self) -> tuple:
        return (_HostedQueues, (self.host, self.name))


class _HostedOp:
    def __init__(self, host: Any, name: str, op: str, options: dict | None = None) -> None:
        self.host, self.name, self.op, self._options = host, name, op, options

    def options(self, **options: Any) -> _HostedOp:
        return _HostedOp(self.host, self.name, self.op, options)

    def remote(self, *arg: Any) -> Any:
        method = self.host.channel_call
        if self._options:
            method = method.options(**self._options)
        return method.remote(self.name, self.op, *arg)


class Channel:
    """Handle to a named channel. Create with :meth:`create`, look up with :meth:`connect`.

    The handle is picklable: pass it to workers as a call argument.
    """

    def __init__(
        self,
        name: str,
        actor: Any,
        maxsize: int,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        pipes: bool = True,
    ):
        self.name, self._actor, self.maxsize = name, actor, maxsize
        self.inline_max_bytes = inline_max_bytes
        self.pipes = pipes
        self._reset_producer()

    def _reset_producer(self) -> None:
        # In the process that hosts the queues, the handle uses them directly.
        hosted = isinstance(self._actor, _HostedQueues)
        self._local = _HOSTED.get(self.name) if hosted else None
        # Ray builds a method wrapper on every attribute access of an actor handle; keep them.
        self._remote_put, self._remote_get = self._actor.put, self._actor.get
        self._remote_exchange = self._actor.exchange
        self._remote_put_noack = self._actor.put.options(num_returns=0)
        self._producer = uuid.uuid4().int >> 65  # fits in 63 bits
        self._seq = 0
        self._last_put: Any = None
        self._lock = threading.Lock()
        self._timers = {"send_s": 0.0, "fetch_s": 0.0}
        # same-node pipes (module docs): the host's pipe address once known (False: none for
        # this handle), and each thread's connection
        piped = self.pipes and hosted and self._local is None
        self._pipe_info: tuple[str, str, bytes] | bool | None = None if piped else False
        self._threads = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "actor": self._actor,
            "maxsize": self.maxsize,
            "inline": self.inline_max_bytes,
            "pipes": self.pipes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self._actor, self.maxsize = state["name"], state["actor"], state["maxsize"]
        self.inline_max_bytes, self.pipes = state["inline"], state["pipes"]
        self._reset_producer()

    # ------------------------------------------------------------------ same-node pipes
    def _pipe(self) -> Any:
        """The calling thread's connection to the host's pipe server, or ``None`` where this
        handle talks to the channel through Ray calls (module docs)."""
        if self._pipe_info is False:
            return None
        conn = getattr(self._threads, "conn", None)
        if conn is not None:
            return conn
        import ray

        with self._lock:
            if self._pipe_info is None:
                node, address, authkey = ray.get(self._actor.pipe.remote())
                here = ray.get_runtime_context().get_node_id()
                self._pipe_info = (node, address, authkey) if node == here else False
        if self._pipe_info is False:
            return None
        from multiprocessing.connection import Client

        _, address, authkey = self._pipe_info
        conn = self._threads.conn = Client(address, family="AF_UNIX", authkey=authkey)
        return conn

    def _pipe_call(self, conn: Any, op: str, arg: Any) -> list[Any] | None:
        """``op`` over ``conn``; the answer's payloads, decoded (``None``: a get timed out)."""
        try:
            _send(conn, (self.name, op, arg))
            if op == "put":
                return None
            status, answer = _recv(conn)
        except (EOFError, OSError) as e:
            self._threads.conn = None
            raise ChannelHostLost(
                f"channel {self.name!r}: the process hosting it ended ({type(e).__name__})"
            ) from None
        if status == "error":
            raise RuntimeError(f"channel {self.name!r}: {answer}")
        if answer is None:
            return None
        t0 = time.perf_counter()
        out = [_decode(p) for p in answer]
        self._timers["fetch_s"] += time.perf_counter() - t0
        return out

    def _pipe_packet(self, key: str, item: Any) -> tuple[str, int, int, Any]:
        with self._lock:
            packet = (key, self._producer, self._seq, _encode(("v", item)))
            self._seq += 1
        return packet

    @classmethod
    def create(
        cls,
        name: str,
        maxsize: int = 0,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        host: Any = None,
        pipes: bool = True,
    ) -> Channel:
        """Start a channel named ``name`` (unique in the cluster's namespace).

        Args:
            maxsize: items per key before ``put`` waits (0: unbounded).
            inline_max_bytes: items with more array bytes than this go through the object store.
            host: the Ray actor of a worker that keeps the queues in its process
                (``WorkerGroup(..., channels=True).actor(rank)``; module docs); ``None``: an
                actor of the channel's own. A hosted channel ends with its host and cannot be
                found by :meth:`connect`.
            pipes: a hosted channel answers processes on its host's node over Unix sockets
                (module docs); ``False``: through Ray calls, as processes on other nodes.
        """
        import ray

        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        if host is not None:
            ray.get(host.channel_call.remote(name, "host", maxsize))
            return cls(name, _HostedQueues(host, name), maxsize, inline_max_bytes, pipes)
        actor = (
            ray.remote(_ChannelActor)
            .options(name=f"channel:{name}", num_cpus=0, max_concurrency=MAX_BLOCKED_CALLS)
            .remote(maxsize)
        )
        return cls(name, actor, maxsize, inline_max_bytes)

    @classmethod
    def connect(cls, name: str) -> Channel:
        """A handle to the existing channel ``name``."""
        import ray

        try:
            actor = ray.get_actor(f"channel:{name}")
        except ValueError:
            raise KeyError(f"no channel named {name!r} exists") from None
        return cls(name, actor, ray.get(actor.get_maxsize.remote()))

    # ------------------------------------------------------------------ put
    def _payload(self, item: Any) -> tuple[str, Any]:
        """Small items travel in the call; big ones through the object store (module docs)."""
        import ray

        if _array_bytes(item) > self.inline_max_bytes:
            return ("r", [ray.put(_map_tensors(item, _to_array))])
        return ("v", item)

    def _submit(self, key: str, item: Any, ack: bool) -> tuple[Any, Any]:
        """Send ``item``; returns the ack refs of the previous and of this put (or ``None``).

        Without ``ack`` the call creates no return object (``num_returns=0``), which saves a
        good part of a put's cost; :meth:`flush` still knows when it was applied.
        """
        t0 = time.perf_counter()
        if self._local is not None:  # the queues are in this process: no call
            payload = self._payload(item)  # a big item may be taken by another process
            with self._lock:
                packet = (key, self._producer, self._seq, payload)
                self._seq += 1
            self._timers["send_s"] += time.perf_counter() - t0
            self._local.put(packet)  # on a full bounded queue, waits for room
            return None, None
        payload = self._payload(item)
        with self._lock:
            packet = (key, self._producer, self._seq, payload)
            ref = self._remote_put.remote(packet) if ack else self._remote_put_noack.remote(packet)
            self._seq += 1
            previous, self._last_put = self._last_put, ref
        self._timers["send_s"] += time.perf_counter() - t0
        return previous, ref

    def put(self, key: str, item: Any, timeout: float | None = None) -> None:
        """Append ``item`` to the queue of ``key``.

        On a bounded channel, returns once the channel accepted this handle's previous item
        (see module docs); on an unbounded one, at once.

        Raises:
            TimeoutError: the channel stayed full for ``timeout`` seconds.
        """
        import ray

        if self.maxsize <= 0:  # never full: nothing to wait for
            conn = self._pipe()
            if conn is not None:
                t0 = time.perf_counter()
                self._pipe_call(conn, "put", self._pipe_packet(key, item))
                self._timers["send_s"] += time.perf_counter() - t0
                return
            self._submit(key, item, ack=False)
            return
        previous, _ = self._submit(key, item, ack=True)
        if previous is not None:
            try:
                ray.get(previous, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"channel {self.name!r} stayed full for {timeout} s") from None

    async def async_put(self, key: str, item: Any) -> None:
        """Append ``item`` and wait until the channel accepted it."""
        _, ref = self._submit(key, item, ack=True)
        if ref is not None:  # a hosted channel's put in its host was applied at once
            await ref

    def exchange(self, put_key: str, item: Any, get_key: str, timeout: float | None = None) -> Any:
        """``put(put_key, item)`` then ``get(get_key)``, in one call to the channel.

        The request/response pattern of a pipeline (send an observation, receive the actions)
        at the cost of one round trip instead of two. The put keeps its place in this handle's
        order; on a bounded channel it waits for room first. ``timeout`` applies to the get;
        the item is put either way.

        Raises:
            TimeoutError: nothing arrived under ``get_key`` within ``timeout`` seconds.
        """
        import ray

        conn = self._pipe()
        if conn is not None:
            t0 = time.perf_counter()
            packet = self._pipe_packet(put_key, item)
            self._timers["send_s"] += time.perf_counter() - t0
            got = self._pipe_call(conn, "exchange", (packet, (get_key, 1, timeout)))
            return self._fetch(_check_timeout(self, get_key, got, timeout))[0]
        t0 = time.perf_counter()
        payload = self._payload(item)
        if self._local is not None:
            with self._lock:
                packet = (put_key, self._producer, self._seq, payload)
                self._seq += 1
            self._timers["send_s"] += time.perf_counter() - t0
            got = self._local.exchange((packet, (get_key, 1, timeout)))
            return self._fetch(_check_timeout(self, get_key, got, timeout))[0]
        with self._lock:
            packet = (put_key, self._producer, self._seq, payload)
            ref = self._remote_exchange.remote((packet, (get_key, 1, timeout)))
            self._seq += 1
        self._timers["send_s"] += time.perf_counter() - t0
        payloads = _check_timeout(self, get_key, ray.get(ref), timeout)
        with self._lock:
            if self._seq == packet[2] + 1:  # every put of this handle so far is applied
                self._last_put = None
        return self._fetch(payloads)[0]

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every item put through this handle was accepted.

        Raises:
            TimeoutError: not all were accepted within ``timeout`` seconds.
        """
        import ray

        if self._seq == 0 or self._local is not None:  # a host's own puts apply at once
            return
        ref = self._actor.wait_applied.remote((self._producer, self._seq, timeout))
        if not ray.get(ref):
            raise TimeoutError(f"channel {self.name!r}: puts not accepted after {timeout} s")

    # ------------------------------------------------------------------ get
    def get(self, key: str = DEFAULT_KEY, timeout: float | None = None) -> Any:
        """Remove and return the oldest item of ``key``, waiting for one.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds (nothing is lost).
        """
        return self.get_batch(key, 1, timeout)[0]

    def get_batch(self, key: str, n: int, timeout: float | None = None) -> list[Any]:
        """Remove and return the ``n`` oldest items of ``key`` at once, waiting for them."""
        import ray

        self._check_batch(n)
        request = (key, n, timeout)
        if self._local is not None:
            got = self._local.get(request)
        elif (conn := self._pipe()) is not None:
            got = self._pipe_call(conn, "get", request)
        else:
            got = ray.get(self._remote_get.remote(request))
        return self._fetch(_check_timeout(self, key, got, timeout))

    def _fetch(self, payloads: list[tuple[str, Any]]) -> list[Any]:
        """The items of ``payloads``, the object-store ones fetched (timed in ``fetch_s``)."""
        if all(kind == "v" for kind, _ in payloads):
            return _merge(payloads, [])
        t0 = time.perf_counter()
        items = _fetched(payloads)
        self._timers["fetch_s"] += time.perf_counter() - t0
        return items

    def take_timers(self) -> dict[str, float]:
        """Seconds this handle spent since the previous call (or its creation) serialising
        and submitting what it sent (``send_s``, Ray serialises a call's arguments when it is
        made) and fetching object-store payloads it received (``fetch_s``); then zeroes them.
        The rest of a put, get or exchange is the channel's round trip and the wait for items.
        """
        out, self._timers = self._timers, {"send_s": 0.0, "fetch_s": 0.0}
        return out

    async def async_get(self, key: str = DEFAULT_KEY, timeout: float | None = None) -> Any:
        return (await self.async_get_batch(key, 1, timeout))[0]

    async def async_get_batch(self, key: str, n: int, timeout: float | None = None) -> list[Any]:
        if self._local is not None:  # the host's own queues: wait in a thread of its own
            return await asyncio.to_thread(self.get_batch, key, n, timeout)
        self._check_batch(n)
        payloads = _check_timeout(
            self, key, await self._remote_get.remote((key, n, timeout)), timeout
        )
        refs = [value[0] for kind, value in payloads if kind == "r"]
        fetched = await asyncio.gather(*refs) if refs else []
        return _merge(payloads, [_map_tensors(x, _from_array) for x in fetched])

    def _check_batch(self, n: int) -> None:
        check_batch(self.name, self.maxsize, n)

    def qsize(self, key: str = DEFAULT_KEY) -> int:
        """Items waiting under ``key`` (items still in flight from a ``put`` not counted)."""
        import ray

        if self._local is not None:
            return self._local.qsize(key)
        return ray.get(self._actor.qsize.remote(key))

    def sizes(self) -> dict[str, int]:
        """Items waiting under every key seen so far."""
        import ray

        if self._local is not None:
            return self._local.qsize(None)
        return ray.get(self._actor.qsize.remote(None))

    def close(self) -> None:
        """Stop the channel actor (or drop a hosted channel's queues); items still queued are
        dropped."""
        import ray

        if isinstance(self._actor, _HostedQueues):
            # A host that has already ended took the queues with it.
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(self._actor.close.remote(), timeout=10)
            return
        ray.kill(self._actor, no_restart=True)

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self.maxsize})"


def check_batch(name: str, maxsize: int, n: int) -> None:
    """A get of ``n`` items from the channel ``name`` bounded to ``maxsize`` (0: unbounded)
    can be answered; else ``ValueError``."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    if maxsize and n > maxsize:
        raise ValueError(f"cannot get {n} items from channel {name!r} bounded to {maxsize}")


def _check_timeout(
    channel: Channel, key: str, payloads: list | None, timeout: float | None
) -> list:
    if payloads is None:
        raise TimeoutError(f"channel {channel.name!r}: nothing under key {key!r} for {timeout} s")
    return payloads


def _merge(payloads: list[tuple[str, Any]], fetched: list[Any]) -> list[Any]:
    """Payloads back to items, taking the object-store ones from ``fetched`` in order."""
    it = iter(fetched)
    return [next(it) if kind == "r" else value for kind, value in payloads]


def _array_bytes(item: Any, depth: int = 0) -> int:
    """Bytes of tensor/array data in ``item`` (containers and dataclasses looked into)."""
    nbytes = getattr(item, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if depth > 4:
        return 0
    if isinstance(item, dict):
        return sum(_array_bytes(v, depth + 1) for v in item.values())
    if isinstance(item, list | tuple):
        return sum(_array_bytes(v, depth + 1) for v in item[:64])
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(_array_bytes(getattr(item, f.name), depth + 1) for f in dataclasses.fields(item))
    return 0


@dataclasses.dataclass
class _Array:
    """A CPU tensor on its way through the object store, as a NumPy array."""

    array: Any


def _to_array(t: Any) -> Any:
    """A CPU tensor whose dtype NumPy has, as :class:`_Array` (others pass as they are)."""
    if t.device.type != "cpu" or t.requires_grad or t.is_sparse:
        return t
    try:
        return _Array(t.numpy())
    except TypeError:  # bfloat16 and other dtypes NumPy lacks
        return t


def _from_array(a: Any) -> Any:
    import numpy as np
    import torch

    # the object store's buffer is read-only: the consumer gets its own copy
    return torch.from_numpy(np.array(a.array)) if isinstance(a, _Array) else a


def _map_tensors(item: Any, fn: Any, depth: int = 0) -> Any:
    """``item`` with ``fn`` applied to every tensor (or :class:`_Array`) in it, looking into
    dicts, lists, tuples and dataclass instances (copied, not changed), as deep as
    :func:`_array_bytes` looks."""
    import torch

    if isinstance(item, torch.Tensor | _Array):
        return fn(item)
    if depth > 4:
        return item
    if isinstance(item, dict):
        return {k: _map_tensors(v, fn, depth + 1) for k, v in item.items()}
    if isinstance(item, list):
        return [_map_tensors(v, fn, depth + 1) for v in item]
    if type(item) is tuple:
        return tuple(_map_tensors(v, fn, depth + 1) for v in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        out = copy.copy(item)
        for f in dataclasses.fields(item):
            object.__setattr__(out, f.name, _map_tensors(getattr(item, f.name), fn, depth + 1))
        return out
    return item

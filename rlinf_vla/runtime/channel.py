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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
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
    if name not in _HOSTED:
        raise KeyError(f"no channel named {name!r} is hosted here (it was closed)")
    return getattr(_HOSTED[name], op)(*arg)


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
        self, name: str, actor: Any, maxsize: int, inline_max_bytes: int = INLINE_MAX_BYTES
    ):
        self.name, self._actor, self.maxsize = name, actor, maxsize
        self.inline_max_bytes = inline_max_bytes
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

    def __getstate__(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "actor": self._actor,
            "maxsize": self.maxsize,
            "inline": self.inline_max_bytes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self._actor, self.maxsize = state["name"], state["actor"], state["maxsize"]
        self.inline_max_bytes = state["inline"]
        self._reset_producer()

    @classmethod
    def create(
        cls,
        name: str,
        maxsize: int = 0,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        host: Any = None,
    ) -> Channel:
        """Start a channel named ``name`` (unique in the cluster's namespace).

        Args:
            maxsize: items per key before ``put`` waits (0: unbounded).
            inline_max_bytes: items with more array bytes than this go through the object store.
            host: the Ray actor of a worker that keeps the queues in its process
                (``WorkerGroup(..., channels=True).actor(rank)``; module docs); ``None``: an
                actor of the channel's own. A hosted channel ends with its host and cannot be
                found by :meth:`connect`.
        """
        import ray

        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        if host is not None:
            ray.get(host.channel_call.remote(name, "host", maxsize))
            return cls(name, _HostedQueues(host, name), maxsize, inline_max_bytes)
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
        else:
            got = ray.get(self._remote_get.remote(request))
        return self._fetch(_check_timeout(self, key, got, timeout))

    def _fetch(self, payloads: list[tuple[str, Any]]) -> list[Any]:
        """The items of ``payloads``, the object-store ones fetched (timed in ``fetch_s``)."""
        import ray

        refs = [value[0] for kind, value in payloads if kind == "r"]
        if not refs:
            return _merge(payloads, [])
        t0 = time.perf_counter()
        fetched = [_map_tensors(x, _from_array) for x in ray.get(refs)]
        self._timers["fetch_s"] += time.perf_counter() - t0
        return _merge(payloads, fetched)

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

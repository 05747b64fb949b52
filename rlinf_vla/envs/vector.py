"""Subprocess vectorisation: one single-env simulator ("core") per child process.

A core is any object built in the child by a picklable ``factory()`` with these methods:

- ``reset(reset_id: int) -> dict``: the first observation of the scene ``reset_id``;
- ``step(action: np.ndarray, render: bool) -> (obs | None, reward, terminated, success)``: the
  observation may be ``None`` when neither ``render`` nor ``terminated`` is set (it is then not
  needed and rendering it can be skipped);
- ``close()``.

An observation dict holds ``images: {camera: uint8 [H, W, 3]}``, ``state: float32 [D]`` and
``instruction: str``.

:class:`SubprocEnvs` starts the children (``spawn`` context, one pipe each), sends a command to
many children before waiting for any answer (so they run in parallel), and turns their answers
into batched tensors. A child that dies (or does not answer within ``timeout_s``) is killed,
started again and reported as crashed; an exception raised by a core is re-raised in the parent
with the child's traceback. :meth:`SubprocEnvs.close` always joins or terminates every child.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from rlinf_vla.envs.base import StepOutput
from rlinf_vla.types import Observation

#: Returned by :meth:`SubprocEnvs.call` for a child that crashed (it has been restarted).
CRASHED = object()


class EnvWorkerError(RuntimeError):
    """A simulator core raised an exception in its subprocess (traceback in the message)."""


def _worker_main(conn: Connection, factory: Callable[[], Any], env_vars: dict[str, str]) -> None:
    os.environ.update(env_vars)
    core = None
    try:
        core = factory()
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        try:
            result = getattr(core, method)(*args)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        if method == "close":
            break
    conn.close()


@dataclass
class _Child:
    process: mp.Process
    conn: Connection


class SubprocEnvs:
    """``n`` single-env cores in ``n`` subprocesses, stepped in parallel.

    Args:
        factories: one picklable zero-argument callable per env, building its core in the child.
        name: env name used in messages.
        env_vars: environment variables set in each child before the factory runs.
        timeout_s: seconds a child may take to start or to answer a command before it is
            considered hung, killed and restarted.
    """

    def __init__(
        self,
        factories: list[Callable[[], Any]],
        name: str,
        env_vars: dict[str, str] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self.factories = factories
        self.env_vars = dict(env_vars or {})
        self.timeout_s = timeout_s
        self.restarts = [0] * len(factories)
        self._ctx = mp.get_context("spawn")
        self._children: list[_Child | None] = [None] * len(factories)
        self._closed = False
        try:
            for i in range(len(factories)):
                self._children[i] = self._spawn(i)
            errors = [self._await_ready(i) for i in range(len(factories))]
        except BaseException:
            self.close()
            raise
        bad = [(i, e) for i, e in enumerate(errors) if e]
        if bad:
            self.close()
            i, err = bad[0]
            raise EnvWorkerError(f"{name} env {i} failed to start:\n{err}")

    def __len__(self) -> int:
        return len(self.factories)

    # ------------------------------------------------------------------ processes
    def _spawn(self, i: int) -> _Child:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child, self.factories[i], self.env_vars),
            name=f"{self.name}-env-{i}",
            daemon=True,
        )
        proc.start()
        child.close()
        return _Child(proc, parent)

    def _await_ready(self, i: int) -> str | None:
        """``None`` when child ``i`` started, else its error text."""
        child = self._children[i]
        assert child is not None
        try:
            if not child.conn.poll(self.timeout_s):
                self._kill(i)
                return f"no answer within {self.timeout_s} s"
            status, payload = child.conn.recv()
        except (EOFError, OSError):
            self._kill(i)
            return f"the process died during start-up (exit code {child.process.exitcode})"
        return None if status == "ok" else payload

    def _kill(self, i: int) -> None:
        child = self._children[i]
        if child is None:
            return
        self._children[i] = None
        with contextlib.suppress(OSError):
            child.conn.close()
        if child.process.is_alive():
            child.process.kill()
        child.process.join(timeout=10)

    def restart(self, i: int) -> None:
        """Kill child ``i`` (if alive) and start a fresh one."""
        self._kill(i)
        self.restarts[i] += 1
        self._children[i] = self._spawn(i)
        err = self._await_ready(i)
        if err:
            raise EnvWorkerError(f"{self.name} env {i} failed to restart:\n{err}")

    def process(self, i: int) -> mp.Process | None:
        """The process of child ``i`` (for tests and monitoring)."""
        child = self._children[i]
        return None if child is None else child.process

    # ------------------------------------------------------------------ commands
    def call(self, method: str, args: dict[int, tuple]) -> dict[int, Any]:
        """Call ``core.method(*args[i])`` in every child ``i`` of ``args``, in parallel.

        Returns each result, or :data:`CRASHED` for children that died (they are restarted).
        Raises :class:`EnvWorkerError` when a core raised (after all answers are collected).
        """
        if self._closed:
            raise RuntimeError(f"{self.name} envs are closed")
        sent: list[int] = []
        results: dict[int, Any] = {}
        for i, a in args.items():
            child = self._children[i]
            try:
                assert child is not None
                child.conn.send((method, a))
                sent.append(i)
            except (OSError, AssertionError):
                results[i] = CRASHED
        errors: list[tuple[int, str]] = []
        for i in sent:
            child = self._children[i]
            assert child is not None
            try:
                if not child.conn.poll(self.timeout_s):
                    raise TimeoutError
                status, payload = child.conn.recv()
            except (EOFError, OSError, TimeoutError):
                results[i] = CRASHED
                continue
            if status == "ok":
                results[i] = payload
            else:
                errors.append((i, payload))
        for i, r in results.items():
            if r is CRASHED:
                self.restart(i)
        if errors:
            i, err = errors[0]
            raise EnvWorkerError(f"{self.name} env {i} raised in {method}():\n{err}")
        return results

    def close(self) -> None:
        """Ask every child to close its core, then join; terminate those that do not exit."""
        if self._closed:
            return
        self._closed = True
        for child in self._children:
            if child is None:
                continue
            with contextlib.suppress(OSError):
                child.conn.send(("close", ()))
        for i, child in enumerate(self._children):
            if child is None:
                continue
            try:
                if child.conn.poll(30):
                    child.conn.recv()
            except (EOFError, OSError):
                pass
            child.process.join(timeout=30)
            self._kill(i)


class SubprocBatch:
    """The :class:`~rlinf_vla.envs.base.VectorEnv` primitives over :class:`SubprocEnvs`.

    Keeps the last observation of each env so stale rows can be filled when a core skipped
    rendering, and turns crashed children into ``invalid`` envs.
    """

    def __init__(self, envs: SubprocEnvs) -> None:
        self.envs = envs
        self._last: list[dict | None] = [None] * len(envs)

    def reset(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        ids = env_ids.tolist()
        args = {i: (int(r),) for i, r in zip(ids, reset_ids.tolist(), strict=True)}
        results = self.envs.call("reset", args)
        retry = {i: args[i] for i, r in results.items() if r is CRASHED}
        if retry:  # a child died while resetting: it was restarted, try once more
            again = self.envs.call("reset", retry)
            bad = [i for i, r in again.items() if r is CRASHED]
            if bad:
                raise EnvWorkerError(f"{self.envs.name} env(s) {bad} crashed twice in reset()")
            results.update(again)
        for i in ids:
            self._last[i] = results[i]
        return stack_obs([results[i] for i in ids])

    def step(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        n = len(self.envs)
        acts = actions.numpy()
        ids = torch.nonzero(active).flatten().tolist()
        results = self.envs.call("step", {i: (acts[i], bool(need_obs[i])) for i in ids})
        reward = torch.zeros(n, dtype=torch.float32)
        terminated = torch.zeros(n, dtype=torch.bool)
        success = torch.zeros(n, dtype=torch.bool)
        invalid = torch.zeros(n, dtype=torch.bool)
        for i, r in results.items():
            if r is CRASHED:
                invalid[i] = True
                continue
            obs, reward[i], terminated[i], success[i] = r
            if obs is not None:
                self._last[i] = obs
        if any(o is None for o in self._last):
            raise RuntimeError("call reset() before step()")
        return StepOutput(
            obs=stack_obs(self._last),  # type: ignore[arg-type]
            reward=reward,
            terminated=terminated,
            success=success,
            invalid=invalid if invalid.any() else None,
        )


def stack_obs(obs: list[dict]) -> Observation:
    """Batch per-env observation dicts into an :class:`Observation` of torch tensors."""
    images = {
        k: torch.from_numpy(np.stack([o["images"][k] for o in obs])) for k in obs[0]["images"]
    }
    state = None
    if obs[0].get("state") is not None:
        state = torch.from_numpy(np.stack([o["state"] for o in obs]).astype(np.float32))
    return Observation(images=images, state=state, instruction=[o["instruction"] for o in obs])

"""Subprocess vectorisation: single-env simulators ("cores") in child processes, one or several
per child.

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
into batched tensors. A child may host several cores (``per_process``): it runs their commands
one after another, and costs the simulator's libraries once instead of once per env (a
ManiSkill child holds about 0.7 GB before its first env, a few MB for each further one). A
child that dies (or does not answer within ``timeout_s``) is killed, started again and reported
as crashed for the envs of the command; its other envs lost their episode too and report a crash
until they are reset. An exception raised by a core is re-raised in the parent with the child's
traceback. :meth:`SubprocEnvs.close` always joins or terminates every child.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlinf_vla.envs.base import StepOutput
from rlinf_vla.types import Observation

#: clock ticks per second of the CPU times in ``/proc/<pid>/stat``
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: Returned by :meth:`SubprocEnvs.call` for a child that crashed (it has been restarted).
CRASHED = object()


class EnvWorkerError(RuntimeError):
    """A simulator core raised an exception in its subprocess (traceback in the message)."""


def _worker_main(
    conn: Connection, factories: list[Callable[[], Any]], env_vars: dict[str, str]
) -> None:
    """A child: builds its cores, then answers ``(method, {slot: args})`` with
    ``{slot: ("ok", result) | ("error", traceback)}`` until ``close``."""
    os.environ.update(env_vars)
    cores: list[Any] = []
    try:
        for factory in factories:
            cores.append(factory())
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        return
    while True:
        try:
            method, calls = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        answers: dict[int, tuple[str, Any]] = {}
        for slot, args in calls.items():
            try:
                answers[slot] = ("ok", getattr(cores[slot], method)(*args))
            except BaseException:
                answers[slot] = ("error", traceback.format_exc())
        conn.send(answers)
        if method == "close":
            break
    conn.close()


@dataclass
class _Child:
    process: mp.Process
    conn: Connection


class SubprocEnvs:
    """``n`` single-env cores in subprocesses, stepped in parallel.

    Args:
        factories: one picklable zero-argument callable per env, building its core in the child.
        name: env name used in messages.
        env_vars: environment variables set in each child before the factory runs.
        timeout_s: seconds a child may take to start or to answer a command before it is
            considered hung, killed and restarted.
        per_process: envs hosted by each child (envs ``[j * per_process, (j + 1) *
            per_process)`` live in child ``j``; the last child may hold fewer). A child runs
            its envs' commands one after another; children run in parallel.
    """

    def __init__(
        self,
        factories: list[Callable[[], Any]],
        name: str,
        env_vars: dict[str, str] | None = None,
        timeout_s: float = 600.0,
        per_process: int = 1,
    ) -> None:
        if per_process < 1:
            raise ValueError(f"per_process must be >= 1, got {per_process}")
        self.name = name
        self.factories = factories
        self.env_vars = dict(env_vars or {})
        self.timeout_s = timeout_s
        self.per_process = per_process
        #: how often each env's child was restarted
        self.restarts = [0] * len(factories)
        n = len(factories)
        self._members = [list(range(j, min(n, j + per_process))) for j in range(0, n, per_process)]
        self._ctx = mp.get_context("spawn")
        self._children: list[_Child | None] = [None] * len(self._members)
        self._stale: set[int] = set()  # envs whose child was restarted: no episode until reset
        self._closed = False
        try:
            for j in range(len(self._members)):
                self._children[j] = self._spawn(j)
            errors = [self._await_ready(j) for j in range(len(self._members))]
        except BaseException:
            self.close()
            raise
        bad = [(j, e) for j, e in enumerate(errors) if e]
        if bad:
            self.close()
            j, err = bad[0]
            raise EnvWorkerError(f"{name} {self._label(j)} failed to start:\n{err}")

    def __len__(self) -> int:
        return len(self.factories)

    @property
    def num_processes(self) -> int:
        return len(self._members)

    def _child_of(self, i: int) -> int:
        return i // self.per_process

    def _label(self, j: int) -> str:
        members = self._members[j]
        if len(members) == 1:
            return f"env {members[0]}"
        return f"envs {members[0]}-{members[-1]}"

    # ------------------------------------------------------------------ processes
    def _spawn(self, j: int) -> _Child:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child, [self.factories[i] for i in self._members[j]], self.env_vars),
            name=f"{self.name}-{self._label(j).replace(' ', '-')}",
            daemon=True,
        )
        proc.start()
        child.close()
        return _Child(proc, parent)

    def _await_ready(self, j: int) -> str | None:
        """``None`` when child ``j`` started, else its error text."""
        child = self._children[j]
        assert child is not None
        try:
            if not child.conn.poll(self.timeout_s):
                self._kill(j)
                return f"no answer within {self.timeout_s} s"
            status, payload = child.conn.recv()
        except (EOFError, OSError):
            self._kill(j)
            return f"the process died during start-up (exit code {child.process.exitcode})"
        return None if status == "ok" else payload

    def _kill(self, j: int) -> None:
        child = self._children[j]
        if child is None:
            return
        self._children[j] = None
        with contextlib.suppress(OSError):
            child.conn.close()
        if child.process.is_alive():
            child.process.kill()
        child.process.join(timeout=10)

    def restart(self, i: int) -> None:
        """Kill the child of env ``i`` (if alive) and start a fresh one. The child's other envs
        lose their episode too: until they are reset, every other command on them answers
        :data:`CRASHED`."""
        j = self._child_of(i)
        self._kill(j)
        for k in self._members[j]:
            self.restarts[k] += 1
            if k != i:
                self._stale.add(k)
        self._children[j] = self._spawn(j)
        err = self._await_ready(j)
        if err:
            raise EnvWorkerError(f"{self.name} {self._label(j)} failed to restart:\n{err}")

    def process(self, i: int) -> mp.Process | None:
        """The process of env ``i``'s child (for tests and monitoring)."""
        child = self._children[self._child_of(i)]
        return None if child is None else child.process

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system, all threads) the live children have used so far, from
        ``/proc``; ``None`` where that is not readable (not Linux)."""
        total = 0.0
        for child in self._children:
            if child is None or child.process.pid is None:
                continue
            try:
                stat = Path(f"/proc/{child.process.pid}/stat").read_text()
            except OSError:
                return None
            # fields after the command name (which may hold spaces) close with ") "
            fields = stat.rsplit(") ", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        return total

    # ------------------------------------------------------------------ commands
    def call(self, method: str, args: dict[int, tuple]) -> dict[int, Any]:
        """Call ``core.method(*args[i])`` for every env ``i`` of ``args``; children in parallel.

        Returns each result, or :data:`CRASHED` for envs whose child died (it is restarted)
        and for envs that lost their episode to a restart and were not reset since.
        Raises :class:`EnvWorkerError` when a core raised (after all answers are collected).
        """
        if self._closed:
            raise RuntimeError(f"{self.name} envs are closed")
        results: dict[int, Any] = {}
        calls: dict[int, dict[int, tuple]] = {}
        for i, a in args.items():
            if i in self._stale and method != "reset":
                results[i] = CRASHED
                continue
            self._stale.discard(i)
            calls.setdefault(self._child_of(i), {})[i % self.per_process] = a
        sent: list[int] = []
        crashed: list[int] = []
        for j, slots in calls.items():
            child = self._children[j]
            try:
                assert child is not None
                child.conn.send((method, slots))
                sent.append(j)
            except (OSError, AssertionError):
                crashed.append(j)
        errors: list[tuple[int, str]] = []
        for j in sent:
            child = self._children[j]
            assert child is not None
            try:
                if not child.conn.poll(self.timeout_s):
                    raise TimeoutError
                answers = child.conn.recv()
            except (EOFError, OSError, TimeoutError):
                crashed.append(j)
                continue
            first = self._members[j][0]
            for slot, (status, payload) in answers.items():
                if status == "ok":
                    results[first + slot] = payload
                else:
                    errors.append((first + slot, payload))
        for j in crashed:
            envs = [self._members[j][0] + slot for slot in calls[j]]
            results.update(dict.fromkeys(envs, CRASHED))
            self.restart(envs[0])
            self._stale.difference_update(envs)  # reported now; the caller resets them
        if errors:
            i, err = min(errors)
            raise EnvWorkerError(f"{self.name} env {i} raised in {method}():\n{err}")
        return results

    def close(self) -> None:
        """Ask every child to close its cores, then join; terminate those that do not exit."""
        if self._closed:
            return
        self._closed = True
        for j, child in enumerate(self._children):
            if child is None:
                continue
            with contextlib.suppress(OSError):
                child.conn.send(("close", {s: () for s in range(len(self._members[j]))}))
        for j, child in enumerate(self._children):
            if child is None:
                continue
            try:
                if child.conn.poll(30):
                    child.conn.recv()
            except (EOFError, OSError):
                pass
            child.process.join(timeout=30)
            self._kill(j)


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

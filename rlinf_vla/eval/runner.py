"""The evaluation driver: trials scheduled onto env slots, one batched policy call per round.

Each round (lockstep over all workers):

1. free slots get the next trials (a slot prefers more trials of its current task, so LIBERO
   rarely rebuilds a simulator) and reset to them (``EvalEnvWorker.start``);
2. the observations of every busy slot are concatenated and the policy acts once on the batch
   (greedy by default), giving action chunks ``[N, K, A]``;
3. each slot executes its whole chunk (``EvalEnvWorker.step``), all workers in parallel;
   slots whose episode ended report their trial, which is appended to ``trials.jsonl`` at once.

A trial whose simulator crashed (its subprocess died, or the env raised) goes back to the
front of the queue; after ``eval.retries`` such retries it is recorded as an error.

An env worker that stops answering is caught by the runtime's call deadlines
(:mod:`rlinf_vla.runtime.stall`: ``cluster.stall_factor``, ``cluster.stall_min_s``) and stops
the evaluation with :class:`~rlinf_vla.runtime.WorkerStalled` naming it; that, a crashed worker,
Ctrl-C or SIGTERM stop it at once (the workers are killed, not asked to close), with the
reports written from the trials recorded so far. The same command continues the evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_vla import provenance
from rlinf_vla.eval.config import EvalJob, Trial
from rlinf_vla.eval.report import (
    TrialLog,
    build_results,
    check_identity,
    render_summary,
    sort_trials,
    write_reports,
)
from rlinf_vla.eval.stats import condition
from rlinf_vla.run.loop import stop_reason


@dataclass
class _SlotState:
    worker: int
    index: int
    trial: Trial | None = None
    obs: Any = None
    last_task: tuple[str, str, str | None] | None = None
    env_key: tuple | None = None
    instruction: str | None = None
    changes: dict[str, Any] | None = None


class _Queue:
    """Pending trials; a slot takes one of its current task, else of its env, else the first."""

    def __init__(self, trials: list[Trial]) -> None:
        self.items: deque[Trial] = deque(trials)

    def __len__(self) -> int:
        return len(self.items)

    def push_front(self, trial: Trial) -> None:
        self.items.appendleft(trial)

    def take(self, slot: _SlotState, running: set[tuple[str, str, str | None]]) -> Trial:
        """The trial for ``slot``: more of its last task; else the first trial of a task no
        other slot is running (spreading tasks over slots), preferring the slot's env; else
        the first trial."""
        same_env = fresh = first_fresh = None
        for j, t in enumerate(self.items):
            task = t.task_key
            if task == slot.last_task:
                return self._pop(j)
            if task not in running:
                if first_fresh is None:
                    first_fresh = j
                if fresh is None and t.env_key == slot.env_key:
                    fresh = j
            if same_env is None and t.env_key == slot.env_key:
                same_env = j
        for j in (fresh, first_fresh, same_env):
            if j is not None:
                return self._pop(j)
        return self._pop(0)

    def _pop(self, j: int) -> Trial:
        trial = self.items[j]
        del self.items[j]
        return trial


class _Progress:
    """A progress bar per suite: trials done, success rate (errors as failures), errors."""

    def __init__(self, enabled: bool, planned: dict[str, int]) -> None:
        self.counts = {s: [0, 0, 0] for s in planned}  # done, successes, errors
        self._bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self._bar = Progress(
            "[bold]{task.fields[suite]}",
            BarColumn(),
            MofNCompleteColumn(),
            "{task.fields[rate]}",
            TimeRemainingColumn(),
        )
        self._ids = {
            s: self._bar.add_task("", total=n, suite=s, rate="") for s, n in planned.items()
        }

    def add(self, record: dict[str, Any]) -> None:
        c = self.counts[condition(record)]
        c[0] += 1
        c[1] += bool(record["success"]) and not record["error"]
        c[2] += bool(record["error"])
        if self._bar is not None:
            rate = f"success {100 * c[1] / c[0]:5.1f}% ({c[1]}/{c[0]})"
            if c[2]:
                valid = c[0] - c[2]
                excl = f"{100 * c[1] / valid:.1f}%" if valid else "n/a"
                rate += f" errors {c[2]} (excl. errors {excl})"
            self._bar.update(self._ids[condition(record)], advance=1, rate=rate)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _record(trial: Trial, result: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    return {
        "suite": trial.suite,
        "task": trial.task,
        "task_index": trial.task_index,
        "init_state": trial.init_state,
        "reset_id": trial.reset_id,
        "success": None if error else bool(result["success"]),
        "steps": None if error else result["steps"],
        "error": error,
        "instruction": result.get("instruction"),
        "video": result.get("video"),
        "perturbation": trial.perturbation,
        "changes": None if error else result.get("changes"),
    }


def build_policy(job: EvalJob) -> Any:
    """The policy of the job, in eval mode on its device."""
    from rlinf_vla.policies import make_policy

    policy = make_policy(job.policy_name, job.policy_config)
    policy.eval()
    return policy


def header(job: EvalJob) -> dict[str, Any]:
    """The settings part of ``results.json``."""
    env = job.env_config
    suite = getattr(env, "suite", None)  # an env with suites (LIBERO) records the suite
    return {
        "env_name": job.env_name,
        "protocol": job.protocol,
        "suite": suite,
        "tasks": sorted({t.task for t in job.trials}) if suite is None else None,
        "policy_name": job.policy_name,
        "checkpoint": job.policy.get("checkpoint"),
        "trials_per_task": job.eval.trials_per_task,
        "greedy": job.eval.greedy,
        "max_episode_steps": env.max_episode_steps,
        "planned": len(job.trials),
        **({"perturbation": job.perturbation} if job.perturbation else {}),
    }


def finalize(job: EvalJob, log: TrialLog) -> dict[str, Any]:
    """Rewrite the reports of ``job.output_dir`` from the trial log (planned trials only)."""
    planned = {t.key for t in job.trials}
    order = {t.condition: i for i, t in reversed(list(enumerate(job.trials)))}
    order = {s: i for i, s in enumerate(sorted(order, key=order.get))}
    records = sort_trials([r for k, r in log.records.items() if k in planned], order)
    results = build_results(records, header(job))
    write_reports(job.output_dir, results)
    return results


def run(job: EvalJob) -> dict[str, Any]:
    """Run (or resume) the evaluation; returns the content of ``results.json``."""
    from rich.console import Console

    console = Console(stderr=True)
    out = Path(job.output_dir)
    check_identity(out, job.identity)
    log = TrialLog(out)
    todo = [t for t in job.trials if t.key not in log]
    changes = provenance.record(out, provenance.collect(start=len(job.trials) - len(todo)))
    if changes and len(todo) < len(job.trials):
        provenance.warn(console, changes, "the evaluation started")
    console.print(
        f"[bold]rlinf-vla eval[/]: {len(job.trials)} trials planned, "
        f"{len(job.trials) - len(todo)} already in {out}, {len(todo)} to run"
    )
    start = time.monotonic()
    done_now = 0
    try:
        if todo:
            done_now = _evaluate(job, todo, log, console)
    except BaseException as e:
        finalize(job, log)
        done = sum(t.key in log for t in job.trials)
        console.print(
            f"[bold red]evaluation stopped:[/] {stop_reason(e)}; {done} of {len(job.trials)} "
            f"trials are recorded in {out} (results.json, summary.md); the same command "
            f"with eval.output_dir={out} runs the other {len(job.trials) - done}",
            highlight=False,
            soft_wrap=True,
        )
        raise
    results = finalize(job, log)
    elapsed = time.monotonic() - start
    timing = {
        "trials_run": done_now,
        "seconds": round(elapsed, 2),
        "trials_per_hour": round(3600 * done_now / elapsed, 1) if done_now else None,
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    console.print(render_summary(results), markup=False, highlight=False, soft_wrap=True)
    console.print(f"results: {out / 'results.json'} ({timing})")
    return results


def _evaluate(job: EvalJob, todo: list[Trial], log: TrialLog, console: Any) -> int:
    """Run the trials ``todo`` on a local or remote Ray cluster; returns how many finished."""
    import torch

    from rlinf_vla.runtime import torch_threads

    ev = job.eval
    total_slots = max(1, min(job.env_config.num_envs, len(todo)))
    threads = ev.policy_threads or max(1, (os.cpu_count() or 1) - total_slots)
    # The thread count and the seed hold for this evaluation only: the caller's process (a
    # training run's evaluation, a test suite) gets its own back afterwards. Only the policy's
    # device has its RNG saved (no CUDA context for a CPU policy on a GPU machine).
    device = torch.device(job.policy_config.device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch_threads(threads), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(ev.seed)
        return _evaluate_in(job, todo, log, console, total_slots, threads)


def _evaluate_in(
    job: EvalJob, todo: list[Trial], log: TrialLog, console: Any, total_slots: int, threads: int
) -> int:
    """:func:`_evaluate` once the policy's thread count and seed are set."""
    from rlinf_vla.eval.worker import EvalEnvWorker
    from rlinf_vla.runtime import Cluster, WorkerGroup

    ev = job.eval
    policy = build_policy(job)  # fails on a broken checkpoint before any env starts
    num_workers = math.ceil(total_slots / ev.envs_per_worker)
    sizes = [ev.envs_per_worker] * (num_workers - 1)
    sizes.append(total_slots - sum(sizes))
    planned: dict[str, int] = {}
    for t in job.trials:
        planned[t.condition] = planned.get(t.condition, 0) + 1
    progress = _Progress(ev.progress, planned)
    for record in log.records.values():
        if condition(record) in planned:
            progress.add(record)
    console.print(
        f"{total_slots} env(s) in {num_workers} worker(s); policy {job.policy_name} on "
        f"{job.policy_config.device} ({threads} CPU thread(s))"
    )
    if not job.policy_config.checkpoint:
        console.print(
            "[yellow]warning:[/] policy.checkpoint is not set: this evaluates a randomly "
            f"initialised {job.policy_name} (pass policy.checkpoint=PATH to load weights)",
            highlight=False,
        )
    with Cluster(job.cluster) as cluster:
        group = WorkerGroup(
            cluster,
            EvalEnvWorker,
            name="eval_env",
            devices=[i % cluster.num_devices for i in range(num_workers)],
            args=(job.env_name, job.env_config, sizes),
            kwargs={
                "videos": ev.videos,
                "output_dir": str(Path(job.output_dir).resolve()),
                "video_fps": ev.video_fps,
            },
        )
        loop = _EvalLoop(group, sizes, policy, ev.greedy, ev.retries, _Queue(todo), log, progress)
        try:
            with progress:
                loop.run()
        except BaseException:
            # A stalled, crashed or interrupted run: the workers may not answer a close, so
            # they are killed (their simulator subprocesses end with them).
            group.shutdown()
            raise
        try:
            group.close().wait(timeout=120)
        except Exception as e:  # the trials are recorded; only the cleanup failed
            console.print(f"[yellow]closing the env workers failed: {e}")
        group.shutdown()
    return loop.finished


class _EvalLoop:
    """The scheduling loop: fill free slots, one batched policy call, step every busy slot."""

    def __init__(
        self,
        group: Any,
        sizes: list[int],
        policy: Any,
        greedy: bool,
        retries: int,
        queue: _Queue,
        log: TrialLog,
        progress: _Progress,
    ) -> None:
        self.group, self.policy, self.greedy, self.retries = group, policy, greedy, retries
        self.queue, self.log, self.progress = queue, log, progress
        self.slots = {(w, i): _SlotState(w, i) for w, n in enumerate(sizes) for i in range(n)}
        self.attempts: dict[tuple, int] = {}
        self.finished = 0

    def run(self) -> None:
        while len(self.queue) or self._busy():
            self._fill_free_slots()
            busy = self._busy()
            if busy:
                self._step(busy, self._act(busy))

    def _busy(self) -> list[_SlotState]:
        return [s for s in self.slots.values() if s.trial is not None]

    def _fill_free_slots(self) -> None:
        """Give every free slot the next trial and reset its env to it."""
        from rlinf_vla.runtime import wait_all

        starts: dict[int, dict[int, Trial]] = {}
        for slot in self.slots.values():
            if slot.trial is None and len(self.queue):
                running = {s.trial.task_key for s in self._busy()}
                slot.trial = self.queue.take(slot, running)
                slot.last_task, slot.env_key = slot.trial.task_key, slot.trial.env_key
                starts.setdefault(slot.worker, {})[slot.index] = slot.trial
        if not starts:
            return
        order = list(starts)
        calls = [
            self.group.start({i: dataclasses.asdict(t) for i, t in starts[w].items()}, ranks=[w])
            for w in order
        ]
        for w, (reply,) in zip(order, wait_all(calls), strict=True):
            for i, r in reply.items():
                slot = self.slots[(w, i)]
                if "error" in r:
                    trial, slot.trial = slot.trial, None
                    self._crashed(trial, {"error": r["error"]})
                else:
                    slot.obs, slot.instruction = r["obs"], r["obs"].instruction[0]
                    slot.changes = r.get("changes")

    def _act(self, busy: list[_SlotState]) -> Any:
        """Action chunks ``float32 [N, K, A]`` for the busy slots, from one policy call."""
        import torch

        from rlinf_vla.types import cat_obs

        with torch.inference_mode():
            out = self.policy.act(cat_obs([s.obs for s in busy]), greedy=self.greedy)
        return out.actions.detach().float().cpu()

    def _step(self, busy: list[_SlotState], chunks: Any) -> None:
        """Every busy slot executes its chunk; ended episodes are recorded (or retried)."""
        from rlinf_vla.runtime import wait_all

        per_worker: dict[int, dict[int, Any]] = {}
        for j, s in enumerate(busy):
            per_worker.setdefault(s.worker, {})[s.index] = chunks[j]
        order = list(per_worker)
        calls = [self.group.step(per_worker[w], ranks=[w]) for w in order]
        for w, (reply,) in zip(order, wait_all(calls), strict=True):
            for i, r in reply.items():
                slot = self.slots[(w, i)]
                if not r["done"]:
                    slot.obs = r["obs"]
                    continue
                trial, slot.trial, slot.obs = slot.trial, None, None
                if r["invalid"]:
                    self._crashed(trial, r)
                else:
                    self._save(
                        _record(
                            trial, {**r, "instruction": slot.instruction, "changes": slot.changes}
                        )
                    )

    def _crashed(self, trial: Trial, result: dict[str, Any]) -> None:
        """Requeue a crashed trial, or record it as an error once its retries are spent."""
        n = self.attempts[trial.key] = self.attempts.get(trial.key, 0) + 1
        if n <= self.retries:
            self.queue.push_front(trial)
            return
        reason = result.get("error") or "the simulator crashed"
        self._save(_record(trial, result, error=f"{reason} (after {n} attempt(s))"))

    def _save(self, record: dict[str, Any]) -> None:
        self.log.append(record)
        self.progress.add(record)
        self.finished += 1

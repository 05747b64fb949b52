"""Rollout throughput of the execution modes, next to a synchronous loop and the overlap bound.

Prints a table and writes JSON (default ``benchmarks/results/pipeline.json``)::

    python benchmarks/pipeline.py                     # toy (balanced) + ManiSkill
    python benchmarks/pipeline.py --workloads toy --iterations 3
    python benchmarks/pipeline.py --workloads libero --devices 1 --policy openvla_oft \
        --policy-preset full --libero-envs 16 --set policy.lora_rank=32 policy.dtype=bfloat16
    python benchmarks/pipeline.py --workloads metaworld --devices 1 --metaworld-envs 16 \
        --modes "collocated,collocated S=2,collocated S=4" --policy openvla_oft --policy-preset full

For each workload, in one run on the same hardware:

- **sync**: the loop of synchronous VLA-RL systems, in one process: all envs step, then the
  policy computes the next actions, one after the other, and what PPO needs with them (the
  log-probabilities and values, the values of episodes cut by the time limit, and after the
  last step the bootstrap value), as a single-file PPO script does; on one device (on CPU one
  slot's threads, as ``placement=local`` and each Ray component compute). Timed as
  ``--iterations`` rollouts of ``T`` chunk steps, each starting with a reset of every env
  (``r``), as each rollout of ``rlinf-vla train`` does (the median rollout counts). Its
  per-chunk env time ``e`` and inference time ``i`` give the **overlap bound**
  ``B * K * T / (r + T * max(e, i))``: the rate if env and inference overlapped perfectly.
- **collocated**, **disaggregated**, **hybrid S=1, 2, 4**: ``rlinf-vla train`` on a local Ray
  with ``--devices`` devices (CPU slots here; disaggregated gets one more, for the actor),
  rollout throughput ``throughput/env_steps_per_s`` (env steps / rollout seconds) as the median
  of the iterations after the first.
- **collocated S=2, 4**: every component on the same devices, each env worker's envs in 2 or 4
  pipeline stages. Where the simulators are CPU processes (LIBERO, ManiSkill on the CPU) and
  the policy is on a GPU, this overlaps simulation and inference on a single device.
- **local S=1, 2, 4**: ``placement=local``, every component in one process on device 0 (no
  Ray workers, no channel hops); with ``S >= 2`` one stage's simulators step while the process
  computes another stage's actions.

Each mode's ratio is taken against the mean of the loops measured just before and just after
it (a machine whose speed drifts over an hour-long run would otherwise favour the modes
measured first, and one whose speed swings within minutes the side measured while it was
fast); ``--repeats R``
measures every mode ``R`` times, every other repeat in the reverse order, and the table gives
the median ratio and the spread (on a small shared machine a single run's rank within ~10 %
is noise). The sync loop's row is the median of all its measurements.
Before the runs, ``placement=auto``'s profile is taken once on a Ray cluster of ``--devices``
devices, and its estimated rate of every mode it weighs is printed beside the measured one
(``--no-estimates`` skips it), with the plan it picks; and its estimated ratio to the loop
(``est. x``: the estimate over its estimate of local S=1, the plan that runs the loop) beside
the measured ratio, which does not depend on how fast the machine was while it profiled.

Each mode's rollout time is also broken down (a second table, and ``breakdown`` in the JSON):
the env side's reset and simulator steps, the policy's compute, serialisation and
object-store fetches, offload copies, the trajectories' hand-off, and the rest (round trips,
waiting, bookkeeping; negative where parts overlapped), from the workers' ``time/rollout/*``
metrics, medians over the timed iterations; the sync loop's beside them.

A third table counts CPU seconds per iteration, read from ``/proc`` for every process below the
benchmark's: the simulator processes, the run (the benchmark's process, which is the loop and
a mode's driver, and the Ray workers: policy, transport, update) and Ray's daemons (raylet, GCS,
log monitor, autoscaler monitor, dashboard, agents, idle workers). A mode's iteration is its
rollout, update and weight sync (the iterations after the first), the loop's its rollout.
Unlike the wall-clock ratios it hardly depends on how fast the machine is that minute: where the
modes' simulators do the same work as the loop's, what a mode adds shows in the other columns.
The same table gives each mode's memory: what its workers held together at the most
(``memory/total_rss_gib`` of ``rlinf-vla train``, the largest over the iterations and
repeats), the figure to size a machine by.

The toy workload adds a sleep per env step (``step_time_per_env_s``) that makes up the
difference between the env's own compute and the inference time, both measured by the loop
first, so that ``e == i`` (balanced; the sleep stands for a simulator running on its own
hardware). The machine's speed moves within minutes, and the inference time with it, so the
sleep is chosen again before each mode from the loop just after the mode before (the mode and
its two loops share one sleep; the JSON lists every sleep chosen). Each mode's fraction of the
overlap bound is taken against the bound its own two loops give. ManiSkill PickCube runs its CPU
simulator in one subprocess per env, LIBERO (``libero_spatial`` task 0, the cameras the policy
reads: agentview for OpenVLA; scenes seeded by reset id) and MetaWorld (MT1 ``pick-place-v3``,
the ``corner2`` camera) likewise. ``--modes`` picks some of the modes (each ``rlinf-vla train``
run ends with a checkpoint: at full size that is the policy's whole weights). ``--policy`` picks
OpenVLA or OpenVLA-OFT; ``--set`` adds ``rlinf-vla train`` overrides to every run (e.g. LoRA and
bf16 weights for the full-size policy on one GPU).

On a CUDA machine the devices are GPUs: the sync loop runs the policy there under
``algo.autocast`` (bf16), and a mode that needs more GPUs than the machine has is listed as
skipped. GPU simulation and the published model sizes (random weights)::

    python benchmarks/pipeline.py --workloads maniskill --maniskill-backend gpu \
        --maniskill-envs 64 --policy-preset full --devices 1
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from rlinf_vla import cli
from rlinf_vla.config import ConfigError
from rlinf_vla.envs import make_env
from rlinf_vla.pipelines.config import validate
from rlinf_vla.policies import make_policy
from rlinf_vla.runtime.cluster import child_processes, node_devices, proc_text
from rlinf_vla.runtime.local import worker_environment
from rlinf_vla.training.precision import autocast

#: Where the sync loop runs the policy: where the Ray modes' devices are.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: The classes of the processes below the benchmark that :class:`CpuWindow` counts: the
#: simulators (env processes, started with multiprocessing's ``spawn``), Ray's daemons (raylet,
#: GCS, log monitor, autoscaler monitor, dashboard, agents, idle workers; and the run's process
#: watcher), and the run itself (this process and the Ray workers: policy, transport, update).
CPU_CLASSES = ("simulators", "run", "ray")
_RAY_DAEMONS = (
    "log_monitor.py",
    "autoscaler/_private/monitor.py",
    "dashboard/dashboard.py",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "ray::IDLE",
    "import os, select, signal",  # rlinf_vla.runtime.reaper's watcher
)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_class(pid: int) -> str:
    cmd = proc_text(pid, "cmdline")
    if "spawn_main" in cmd:
        return "simulators"
    if proc_text(pid, "comm") in ("raylet", "gcs_server") or any(k in cmd for k in _RAY_DAEMONS):
        return "ray"
    return "run"


class CpuWindow:
    """CPU seconds (user + system) of this process and every process below it, per class
    (:data:`CPU_CLASSES`), between the first and the latest :meth:`sample`. A process that
    exits in between keeps the last CPU read of it; one that starts counts from zero. Linux
    (``/proc``); elsewhere every count is 0."""

    def __init__(self) -> None:
        self.first: dict[int, float] | None = None
        self.last: dict[int, tuple[float, str]] = {}

    def sample(self) -> None:
        children = child_processes()
        now, todo = {}, [os.getpid()]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            fields = proc_text(pid, "stat").rsplit(")", 1)[-1].split()
            if len(fields) > 12:
                now[pid] = (int(fields[11]) + int(fields[12])) / _TICK
        if self.first is None:
            self.first = now
        for pid, cpu in now.items():  # the class as first seen (a zombie has no cmdline)
            self.last[pid] = (cpu, self.last[pid][1] if pid in self.last else _cpu_class(pid))

    def totals(self) -> dict[str, float]:
        out = dict.fromkeys(CPU_CLASSES, 0.0)
        for pid, (cpu, cls) in self.last.items():
            out[cls] += cpu - (self.first or {}).get(pid, 0.0)
        return out


#: What :func:`sync_loop` returns: the median rollout's env steps/s, its env and inference
#: seconds per chunk step and its reset; and the CPU seconds per rollout of each class of
#: process (:data:`CPU_CLASSES`), over all the timed rollouts.
LoopResult = tuple[float, float, float, float, dict[str, float]]


class Skipped(Exception):
    """A mode whose config the workload refuses (the reason is the message)."""


@dataclass
class Workload:
    name: str
    env: str
    env_config: dict
    num_envs: int
    chunks: int


@dataclass
class Row:
    workload: str
    mode: str
    #: medians over the repeats (each repeat's rate is its own median over iterations)
    env_steps_per_s: float
    vs_sync: float
    of_bound: float
    #: where a rollout's seconds went (:data:`PARTS`), medians over the timed iterations
    breakdown: dict[str, float] | None = None
    #: each repeat's rate over the mean of the sync loop's rates measured just before and just
    #: after it
    ratios: list[float] | None = None
    #: ``placement=auto``'s estimate of the rate (env steps/s), where it weighs the mode
    estimate: float | None = None
    #: and of the ratio to the loop: the estimate over its estimate of local S=1, the plan
    #: that runs the loop (it does not depend on how fast the machine was while profiling)
    estimate_x: float | None = None
    #: CPU seconds of each class of process (:data:`CPU_CLASSES`) per iteration (a mode's
    #: rollout, update and weight sync; the loop's rollout), medians over the repeats
    cpu: dict[str, float] | None = None
    #: GiB the mode's workers held together at the most (``memory/total_rss_gib``), the
    #: largest over its iterations and repeats
    memory_gib: float | None = None


class Measured:
    """One workload's measurements, in the order they are taken: the loop, a mode, the loop,
    a mode, ..., the loop. Each mode's ratio is its rate over the mean of the loops just
    before and just after it, so that a machine whose speed drifts over the minutes a mode
    takes favours neither side."""

    def __init__(
        self, label: str, repeats: int, bound: Callable[[LoopResult], float] | None = None
    ) -> None:
        self.label, self.repeats = label, repeats
        #: the overlap bound a loop's timings give (env steps/s); a mode's fraction of it is
        #: taken against the mean of its two loops' bounds
        self.bound = bound
        self.loops: list[LoopResult] = []  # sync_loop's results
        self.rates: dict[str, list[float]] = {}
        self.ratios: dict[str, list[float]] = {}
        self.of_bound: dict[str, list[float]] = {}
        self.parts: dict[str, list[dict[str, float]]] = {}
        self.cpu: dict[str, list[dict[str, float]]] = {}
        self.memory: dict[str, list[float]] = {}
        #: the mode measured since the last loop: (mode, rate, parts, CPU, loop before, repeat)
        self.waiting: tuple[str, float, dict[str, float], dict[str, float], int, int] | None = None

    def add_mode(
        self,
        mode: str,
        rate: float,
        parts: dict[str, float],
        cpu: dict[str, float],
        rep: int,
        memory: float | None = None,
    ) -> None:
        """A mode measured after the last loop; its ratio waits for the next loop. ``memory``:
        what its workers held together at the most (GiB), where the run reported it."""
        self.waiting = (mode, rate, parts, cpu, len(self.loops) - 1, rep)
        if memory is not None:
            self.memory.setdefault(mode, []).append(memory)

    def add_loop(self, loop: LoopResult) -> None:
        """A loop measured; the mode before it (if any) gets its ratio."""
        self.loops.append(loop)
        if self.waiting is None:
            return
        mode, rate, parts, cpu, k, rep = self.waiting
        self.waiting = None
        before, after = self.loops[k][0], self.loops[k + 1][0]
        ratio = rate / ((before + after) / 2)
        self.rates.setdefault(mode, []).append(rate)
        self.ratios.setdefault(mode, []).append(ratio)
        of_bound = ""
        if self.bound is not None:
            bound = (self.bound(self.loops[k]) + self.bound(self.loops[k + 1])) / 2
            self.of_bound.setdefault(mode, []).append(rate / bound)
            of_bound = f", {rate / bound:.0%} of the bound {bound:.1f} they give"
        self.parts.setdefault(mode, []).append(parts)
        self.cpu.setdefault(mode, []).append(cpu)
        print(
            f"{self.label}[{rep + 1}/{self.repeats}] {mode} {rate:.1f} env steps/s, the "
            f"loop before and after it {before:.1f} and {after:.1f} ({ratio:.2f}x{of_bound})",
            flush=True,
        )


#: The plan of ``placement=auto`` (mode, env devices, rollout devices, stages) each benchmark
#: mode runs, with 2 devices (disaggregated: 3).
PLAN_OF = {
    "collocated": ("collocated", "all", "all", 1),
    "collocated S=2": ("collocated", "all", "all", 2),
    "collocated S=4": ("collocated", "all", "all", 4),
    "disaggregated": ("disaggregated", "0", "1", 1),
    "hybrid S=1": ("hybrid", "0", "1", 1),
    "hybrid S=2": ("hybrid", "0", "1", 2),
    "hybrid S=4": ("hybrid", "0", "1", 4),
    "local S=1": ("local", "0", "0", 1),
    "local S=2": ("local", "0", "0", 2),
    "local S=4": ("local", "0", "0", 4),
}


def auto_estimates(
    w: Workload, policy_args: list[str], devices: int
) -> tuple[dict[str, float], str, str]:
    """``placement=auto``'s estimated rollout rate (env steps/s) of each benchmark mode it
    weighs, the mode it picks among its plans on ``devices`` devices, and its measured costs
    (one line): its profile runs on a Ray cluster of ``devices`` devices, as a run's would."""
    from rlinf_vla.pipelines.auto import candidate_plans, describe_costs, estimate
    from rlinf_vla.runtime import Cluster

    job = validate(
        cli.compose(
            "train",
            [
                *env_overrides(w),
                *policy_args,
                "placement=auto",
                f"cluster.devices_per_node={devices}",
                f"runner.rollout_chunks={w.chunks}",
                "runner.eval_interval=0",
                "algo.update_epochs=1",
            ],
        )
    )
    with Cluster(job.cluster) as cluster:
        costs, plans, chosen = estimate(job, cluster)
    groups = w.num_envs // job.env_config.group_size
    more = candidate_plans(costs, devices + 1, groups, w.chunks, job.placement.max_stages)

    def key(p: Any) -> tuple:
        return (p.mode, p.components["env"], p.components["rollout"], p.stages)

    steps = w.num_envs * job.policy_config.chunk_size * w.chunks
    by_key = {key(p): p for p in plans}
    by_key[PLAN_OF["disaggregated"]] = next(
        (p for p in more if key(p) == PLAN_OF["disaggregated"]), None
    )
    rates = {m: steps / by_key[k].rollout_s for m, k in PLAN_OF.items() if by_key.get(k)}
    pick = next((m for m, k in PLAN_OF.items() if k == key(chosen)), chosen.describe().strip())
    return rates, pick, describe_costs(costs, w.num_envs)


#: The parts of a rollout's wall time the breakdown table shows, and the metric each is read
#: from (``rlinf_vla.pipelines.runner.rollout_breakdown``); ``rest`` is the wall time minus
#: all of them: channel hops, waiting and bookkeeping (negative where parts overlapped).
PARTS = {
    "wall": "time/rollout_s",
    "reset": "time/rollout/env_reset_s",
    "sim": "time/rollout/env_sim_s",
    "policy": "time/rollout/policy_s",
    "serialise": "time/rollout/serialise_s",
    "copies": "time/rollout/copy_s",
    "hand-off": "time/rollout/finish_s",
}


def overlap_bound(w: Workload, chunk_size: int, loop: LoopResult) -> float:
    """The rate (env steps/s) of perfect overlap of env and inference after the rollout's
    reset, from a loop's timings."""
    _, e, i, reset, _ = loop
    return w.num_envs * chunk_size * w.chunks / (reset + w.chunks * max(e, i))


def balanced_sleep(w: Workload, chunk_size: int, loop: LoopResult) -> float:
    """The toy's per-env sleep (``step_time_per_env_s``) that makes a chunk step of the envs
    (their own compute and the sleep) cost what inference does, from the timings of a loop
    run with the sleep ``w`` has: its env time less that sleep is the env's own compute."""
    per_chunk = chunk_size * w.num_envs
    own = loop[1] - w.env_config.get("step_time_per_env_s", 0.0) * per_chunk
    return round(max(loop[2] - own, 0.0) / per_chunk, 6)


def with_rest(parts: dict[str, float]) -> dict[str, float]:
    """``parts`` and ``rest``: the wall time none of the parts accounts for."""
    rest = parts["wall"] - sum(v for k, v in parts.items() if k != "wall")
    return {**parts, "rest": rest}


def env_overrides(w: Workload) -> list[str]:
    """The ``rlinf-vla train`` overrides that select the workload's env."""
    defaults = yaml.safe_load((cli.CONFIG_DIR / "env" / f"{w.env}.yaml").read_text())
    extra = [
        f"{'' if k in defaults else '+'}env.{k}={'null' if v is None else v}"
        for k, v in w.env_config.items()
    ]
    return [f"env={w.env}", f"env.num_envs={w.num_envs}", *extra]


def policy_overrides(policy: str, preset: str, chunk_size: int, extra: list[str]) -> list[str]:
    """The ``rlinf-vla train`` overrides of the policy the benchmark runs (and ``--set``)."""
    return [
        f"policy={policy}",
        f"policy.preset={preset}",
        f"policy.chunk_size={chunk_size}",
        *extra,
    ]


def sync_loop(w: Workload, policy_args: list[str], chunks: int, rollouts: int = 1) -> LoopResult:
    """The synchronous loop in this process, ``rollouts`` rollouts of ``chunks`` chunk steps,
    each starting with a reset (as every rollout of ``rlinf-vla train`` starts fresh episodes,
    inside its time). It computes what a PPO rollout needs, as a single-file PPO script's
    loop does: the actions with their log-probabilities and values at every chunk step, the
    values of the final observations of episodes cut by the time limit, and after the last
    step the value of the observation the rollout stopped in. Returns the median rollout's
    (env steps/s, e, i, r): e and i per chunk step (i with those values), r its reset (the
    median, like the modes' rates, is robust to one slow rollout), and the CPU seconds per
    rollout of each class of process."""
    # Env and policy exactly as `rlinf-vla train` builds them: the groups' defaults, then ours.
    # (no evaluation: its video check would refuse a machine without FFmpeg for nothing)
    job = validate(
        cli.compose("train", [*env_overrides(w), *policy_args, "runner.eval_interval=0"])
    )
    device = torch.device(DEVICE)
    policy = make_policy(job.policy_name, job.policy_config, seed=0, device=DEVICE)
    policy.eval()
    with worker_environment():  # its simulator processes start as every mode's do
        env = make_env(job.env_name, job.env_config)

    def done() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def act(obs: Any) -> torch.Tensor:
        with torch.no_grad(), autocast(device, job.algo.autocast):
            actions = policy.act(obs).actions
        done()
        return actions

    def values(obs: Any) -> None:
        with torch.no_grad(), autocast(device, job.algo.autocast):
            policy.value(obs)
        done()

    def truncated_values(result: Any) -> None:
        rows = torch.nonzero(result.truncated.any(dim=1)).flatten()
        if result.final_obs is not None and len(rows):
            values(result.final_obs.select(rows))

    steps = w.num_envs * job.policy_config.chunk_size * chunks
    timed: list[tuple[float, float, float, float]] = []
    try:
        obs = env.reset()
        for _ in range(2):  # warm-up
            obs = env.chunk_step(act(obs)).obs
        cpu = CpuWindow()
        cpu.sample()
        for _ in range(rollouts):
            t0 = time.perf_counter()
            obs = env.reset()
            r = time.perf_counter() - t0
            e = i = 0.0
            for _ in range(chunks):
                t0 = time.perf_counter()
                actions = act(obs)
                t1 = time.perf_counter()
                result = env.chunk_step(actions)
                t2 = time.perf_counter()
                truncated_values(result)
                obs = result.obs
                i += t1 - t0 + time.perf_counter() - t2
                e += t2 - t1
            t0 = time.perf_counter()
            values(obs)  # bootstrap
            i += time.perf_counter() - t0
            timed.append((steps / (r + e + i), e / chunks, i / chunks, r))
        cpu.sample()
    finally:
        env.close()
    per_rollout = {k: v / rollouts for k, v in cpu.totals().items()}
    return (*sorted(timed)[len(timed) // 2], per_rollout)


def _count_cpu(window: CpuWindow, metrics: Path, rows: int, done: threading.Event) -> None:
    """Sample ``window`` when the run writes its first metrics row, every 2 s after (a process
    that exits keeps its last count), and when it writes its ``rows``-th."""
    last = 0.0
    while not done.is_set():
        seen = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if seen >= 1 and (window.first is None or seen >= rows or time.monotonic() - last > 2):
            window.sample()
            last = time.monotonic()
            if seen >= rows:
                return
        done.wait(0.1)


def mode_rate(
    w: Workload, mode: list[str], policy_args: list[str], devices: int, iterations: int, out: Path
) -> tuple[float, dict[str, float], dict[str, float], float | None]:
    """Median rollout env steps/s of ``rlinf-vla train`` in ``mode`` (iterations after the
    first), the median of each part of the rollout's time (:data:`PARTS`), the CPU seconds
    per iteration of each class of process (:data:`CPU_CLASSES`) over those iterations, and
    the most its workers held together (``memory/total_rss_gib``, every iteration; ``None``
    if no row has it)."""
    args = [
        "train",
        *env_overrides(w),
        *policy_args,
        *mode,
        f"cluster.devices_per_node={devices}",
        f"runner.rollout_chunks={w.chunks}",
        f"runner.max_iterations={iterations}",
        f"runner.save_interval={iterations}",
        "runner.logging.tensorboard=false",
        "runner.eval_interval=0",
        "algo.update_epochs=1",
        f"runner.output_dir={out}",
    ]
    try:  # a mode the workload cannot take (e.g. more stages than env groups) is skipped
        validate(cli.compose(args[0], args[1:]))
    except ConfigError as e:
        raise Skipped(str(e)) from None
    cpu, done = CpuWindow(), threading.Event()
    counter = threading.Thread(
        target=_count_cpu, args=(cpu, out / "metrics.jsonl", iterations, done), daemon=True
    )
    counter.start()
    try:
        if cli.main(args) != 0:
            raise RuntimeError(f"train failed: {' '.join(args)}")
    finally:
        done.set()
        counter.join()
    every = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = every[1:]
    parts = {name: statistics.median(r[key] for r in rows) for name, key in PARTS.items()}
    per_iteration = {k: v / max(len(rows), 1) for k, v in cpu.totals().items()}
    rate = statistics.median(r["throughput/env_steps_per_s"] for r in rows)
    held = [r["memory/total_rss_gib"] for r in every if "memory/total_rss_gib" in r]
    return rate, with_rest(parts), per_iteration, max(held, default=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="toy,maniskill")
    parser.add_argument("--devices", type=int, default=2, help="devices of the Ray modes")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the loop and every mode this many times, in turn (medians and spread)",
    )
    parser.add_argument(
        "--no-estimates", action="store_true", help="skip placement=auto's estimates"
    )
    parser.add_argument("--chunk-size", type=int, default=2)
    parser.add_argument("--toy-envs", type=int, default=64, help="envs of the toy workload")
    parser.add_argument("--maniskill-envs", type=int, default=4, help="envs of ManiSkill")
    parser.add_argument("--libero-envs", type=int, default=4, help="envs of LIBERO")
    parser.add_argument("--metaworld-envs", type=int, default=4, help="envs of MetaWorld")
    parser.add_argument(
        "--modes", default=None, help="comma-separated modes to run (default: all that fit)"
    )
    parser.add_argument("--policy", choices=("openvla", "openvla_oft"), default="openvla")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train overrides"
    )
    parser.add_argument(
        "--maniskill-backend", choices=("cpu", "gpu"), default="cpu", help="ManiSkill simulation"
    )
    parser.add_argument(
        "--policy-preset",
        choices=("tiny", "full"),
        default="tiny",
        help="policy size: tiny, or full (the published dims, random weights)",
    )
    parser.add_argument("--output", default="benchmarks/results/pipeline.json")
    args = parser.parse_args()

    workloads = []
    if "toy" in args.workloads:
        workloads.append(Workload("toy (balanced)", "toy", {}, args.toy_envs, 16))
    if "maniskill" in args.workloads:
        backend = args.maniskill_backend
        maniskill = {"task": "PickCube-v1", "sim_backend": backend, "wrist": False}
        name = f"maniskill PickCube{' (GPU sim)' if backend == 'gpu' else ''}"
        workloads.append(Workload(name, "maniskill", maniskill, args.maniskill_envs, 8))
    if "libero" in args.workloads:
        # Scenes seeded by their reset ids: with the official seed chain (`env.scene_seed`) a
        # simulator that meets an init state for the first time replays the resets before it
        # (about 24 ms each, up to 49), so the first rollouts' resets cost up to a second more
        # at random: noise in a measurement of a few rollouts.
        libero = {"suite": "libero_spatial", "task_ids": "[0]", "scene_seed": None}
        workloads.append(Workload("libero spatial", "libero", libero, args.libero_envs, 8))
    if "metaworld" in args.workloads:
        metaworld = {"task_set": "MT1", "task": "pick-place-v3"}
        workloads.append(
            Workload("metaworld pick-place", "metaworld", metaworld, args.metaworld_envs, 8)
        )
    policy_args = policy_overrides(args.policy, args.policy_preset, args.chunk_size, args.set)
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else None
    d = args.devices
    modes = {
        "collocated": ["placement=collocated"],
        "disaggregated": ["placement=disaggregated"],
        # one trajectory per iteration: the actor on one device
        "hybrid S=1": ["placement=hybrid", "placement.stages=1", "placement.components.actor=0"],
        "hybrid S=2": ["placement=hybrid", "placement.stages=2"],
        "hybrid S=4": ["placement=hybrid", "placement.stages=4"],
        # one device: CPU simulators in their processes beside inference on it
        "collocated S=2": ["placement=collocated", "placement.stages=2"],
        "collocated S=4": ["placement=collocated", "placement.stages=4"],
        # one process, no Ray: threads and in-process hand-offs (rlinf_vla.runtime.local)
        "local S=1": ["placement=local", "placement.stages=1"],
        "local S=2": ["placement=local", "placement.stages=2"],
        "local S=4": ["placement=local", "placement.stages=4"],
    }
    if args.modes:
        chosen = [m.strip() for m in args.modes.split(",")]
        unknown = [m for m in chosen if m not in modes]
        if unknown:
            parser.error(f"unknown modes {unknown}; known: {', '.join(modes)}")
        modes = {m: modes[m] for m in chosen}
    # The sync loop computes on one device, as placement=local and each Ray component do: on CPU
    # with one slot's threads of `--devices` slots.
    if DEVICE == "cpu":
        torch.set_num_threads(node_devices(0, os.cpu_count() or 1, d)[2] or 1)
    results: list[Row] = []
    meta = {}
    skipped: dict[str, str] = {}

    def write() -> None:
        """The JSON of what has been measured so far (a run cut short keeps its rows)."""
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(
            json.dumps(
                {
                    "machine": {
                        "platform": platform.platform(),
                        "cpus": os.cpu_count(),
                        "python": sys.version.split()[0],
                        "torch": torch.__version__,
                        "load_avg": os.getloadavg(),
                        "gpus": [torch.cuda.get_device_name(k) for k in range(gpus or 0)],
                    },
                    "devices": d,
                    "policy": args.policy,
                    "policy_preset": args.policy_preset,
                    "set": args.set,
                    "chunk_size": args.chunk_size,
                    "skipped": skipped,
                    "iterations": args.iterations,
                    "repeats": args.repeats,
                    "workloads": meta,
                    "rows": [asdict(r) for r in results],
                },
                indent=2,
            )
        )

    for w in workloads:
        balanced = w.env == "toy"
        sleeps: list[float] = []  # the sleep each balancing chose

        def balance(loop: LoopResult, w: Workload = w, sleeps: list[float] = sleeps) -> None:
            w.env_config["step_time_per_env_s"] = balanced_sleep(w, args.chunk_size, loop)
            sleeps.append(w.env_config["step_time_per_env_s"])

        if balanced:  # both measured as the timed loop measures them: whole rollouts, median
            balance(sync_loop(w, policy_args, w.chunks, rollouts=3))
        estimates: dict[str, float] = {}
        if not args.no_estimates:
            estimates, pick, measured = auto_estimates(w, policy_args, d)
            print(f"{w.name}: placement=auto {measured}; it picks {pick}", flush=True)
        bound_of = functools.partial(overlap_bound, w, args.chunk_size)
        m = Measured(f"{w.name}: ", args.repeats, bound_of)
        for rep in range(args.repeats):
            # every other repeat in the reverse order: a machine that slows down (or speeds up)
            # over the run does not always favour the same modes
            order = list(modes.items())
            for mode, overrides in order if rep % 2 == 0 else order[::-1]:
                devices = d + 1 if mode == "disaggregated" else d
                if not mode.startswith(("collocated", "local")) and d < 2:
                    skipped[mode] = "needs env and rollout on different devices (--devices 2)"
                elif gpus is not None and devices > gpus:
                    skipped[mode] = f"needs {devices} GPUs, the machine has {gpus}"
                if mode in skipped or f"{w.name}: {mode}" in skipped:
                    continue
                if balanced and m.waiting is not None:
                    # the machine's speed moves within minutes, and with it the inference time
                    # the sleep was chosen for: the mode before gets its loop after it, then
                    # the sleep is chosen again from that loop for this mode and its two loops
                    after = sync_loop(w, policy_args, w.chunks, rollouts=args.iterations)
                    m.add_loop(after)
                    balance(after)
                # the loop just before the mode (and after the one before it)
                m.add_loop(sync_loop(w, policy_args, w.chunks, rollouts=args.iterations))
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()  # the loop's policy is gone; the workers need it
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        rate, parts, cpu, held = mode_rate(
                            w, overrides, policy_args, devices, args.iterations, Path(tmp)
                        )
                    except Skipped as e:
                        skipped[f"{w.name}: {mode}"] = str(e)
                        print(f"{w.name}: {mode} skipped: {e}", flush=True)
                        continue
                m.add_mode(mode, rate, parts, cpu, rep, held)
        if m.waiting is not None or not m.loops:  # the loop after the last mode (or alone)
            m.add_loop(sync_loop(w, policy_args, w.chunks, rollouts=args.iterations))
        loops, rates, ratios, parts_of = m.loops, m.rates, m.ratios, m.parts

        def median_cpu(counts: list[dict[str, float]]) -> dict[str, float]:
            return {k: round(statistics.median(c[k] for c in counts), 3) for k in CPU_CLASSES}

        sync = statistics.median(x[0] for x in loops)
        e, i, reset = (statistics.median(x[k] for x in loops) for k in (1, 2, 3))
        bound = statistics.median(bound_of(x) for x in loops)
        meta[w.name] = {
            "env_chunk_s": e,
            "infer_chunk_s": i,
            "env_reset_s": reset,
            "config": w.env_config,
            "loop_rates": [round(x[0], 2) for x in loops],
            "loop_bounds": [round(bound_of(x), 2) for x in loops],
        }
        if balanced:  # the sleep each balancing chose, the first before any loop
            meta[w.name]["step_time_per_env_s"] = sleeps
        if estimates:
            meta[w.name]["auto_pick"] = pick
            meta[w.name]["auto_costs"] = measured
        loop_parts = with_rest(
            {
                "wall": reset + w.chunks * (e + i),
                "reset": reset,
                "sim": w.chunks * e,
                "policy": w.chunks * i,
                "serialise": 0.0,
                "copies": 0.0,
                "hand-off": 0.0,
            }
        )
        results.append(
            Row(
                w.name,
                "sync loop",
                round(sync, 1),
                1.0,
                round(statistics.median(x[0] / bound_of(x) for x in loops), 3),
                {k: round(v, 4) for k, v in loop_parts.items()},
                cpu=median_cpu([x[4] for x in loops]),
            )
        )
        for mode, measured_rates in rates.items():
            rate = statistics.median(measured_rates)
            parts = {k: statistics.median(p[k] for p in parts_of[mode]) for k in parts_of[mode][0]}
            results.append(
                Row(
                    w.name,
                    mode,
                    round(rate, 1),
                    round(statistics.median(ratios[mode]), 2),
                    round(statistics.median(m.of_bound[mode]), 3),
                    {k: round(v, 4) for k, v in parts.items()},
                    [round(x, 3) for x in ratios[mode]],
                    round(estimates[mode], 1) if mode in estimates else None,
                    round(estimates[mode] / estimates["local S=1"], 2)
                    if mode in estimates and "local S=1" in estimates
                    else None,
                    median_cpu(m.cpu[mode]),
                    round(max(m.memory[mode]), 2) if m.memory.get(mode) else None,
                )
            )
        results.append(Row(w.name, "overlap bound", round(bound, 1), round(bound / sync, 2), 1.0))
        write()

    print(
        f"\n{'workload':<20} {'mode':<15} {'env steps/s':>11} {'x sync':>7} {'spread':>11} "
        f"{'of bound':>9} {'auto est.':>9} {'est. err':>8} {'est. x':>6} {'x err':>6}"
    )
    for r in results:
        spread = f"{min(r.ratios):.2f}-{max(r.ratios):.2f}" if r.ratios else ""
        est = (
            f"{r.estimate:>9.1f} {r.estimate / r.env_steps_per_s - 1:>+8.0%}" if r.estimate else ""
        )
        if r.estimate_x:
            est += f" {r.estimate_x:>6.2f} {r.estimate_x / r.vs_sync - 1:>+6.0%}"
        print(
            f"{r.workload:<20} {r.mode:<15} {r.env_steps_per_s:>11.1f} {r.vs_sync:>7.2f} "
            f"{spread:>11} {r.of_bound:>8.0%} {est}"
        )
    for name, m in meta.items():
        if "auto_pick" in m:
            print(f"{name}: placement=auto picks {m['auto_pick']}")
    names = [*PARTS, "rest"]
    print(f"\nwhere a rollout's seconds go ({', '.join(names[1:])}: see PARTS)")
    print(f"{'workload':<20} {'mode':<15}" + "".join(f" {n:>9}" for n in names))
    for r in results:
        if r.breakdown is not None:
            print(
                f"{r.workload:<20} {r.mode:<15}"
                + "".join(f" {r.breakdown[n]:>9.3f}" for n in names)
            )
    print(
        "\nCPU seconds per iteration (a mode's rollout, update and weight sync; the loop's "
        "rollout): the simulator processes, the run (this process and the Ray workers) and "
        "Ray's daemons; and the GiB a mode's workers held together at the most"
    )
    print(
        f"{'workload':<20} {'mode':<15}"
        + "".join(f" {n:>10}" for n in (*CPU_CLASSES, "all", "held GiB"))
    )
    for r in results:
        if r.cpu is not None:
            counts = [r.cpu[k] for k in CPU_CLASSES]
            held = f" {r.memory_gib:>10.2f}" if r.memory_gib is not None else ""
            print(
                f"{r.workload:<20} {r.mode:<15}"
                + "".join(f" {c:>10.2f}" for c in (*counts, sum(counts)))
                + held
            )
    for name, m in meta.items():
        print(
            f"{name}: env chunk {m['env_chunk_s'] * 1e3:.1f} ms, inference "
            f"{m['infer_chunk_s'] * 1e3:.1f} ms per chunk, reset {m['env_reset_s'] * 1e3:.1f} ms "
            "per rollout (sync loop)"
        )
    for mode, why in skipped.items():
        print(f"{mode}: skipped ({why})")
    write()
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

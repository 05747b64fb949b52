"""``placement=auto``: measure the workload once, then pick the execution mode and stage count.

Profiling runs a few chunk steps of the env batch and of the policy's ``act``, and one
forward/backward pass over those samples, in a worker of its own on the cluster's first device
(as a rollout worker runs them: that device, its torch threads, ``algo.autocast``; the worker
exits before the run's workers start, so the driver never holds a model or a GPU context).
That gives these costs:

- ``e``: one chunk step of all ``B`` envs, seconds; ``r``: the reset of all of them that starts
  every rollout;
- ``i``: the policy's actions for all ``B`` observations, seconds; ``i_P``: one call on the
  ``B / P`` observations of a stage batch, timed for every ``P`` a plan cuts the env batch
  into (a small policy's call does not shrink in proportion to its batch: the tiny OpenVLA
  takes about 65 ms for 16 envs and 210 ms for 64 on one core); ``f``, the part of a call that
  does not shrink with its batch, read off ``i`` and the smallest stage batch's ``i_P``
  (``i_P = f + (i - f) / P`` where a batch was not timed); ``v``: the values of all ``B``
  observations, the bootstrap call that ends a rollout;
- ``u``: one update over an iteration's ``B * T`` samples (``update_epochs`` passes), seconds.
  When only the read-out trains and ``algo.cache_frozen_features`` is on, the actor computes
  the frozen features once per iteration (or takes those the rollout computed while acting)
  and runs the read-out in every pass, and ``u`` is measured the same way. With
  ``algo.fsdp`` the actor shards over several actor workers, and sharded it runs the whole
  pass in every epoch: ``u`` is then measured both ways, the cached update for plans with one
  actor device and the whole one for plans with several;
- ``o``: one chunk step's channel round trip between an env and a rollout worker, as a run
  makes it: one call from the env side to the profiling worker, which hosts the channel as a
  rollout worker does, carrying the observation there (through the object store where a run
  sends it that way) and the actions back;
- on a CPU cluster whose simulators run in subprocesses, the CPU seconds they use per chunk
  step (``c``).

The cost model of one iteration of ``T`` chunk steps on ``N`` devices, with the envs splitting
evenly over the workers of a component (``E`` env, ``R`` rollout, ``A`` actor devices). The env
batch is cut into ``P = E * S`` stage batches; a rollout worker serves ``n = ceil(P / R)`` of
them per chunk step, one call each, so it is busy ``b = n * i_P`` per chunk step (``i / R``
when calls cost in proportion to their batch). ``a`` is a chunk step of the env batch on ``E``
devices: ``e / E`` where the env computes in its worker, ``e`` where its simulators run in
subprocesses (they step in parallel already, on the node's cores, however many env workers
drive them); ``r_E`` likewise. Every rollout is ``r_E + T * step + tail + v / R``:

- collocated (everything on all ``N``, ``E = R = N``): with ``S = 1`` env and inference take
  turns, ``step = a + b + o``; with ``S >= 2`` stages each device's env worker steps stage
  ``s`` while its rollout worker computes stage ``s - 1``, as in hybrid:
  ``step = max(a, b) + S * o`` and ``tail = min(a, b) / S``
- disaggregated (disjoint ``E + R + A = N``; env and inference alternate):
  ``step = a + b + o``
- local with ``S`` stages (every component in one process on device 0, no Ray workers and no
  channel hops; stage ``s`` simulates, in its subprocesses or while sleeping, as the process
  computes stage ``s - 1``'s actions): ``step = e + i`` with
  ``S = 1`` (the plain loop), else ``step = max(e, b)`` and ``tail = min(e, b) / S`` with ``b``
  the busy time of one rollout worker serving ``S`` batches;
- hybrid with ``S`` stages (disjoint ``E + R = N``; env stage ``s`` steps while the rollout
  computes stage ``s - 1``, so the two overlap after the pipeline fills; actor on ``A`` of the
  ``N`` devices, all of them when the ``E * S`` trajectories share evenly, else the most that
  do): ``step = max(a, b) + S * o`` and ``tail = min(a, b) / S``; with ``S = 1`` there is no
  overlap: ``step = a + b + o``.

On a CPU cluster with subprocess simulators, the simulators and CPU inference share the
node's ``C`` cores, so no chunk step is shorter than ``(c + R * b * threads) / C``: the
overlap a plan promises is only there where the cores have room for it. There two more
costs are measured rather than modelled: the chunk step of ``P`` stages stepped in one
process as ``placement=local`` steps them (``staged_step_s``: threads, shared cores and a
pipeline that empties make it longer than ``max(e, b)``; a stage plan's overlapped step is
``max(a, b)`` times that measured step over its own ``max(e, b)``), and ``R`` calls on
``B / R`` envs made at once by ``R`` workers of the node's first devices, each a process of
its own as a rollout worker is (``infer_parallel_s``; each rollout worker's busy time is
scaled by what they took over one such call alone).
The update adds ``u / A``.

What a call costs whatever its batch is what makes many small stages lose: each stage is a
call of its own.

Stages overlap an env's step with inference where the env does not compute on the device the
policy uses: simulators in subprocesses (their share of a CPU node's cores is bounded above)
or an env that waits. A GPU simulator stepping on the policy's GPU shares it, which the model
does not see: its stage plans are optimistic.

Only plans whose env batches split into whole GRPO groups are considered. The plan with the
lowest estimate wins; within 2 % of it the simpler one (one process, then collocated, hybrid,
disaggregated; then fewer stages); the table of estimates is printed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.runtime.threads import torch_threads
from rlinf_vla.runtime.worker import Worker

CHANNEL_ROUND_TRIP_S = 0.002  # measured small-message channel round trip (docs/runtime.md)


@dataclass(frozen=True)
class Costs:
    """Measured costs on one device, seconds (see the module docstring)."""

    env_chunk_s: float
    infer_chunk_s: float
    train_s: float
    overhead_s: float = CHANNEL_ROUND_TRIP_S
    infer_fixed_s: float = 0.0  # of ``infer_chunk_s``, paid by every call whatever its batch
    #: Measured seconds of one call on a stage batch, ``((P, seconds), ...)`` for a batch of
    #: ``B / P`` envs; a ``P`` not listed costs ``f + (i - f) / P``.
    infer_call_s: tuple[tuple[int, float], ...] = ()
    #: The update as a sharded (FSDP) actor runs it, on one device, where it differs from
    #: ``train_s`` (the whole pass in every epoch, no feature cache); used for the plans with
    #: several actor devices. ``None``: the same as ``train_s``.
    train_sharded_s: float | None = None
    #: The reset of all ``B`` envs that starts every rollout.
    reset_s: float = 0.0
    #: The policy's values of all ``B`` observations: the bootstrap call that ends a rollout.
    value_s: float = 0.0
    #: The simulators run in subprocesses (:attr:`VectorEnv.workers`): they step at the same
    #: time whatever the env worker, so on one node more env devices do not shorten a chunk
    #: step (``e`` and ``r`` stay), and they share the node's CPU cores with everything else.
    subprocess_env: bool = False
    #: CPU seconds the simulator processes spent per chunk step of all ``B`` envs (``None``:
    #: not measured), and the node's cores they share with CPU inference (``None``: the policy
    #: computes on a GPU, or not measured): together they bound a chunk step from below.
    env_cpu_s: float | None = None
    cores: int | None = None
    #: Torch threads of the profiled device (CPU): the cores one inference call keeps busy.
    threads: int = 1
    #: Measured seconds of one chunk step of all ``B`` envs cut into ``P`` stages in one
    #: process, stage ``s`` simulating while the policy computes another stage's actions,
    #: ``((P, seconds), ...)`` (a CPU node; empty: not measured).
    staged_step_s: tuple[tuple[int, float], ...] = ()
    #: Measured seconds of ``R`` calls made at once, each on ``B / R`` envs, as ``R`` rollout
    #: workers of one node make them, ``((R, seconds), ...)`` (a CPU node; empty: not measured).
    infer_parallel_s: tuple[tuple[int, float], ...] = ()

    def update_s(self, actors: int) -> float:
        """Seconds of one iteration's update on ``actors`` actor devices."""
        u = self.train_s if actors == 1 or self.train_sharded_s is None else self.train_sharded_s
        return u / actors

    def call_s(self, batches: int) -> float:
        """Seconds of one call on a stage batch when the env batch is cut into ``batches``:
        as measured, else ``f + (i - f) / batches``."""
        measured = dict(self.infer_call_s)
        if batches in measured:
            return measured[batches]
        f = min(self.infer_fixed_s, self.infer_chunk_s)
        return f + (self.infer_chunk_s - f) / batches

    def rollout_busy_s(self, batches: int, workers: int) -> float:
        """Seconds a rollout worker computes per chunk step when the env batch is cut into
        ``batches`` stage batches shared by ``workers`` rollout workers (module docstring).
        Where calls made at once by ``workers`` workers were timed, each call is slowed by
        what they cost over one such call alone (the workers share a node's cores)."""
        busy = -(-batches // workers) * self.call_s(batches)
        together = dict(self.infer_parallel_s).get(workers)
        if together is not None and workers > 1:
            busy *= max(1.0, together / self.call_s(workers))
        return busy

    def overlap_s(self, batches: int, a: float, b: float) -> float:
        """A chunk step when env work ``a`` and inference ``b`` overlap over ``batches``
        stage batches: ``max(a, b)``, times what the measured staged step of that many
        batches in one process (:attr:`staged_step_s`) took over its own ``max(e, b)``
        (threads, a shared node's cores, a pipeline that does not stay full)."""
        measured = dict(self.staged_step_s).get(batches)
        if measured is None:
            return max(a, b)
        ideal = max(self.env_chunk_s, batches * self.call_s(batches))
        return max(a, b) * max(1.0, measured / ideal) if ideal > 0 else max(a, b, measured)

    def env_s(self, env_devices: int) -> tuple[float, float]:
        """``(e, r)``: a chunk step and a reset of all ``B`` envs spread over ``env_devices``
        env devices: shared evenly where the env computes in its worker, unchanged where its
        simulators run in subprocesses (they already step in parallel, on the node's cores)."""
        if self.subprocess_env:
            return self.env_chunk_s, self.reset_s
        return self.env_chunk_s / env_devices, self.reset_s / env_devices

    def cpu_bound_s(self, inference_cpu_s: float) -> float:
        """The shortest a chunk step can be when the simulators' processes and
        ``inference_cpu_s`` CPU seconds of inference share the node's cores (0: not bound)."""
        if self.cores is None or self.env_cpu_s is None:
            return 0.0
        return (self.env_cpu_s + inference_cpu_s) / self.cores


@dataclass(frozen=True)
class Plan:
    """One candidate placement and its estimated iteration time."""

    mode: str
    components: dict[str, str]
    stages: int
    rollout_s: float
    train_s: float

    @property
    def iteration_s(self) -> float:
        return self.rollout_s + self.train_s

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in self.components.items())
        return f"{self.mode:<13} S={self.stages}  ({parts})"


def _span(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def candidate_plans(
    costs: Costs,
    num_devices: int,
    num_groups: int,
    chunks: int,
    max_stages: int = 4,
) -> list[Plan]:
    """Every placement that fits ``num_devices`` and splits ``num_groups`` env groups evenly,
    with its estimated rollout and train time for ``chunks`` chunk steps."""
    n = num_devices
    plans = _collocated_plans(costs, n, num_groups, chunks, max_stages)
    plans += _local_plans(costs, num_groups, chunks, max_stages)
    for env_devices in range(1, n):
        plans += _split_plans(costs, n, env_devices, num_groups, chunks, max_stages)
    return plans


def _rollout_s(
    costs: Costs,
    chunks: int,
    reset: float,
    step: float,
    tail: float,
    inference_cpu: float,
    value: float,
) -> float:
    """A rollout: its reset, ``chunks`` chunk steps (no shorter than the CPU bound of
    ``inference_cpu`` seconds of inference per chunk step, one thread each), the pipeline's
    tail and the bootstrap values."""
    cpu = costs.cpu_bound_s(inference_cpu * costs.threads)
    return reset + chunks * max(step, cpu) + tail + value


def _stage_counts(max_stages: int) -> list[int]:
    """The stage counts a plan may have: 1, 2, 4, ... up to ``max_stages``."""
    return [1 << k for k in range(max_stages.bit_length())]


def stage_batches(num_devices: int, num_groups: int, max_stages: int) -> tuple[int, ...]:
    """Every ``P >= 2`` that a plan may cut the env batch into (``E * S`` stage batches on
    ``E`` env devices, whole groups each): the batches :func:`profile` times a call on."""
    return tuple(
        sorted(
            {
                e * s
                for e in range(1, num_devices + 1)
                for s in _stage_counts(max_stages)
                if e * s > 1 and num_groups % (e * s) == 0
            }
        )
    )


def _channel_step(
    costs: Costs, a: float, b: float, o: float, stages: int, batches: int
) -> tuple[float, float]:
    """``(step, tail)`` of env workers (``a`` a chunk step) and rollout workers (busy ``b``)
    that meet over the channel: taking turns with one stage, overlapped after the pipeline
    fills with several, the env batch cut into ``batches`` (module docstring)."""
    if stages == 1:
        return a + b + o, 0.0
    return costs.overlap_s(batches, a, b) + stages * o, min(a, b) / stages


def _collocated_plans(
    costs: Costs, n: int, num_groups: int, chunks: int, max_stages: int
) -> list[Plan]:
    """``placement=collocated`` with 1, 2, 4, ... stages: an env and a rollout worker on each
    of the ``n`` devices. With ``S >= 2`` a device's env stage ``s`` steps while its rollout
    worker computes stage ``s - 1``, as in hybrid."""
    o = costs.overhead_s
    a, r = costs.env_s(n)
    plans = []
    for stages in _stage_counts(max_stages):
        parts = n * stages
        if num_groups % parts == 0:
            b = costs.rollout_busy_s(parts, n)
            step, tail = _channel_step(costs, a, b, o, stages, parts)
            plans.append(
                Plan(
                    "collocated",
                    {"actor": "all", "env": "all", "rollout": "all"},
                    stages,
                    _rollout_s(costs, chunks, r, step, tail, n * b, costs.value_s / n),
                    costs.update_s(n),
                )
            )
    return plans


def _local_plans(costs: Costs, num_groups: int, chunks: int, max_stages: int) -> list[Plan]:
    """``placement=local`` with 1, 2, 4, ... stages: one process, no channel hops; stage ``s``
    simulates while stage ``s - 1`` infers."""
    e, r = costs.env_s(1)
    plans = []
    for stages in _stage_counts(max_stages):
        if num_groups % stages == 0:
            b = costs.rollout_busy_s(stages, 1)
            if stages == 1:
                step, tail = e + costs.infer_chunk_s, 0.0
            else:
                step, tail = costs.overlap_s(stages, e, b), min(e, b) / stages
            plans.append(
                Plan(
                    "local",
                    {"actor": "0", "env": "0", "rollout": "0"},
                    stages,
                    _rollout_s(costs, chunks, r, step, tail, b, costs.value_s),
                    costs.update_s(1),
                )
            )
    return plans


def _split_plans(
    costs: Costs, n: int, env_devices: int, num_groups: int, chunks: int, max_stages: int
) -> list[Plan]:
    """The plans with the envs on the first ``env_devices`` of ``n`` devices: hybrid (the
    actor shares the rollout's devices) with 1, 2, 4, ... stages, and disaggregated (the
    actor on devices of its own)."""
    o = costs.overhead_s
    rollout_devices = n - env_devices
    a, r = costs.env_s(env_devices)
    value = costs.value_s / rollout_devices
    plans = []
    for stages in _stage_counts(max_stages):
        parts = env_devices * stages  # trajectories per iteration
        b = costs.rollout_busy_s(parts, rollout_devices)
        if num_groups % parts == 0:
            # the actor takes as many devices as share the trajectories evenly
            actors = max(d for d in range(1, n + 1) if parts % d == 0)
            step, tail = _channel_step(costs, a, b, o, stages, parts)
            components = {
                "actor": "all" if actors == n else _span(0, actors),
                "env": _span(0, env_devices),
                "rollout": _span(env_devices, rollout_devices),
            }
            plans.append(
                Plan(
                    "hybrid",
                    components,
                    stages,
                    _rollout_s(costs, chunks, r, step, tail, rollout_devices * b, value),
                    costs.update_s(actors),
                )
            )
    for actor_devices in range(1, rollout_devices):
        rd = rollout_devices - actor_devices
        if num_groups % env_devices or env_devices % actor_devices:
            continue
        b = costs.rollout_busy_s(env_devices, rd)
        plans.append(
            Plan(
                "disaggregated",
                {
                    "actor": _span(env_devices + rd, actor_devices),
                    "env": _span(0, env_devices),
                    "rollout": _span(env_devices, rd),
                },
                1,
                _rollout_s(costs, chunks, r, a + b + o, 0.0, rd * b, costs.value_s / rd),
                costs.update_s(actor_devices),
            )
        )
    return plans


#: Within 2 % of the fastest estimate the simplest plan wins: one process (no Ray workers and
#: no hops, which the estimates leave out), then the fewest kinds of worker placement.
_SIMPLICITY = {"local": 0, "collocated": 1, "hybrid": 2, "disaggregated": 3}


def choose(plans: list[Plan]) -> Plan:
    """The fastest plan; within 2 % of it, the simplest (one process first, then collocated,
    hybrid, disaggregated; fewer stages)."""
    if not plans:
        raise ConfigError(
            "placement=auto: no placement splits the env batch into whole groups on these "
            "devices; change env.num_envs or cluster.devices_per_node"
        )
    best = min(p.iteration_s for p in plans)
    close = [p for p in plans if p.iteration_s <= best * 1.02]
    return min(close, key=lambda p: (_SIMPLICITY[p.mode], p.stages, p.iteration_s))


def profile(
    job: Any,
    chunks: int = 3,
    sharded: bool = False,
    threads: int | None = 1,
    device: torch.device | None = None,
    cores: int | None = None,
    keep: dict[str, Any] | None = None,
    batches: tuple[int, ...] = (2,),
    staged: tuple[int, ...] = (),
) -> Costs:
    """Measure ``e``, ``i``, ``i_P``, ``u``, ``r``, ``v`` (module docstring) in this process on
    one device.

    ``sharded``: plans may shard the actor with FSDP (``algo.fsdp`` on several devices), which
    always runs the whole ``evaluate`` (no feature cache); the update is then also profiled
    that way, as ``Costs.train_sharded_s``.
    ``threads``: the torch threads to measure with on CPU (a worker's ``Device.threads``);
    ``None`` keeps this process's setting.
    ``device``: where the policy and a ManiSkill ``sim_backend=auto`` go (default: the
    policy's own default); forward passes there run under ``algo.autocast``.
    ``cores``: the node's cores that CPU inference and the simulators' processes share (a CPU
    cluster); with simulators in subprocesses their CPU time is measured as well.
    ``keep``: a dict that receives the profiled observation message and actions (``obs``,
    ``actions``), for a channel round trip timed with them (:func:`_round_trip_s`); ``o``
    keeps its default here.
    ``batches``: the ``P`` of the stage batches (``B / P`` envs) to time a call on
    (:func:`stage_batches`); one that does not divide ``B`` is left out.
    ``staged``: the ``P`` to time a staged chunk step on (``Costs.staged_step_s``: ``P``
    stage envs of ``B / P`` envs each, stepped as ``placement=local`` steps them while one
    thread computes their actions in turn), after the whole batch's env is closed.
    A ``P`` that does not split the env batch into whole groups is left out.
    """
    from rlinf_vla.envs import for_device, make_env
    from rlinf_vla.policies import make_policy
    from rlinf_vla.training.precision import autocast

    placed = {} if device is None else {"device": str(device)}
    policy = make_policy(job.policy_name, job.policy_config, seed=job.runner.seed, **placed)
    env = make_env(job.env_name, for_device(job.env_config, policy.device))
    cuda = policy.device.type == "cuda"

    def precision() -> Any:
        return autocast(policy.device, job.algo.autocast)

    def clock() -> float:
        # CUDA kernels run asynchronously: a time is taken once the device is done
        if cuda:
            torch.cuda.synchronize(policy.device)
        return time.perf_counter()

    with torch_threads(None if cuda else threads), closing(env):
        cache = job.algo.cache_frozen_features
        act = _rollout_call(policy, cache, precision)
        obs = env.reset()
        for _ in range(2):  # the first calls pay one-off kernel and allocator set-up
            out, shipped = act(obs)
            obs = env.chunk_step(out.actions).obs
        # Both paths when a sharded actor would differ from a single one.
        paths = (cache, False) if sharded and cache else (cache,)
        for path in paths:
            _update_cost(policy, obs, out.replay, path, shipped, precision, clock)
        timing = _time_rollout(env, act, clock, chunks, batches, cpu=cores is not None)
        subprocess_env = env.workers is not None
        t0 = clock()
        with torch.no_grad(), precision():
            policy.value(timing.obs)  # the bootstrap call that ends a rollout
        value_s = clock() - t0
        updates = [
            _update_cost(
                policy, timing.last_obs, timing.out.replay, path, timing.shipped, precision, clock
            )
            for path in paths
        ]
        if keep is not None:
            from rlinf_vla.pipelines.rollout import EnvMessage

            keep.update(obs=EnvMessage(obs=timing.obs), actions=timing.out.actions.cpu())
        groups = env.num_envs // job.env_config.group_size
    staged_s = {}
    with torch_threads(None if cuda else threads):
        # one stage split at a time, after the whole batch's env closed: its simulators'
        # processes and memory are gone
        for p in staged:
            if p >= 2 and groups % p == 0:
                staged_s[p] = _time_stages(job, policy.device, p, act, clock, chunks)
    # the update was timed on one chunk step of all B envs; an iteration has T of them
    update_s = [
        (once_s + pass_s * job.algo.update_epochs) * job.runner.rollout_chunks
        for once_s, pass_s in updates
    ]
    i = timing.infer_s / chunks
    calls = tuple((p, seconds / chunks) for p, seconds in sorted(timing.stage_s.items()))
    # f through the whole batch and the smallest stage batch, which the plans it matters to use
    fixed = _fixed(i, calls[-1][1], 1 / calls[-1][0]) if calls else 0.0
    return Costs(
        timing.env_s / chunks,
        i,
        update_s[0],
        infer_fixed_s=fixed,
        infer_call_s=calls,
        train_sharded_s=update_s[1] if len(update_s) > 1 else None,
        reset_s=timing.reset_s,
        value_s=value_s,
        subprocess_env=subprocess_env,
        env_cpu_s=None if timing.env_cpu_s is None else timing.env_cpu_s / chunks,
        cores=cores if not cuda else None,
        threads=(threads or torch.get_num_threads()) if not cuda else 1,
        staged_step_s=tuple(sorted(staged_s.items())),
    )


def _time_stages(
    job: Any, device: torch.device, stages: int, act: Any, clock: Any, chunks: int
) -> float:
    """Seconds of one chunk step of all ``B`` envs cut into ``stages`` stage envs, as
    ``placement=local`` runs them: each stage's simulators step in a thread of their own
    (where they run in subprocesses; else the stages step in turn in one thread) while one
    thread computes the stages' actions in the order they are asked for. Two untimed rounds
    fill the pipeline and pay the new envs' first steps (as the whole batch's two untimed
    chunk steps do), then ``chunks`` rounds are timed."""
    from concurrent.futures import ThreadPoolExecutor

    from rlinf_vla.envs import for_device, make_stage_envs

    envs = make_stage_envs(job.env_name, stages, for_device(job.env_config, device))
    infer = ThreadPoolExecutor(1, thread_name_prefix="profile-infer")
    stepping = ThreadPoolExecutor(stages, thread_name_prefix="profile-stage")
    try:
        obs = [env.reset() for env in envs]
        concurrent = all(env.workers is not None for env in envs)

        def stage(s: int, rounds: int) -> None:
            for _ in range(rounds):
                out, _ = infer.submit(act, obs[s]).result()
                obs[s] = envs[s].chunk_step(out.actions).obs

        def in_turn(rounds: int) -> None:
            pending = [infer.submit(act, o) for o in obs]
            for k in range(rounds):
                for s, env in enumerate(envs):
                    out, _ = pending[s].result()
                    obs[s] = env.chunk_step(out.actions).obs
                    if k < rounds - 1:
                        pending[s] = infer.submit(act, obs[s])

        def rounds(n: int) -> None:
            if not concurrent:
                return in_turn(n)
            for future in [stepping.submit(stage, s, n) for s in range(stages)]:
                future.result()

        rounds(2)
        t0 = clock()
        rounds(chunks)
        return (clock() - t0) / chunks
    finally:
        infer.shutdown()
        stepping.shutdown()
        for env in envs:
            env.close()


def _rollout_call(policy: Any, cache: bool, precision: Callable[[], Any]) -> Callable[[Any], Any]:
    """What a rollout worker runs on an observation: the actions, and the frozen features an
    actor caches when ``cache`` (else ``None``)."""

    def act(obs: Any) -> tuple[Any, torch.Tensor | None]:
        with torch.no_grad(), precision():
            if cache:
                return policy.act_with_features(obs)
            return policy.act(obs), None

    return act


@dataclass
class _Timing:
    """What :func:`_time_rollout` measured (seconds over all its chunk steps)."""

    reset_s: float
    env_s: float
    infer_s: float
    stage_s: dict[int, float]  # P -> the same inference calls on the first B / P envs
    env_cpu_s: float | None  # the simulator processes' CPU time
    obs: Any  # the last observation
    last_obs: Any  # the one before it, which the last actions were chosen from
    out: Any  # the last call's ActOutput
    shipped: torch.Tensor | None  # and its frozen features


def _time_rollout(
    env: Any, act: Any, clock: Any, chunks: int, batches: tuple[int, ...], cpu: bool
) -> _Timing:
    """Time a rollout's reset and ``chunks`` chunk steps of ``env`` and ``act`` one after the
    other, then the same inference calls on the first ``B / P`` envs for each ``P`` of
    ``batches`` that divides ``B``; ``cpu``: also the CPU time of the simulators' processes."""
    t0 = clock()
    obs = env.reset()  # every rollout starts with one
    reset_s = clock() - t0
    pool = env.workers
    cpu0 = pool.cpu_seconds() if pool is not None and cpu else None
    env_s = infer_s = 0.0
    seen = []
    last_obs = obs
    for _ in range(chunks):
        t0 = clock()
        out, shipped = act(obs)
        t1 = clock()
        next_obs = env.chunk_step(out.actions).obs
        t2 = clock()
        infer_s += t1 - t0
        env_s += t2 - t1
        seen.append(obs)
        last_obs, obs = obs, next_obs
    env_cpu = pool.cpu_seconds() - cpu0 if cpu0 is not None else None
    stage_s = {}
    for p in batches:  # after the steps: the simulators' CPU time is theirs alone
        if p < 2 or env.num_envs % p:
            continue
        part = torch.arange(env.num_envs // p)
        stage_s[p] = 0.0
        for o in seen:
            t0 = clock()
            act(o.select(part))
            stage_s[p] += clock() - t0
    return _Timing(
        reset_s,
        env_s,
        infer_s,
        stage_s,
        env_cpu,
        obs,
        last_obs,
        out,
        shipped,
    )


def _fixed(i: float, i_part: float, share: float) -> float:
    """``f``, the part of a call's cost that does not shrink with its batch, from ``i`` on
    the whole batch and ``i_part`` on its ``share``: ``i(b) = f + (i - f) b / B`` through the
    two measurements."""
    fixed = (i_part - share * i) / (1 - share) if share < 1 else 0.0
    return min(max(fixed, 0.0), i)


def _round_trip_s(profiler: Any, reps: int = 3) -> float:
    """Seconds of one chunk step's channel round trip as a run makes it, the median of
    ``reps``: this process plays the env worker, whose ``exchange`` carries the profiled
    observation to ``profiler`` (a ``WorkerGroup(..., channels=True)`` of :class:`Profiler`
    that has run ``costs``), which hosts the channel as the first rollout worker does and
    answers with the profiled actions."""
    import uuid

    from rlinf_vla.runtime.channel import Channel

    channel = Channel.create(f"auto-profile-{uuid.uuid4().hex[:8]}", host=profiler.actor(0))
    message = profiler.sample().wait()[0]
    answering = profiler.answer(channel, reps + 1)
    times = []
    try:
        for _ in range(reps + 1):  # the first pays the channel's start
            t0 = time.perf_counter()
            channel.exchange("obs", message, "act", timeout=_ANSWER_TIMEOUT_S)
            times.append(time.perf_counter() - t0)
    finally:
        answered = answering.wait()[0]
        channel.close()
    if answered != reps + 1:
        raise RuntimeError(f"the profiler answered {answered} of {reps + 1} round trips")
    return sorted(times[1:])[len(times[1:]) // 2]


#: How long either side of the profiled round trip waits for the other.
_ANSWER_TIMEOUT_S = 120.0


class Profiler(Worker):
    """Runs :func:`profile` on its device, with that device's threads, as a rollout worker
    would; started for the measurement and shut down after it."""

    #: the observation message and actions of the profiled chunk step (set by ``costs``)
    _sample: dict[str, Any] | None = None
    #: the call and the observations of :meth:`calls_at` (set by ``prepare_calls``)
    _calls: tuple[Any, Any] | None = None

    def costs(
        self,
        job: Any,
        chunks: int,
        sharded: bool,
        cores: int | None = None,
        batches: tuple[int, ...] = (2,),
    ) -> Costs:
        """:func:`profile` on this worker's device; on a CPU node (``cores``) also the staged
        chunk step of each of ``batches``."""
        import gc

        from rlinf_vla.runtime.offload import release_cuda_memory

        self._sample = {}
        cores = cores if self.device_info.kind == "cpu" else None
        costs = profile(
            job,
            chunks,
            sharded=sharded,
            threads=None,
            device=self.device,
            cores=cores,
            keep=self._sample,
            batches=batches,
            staged=batches if cores is not None else (),
        )
        gc.collect()
        # The model and env are gone; their cached GPU memory goes back to the driver now,
        # not when the process exits (it is killed asynchronously, as the run's workers start
        # on the same GPU).
        release_cuda_memory()
        return costs

    def sample(self) -> Any:
        """The observation message of the profiled chunk step (after :meth:`costs`)."""
        assert self._sample is not None, "sample() needs costs() first"
        return self._sample["obs"]

    def prepare_calls(self, job: Any, message: Any) -> int:
        """Build the policy on this worker's device, as a rollout worker does, and make one
        untimed call on this worker's share of the observations of ``message`` (the
        profiled chunk step's, :meth:`sample`): ``B / world_size`` envs, by rank. Returns
        how many."""
        from rlinf_vla.policies import make_policy
        from rlinf_vla.training.precision import autocast

        policy = make_policy(
            job.policy_name, job.policy_config, seed=job.runner.seed, device=str(self.device)
        )
        obs = message.obs
        size = obs.batch_size // self.world_size
        share = obs.select(torch.arange(self.rank * size, (self.rank + 1) * size))
        act = _rollout_call(
            policy,
            job.algo.cache_frozen_features,
            lambda: autocast(policy.device, job.algo.autocast),
        )
        act(share)  # one-off set-up
        self._calls = (act, share)
        return size

    def calls_at(self, start: float, reps: int) -> tuple[float, float, float]:
        """Wait until the wall-clock time ``start`` (``time.time()``), then make ``reps``
        calls on this worker's share (:meth:`prepare_calls`): ``(median seconds, first
        start, last end)``, the two ends in wall-clock time."""
        act, share = self._calls
        time.sleep(max(0.0, start - time.time()))
        first = time.time()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            act(share)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2], first, time.time()

    def answer(self, channel: Any, n: int) -> int:
        """Answer ``n`` observations on ``channel`` (hosted here) as a rollout worker does:
        take each one put under ``obs`` and put the profiled actions under ``act``. Returns how
        many were answered before one did not come within the timeout."""
        assert self._sample is not None, "answer() needs the sample of costs()"
        for k in range(n):
            try:
                channel.get("obs", timeout=_ANSWER_TIMEOUT_S)
            except TimeoutError:
                return k
            channel.put("act", self._sample["actions"])
        return n


def _update_cost(
    policy: Any,
    obs: Any,
    replay: dict[str, torch.Tensor],
    cache: bool,
    shipped: torch.Tensor | None = None,
    precision: Callable[[], Any] = contextlib.nullcontext,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Seconds of the update's parts over ``obs``: ``(once, per_pass)``. ``per_pass`` is one
    forward/backward pass of the PPO objective's parts; ``once`` the frozen features computed
    before the passes when ``cache`` is on and the policy can split off its read-out (else 0,
    and each pass runs the whole ``evaluate``), 0 as well when acting computed them
    (``shipped``, what the rollout sends the actor). Forward passes run in ``precision()``;
    ``clock`` reads the time once the device is done."""
    once = 0.0
    features = None
    if cache and shipped is not None:
        features = shipped
    elif cache:
        t0 = clock()
        with torch.no_grad(), precision():
            features = policy.frozen_features(obs, replay)
        once = clock() - t0 if features is not None else 0.0
    t0 = clock()
    with precision():
        if features is None:
            out = policy.evaluate(obs, replay)
        else:
            out = policy.evaluate_features(features, replay)
        loss = out.logprob.float().mean() + out.entropy.float().mean()
        if out.value is not None:
            loss = loss + out.value.float().pow(2).mean()
    loss.backward()
    policy.zero_grad(set_to_none=True)
    return once, clock() - t0


def plan_table(plans: list[Plan], chosen: Plan, env_steps: int) -> str:
    """The estimates as a text table, the chosen plan marked."""
    lines = [f"{'placement':<50} {'rollout s':>9} {'train s':>8} {'env steps/s':>11}"]
    for p in sorted(plans, key=lambda p: p.iteration_s):
        mark = " <- chosen" if p is chosen else ""
        lines.append(
            f"{p.describe():<50} {p.rollout_s:>9.2f} {p.train_s:>8.2f} "
            f"{env_steps / p.rollout_s:>11.1f}{mark}"
        )
    return "\n".join(lines)


def _first_node_devices(cluster: Any) -> list[int]:
    """The cluster's devices on the node of its first device."""
    node = cluster.device(0).node_rank
    return [k for k in range(cluster.num_devices) if cluster.device(k).node_rank == node]


def node_cores(cluster: Any) -> int | None:
    """The cores of the first device's node that the cluster's CPU slots compute with (the
    simulators' processes share them), ``None`` on GPUs."""
    if cluster.device(0).kind != "cpu":
        return None
    return sum(cluster.device(k).threads or 1 for k in _first_node_devices(cluster))


def estimate(job: Any, cluster: Any) -> tuple[Costs, list[Plan], Plan]:
    """Profile the workload on the first device of ``cluster`` (a
    :class:`~rlinf_vla.runtime.Cluster`; module docstring) and weigh every plan that fits it:
    ``(costs, plans, chosen)``."""
    from rlinf_vla.runtime.worker import WorkerGroup

    env_cfg = job.env_config
    num_devices = cluster.num_devices
    num_groups = env_cfg.num_envs // env_cfg.group_size
    batches = stage_batches(num_devices, num_groups, job.placement.max_stages)
    profiler = WorkerGroup(cluster, Profiler, name="profile", devices=[0], channels=True)
    try:
        # The runner shards (algo.fsdp) only over several actor workers: on one device never;
        # on several, plans with one actor device keep the cache and the others do not.
        sharded = job.algo.fsdp and num_devices > 1
        costs = profiler.costs(
            job, job.placement.profile_chunks, sharded, node_cores(cluster), batches
        ).wait()[0]
        costs = replace(costs, overhead_s=_round_trip_s(profiler))
        message = profiler.sample().wait()[0]
    finally:
        profiler.shutdown()
    if costs.cores is not None:  # a CPU node: rollout workers there share its cores
        node = _first_node_devices(cluster)
        workers = [r for r in range(2, len(node) + 1) if num_groups % r == 0]
        together = _calls_at_once(job, cluster, message, node, workers)
        costs = replace(costs, infer_parallel_s=tuple(sorted(together.items())))
    plans = candidate_plans(
        costs,
        num_devices,
        num_groups,
        job.runner.rollout_chunks,
        job.placement.max_stages,
    )
    return costs, plans, choose(plans)


def _calls_at_once(
    job: Any, cluster: Any, message: Any, node: list[int], workers: list[int], reps: int = 5
) -> dict[int, float]:
    """``{R: seconds}``: ``R`` profiling workers on the first ``R`` devices of ``node`` (one
    node's devices), each with the policy on ``B / R`` of the observations of ``message``,
    call at the same time, as ``R`` rollout workers of one node do; the slowest worker's
    median of ``reps`` calls."""
    from rlinf_vla.runtime.worker import WorkerGroup

    out = {}
    for r in workers:
        group = WorkerGroup(cluster, Profiler, name=f"profile-calls-{r}", devices=node[:r])
        try:
            group.prepare_calls(job, message).wait()
            # a start far enough ahead that every worker has its call before it
            timed = group.calls_at(time.time() + 1.0, reps).wait()
        finally:
            group.shutdown()
        out[r] = max(median for median, _, _ in timed)
    return out


def describe_costs(costs: Costs, num_envs: int) -> str:
    """The measured costs in one line."""
    parts = [f"{costs.infer_fixed_s * 1e3:.1f} ms per call whatever its batch"]
    if costs.infer_call_s:
        calls = ", ".join(f"{num_envs // p}: {s * 1e3:.1f} ms" for p, s in costs.infer_call_s)
        parts.insert(0, f"a call on {calls}")
    line = (
        f"measured on one device: env chunk step {costs.env_chunk_s * 1e3:.1f} ms, "
        f"inference {costs.infer_chunk_s * 1e3:.1f} ms for {num_envs} envs "
        f"({'; '.join(parts)}), update {costs.train_s:.2f} s"
    )
    if costs.train_sharded_s is not None:
        line += f" ({costs.train_sharded_s:.2f} s as FSDP runs it, without the feature cache)"
    line += (
        f"; reset {costs.reset_s * 1e3:.0f} ms, bootstrap values {costs.value_s * 1e3:.1f} ms, "
        f"channel round trip {costs.overhead_s * 1e3:.1f} ms per rollout/chunk step"
    )
    if costs.staged_step_s:
        staged = ", ".join(f"{p} stages {t * 1e3:.1f} ms" for p, t in costs.staged_step_s)
        line += f"; a staged chunk step in one process: {staged}"
    if costs.infer_parallel_s:
        together = ", ".join(
            f"{r} x {num_envs // r} envs {t * 1e3:.1f} ms" for r, t in costs.infer_parallel_s
        )
        line += f"; calls at once: {together}"
    if costs.env_cpu_s is not None and costs.cores is not None:
        line += (
            f"; the simulators' processes use {costs.env_cpu_s * 1e3:.0f} ms of CPU per chunk "
            f"step of the node's {costs.cores} cores"
        )
    return line


def resolve_auto(job: Any, cluster: Any, log: Any = print) -> Any:
    """A copy of ``job`` whose ``placement`` is the plan chosen by profiling on the first
    device of ``cluster`` (a :class:`~rlinf_vla.runtime.Cluster`; module docstring)."""
    log(
        f"placement=auto: profiling {job.placement.profile_chunks} chunk steps and one update "
        f"on device {cluster.device(0)} ..."
    )
    costs, plans, chosen = estimate(job, cluster)
    env_cfg = job.env_config
    env_steps = env_cfg.num_envs * job.runner.rollout_chunks * job.policy_config.chunk_size
    log(describe_costs(costs, env_cfg.num_envs))
    log(plan_table(plans, chosen, env_steps))
    placement = replace(
        job.placement, mode=chosen.mode, components=dict(chosen.components), stages=chosen.stages
    )
    return replace(job, placement=placement)

"""Env and rollout workers: the two halves of the embodied rollout, talking over a channel.

Each env worker holds ``S`` pipeline stages (independent env batches). One rollout step of a
stage is a round trip over the channel::

    env worker                                   rollout worker
    put obs/{r}/{s}  (obs, rewards of last chunk) ──> get, policy.act(obs)
    get act/{r}/{s}  <──────────────────────────────  put actions
    env.chunk_step(actions)

With ``S >= 2`` the env worker steps stage ``s`` while the rollout worker computes the
actions of stage ``s - 1``: env and inference overlap when they live on different devices.
Simulators in subprocesses (LIBERO, MetaWorld, ManiSkill on the CPU) also overlap with each
other: each stage has its own processes and its own thread in the env worker.
With ``S = 1`` they alternate. The loop is the same; only ``S`` and the placement change.

A rollout of ``T`` chunk steps sends ``T + 1`` observations per stage: the last one only
bootstraps the value of the state the rollout stopped in. Every rollout starts with a reset
of its envs (fresh episodes from the envs' reset-id cursors); within it, envs whose episode
ends reset on their own (auto-reset).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from rlinf_vla.runtime import Channel, Worker, offload_module, resident
from rlinf_vla.runtime.rng import get_rng_state, set_rng_state
from rlinf_vla.training.precision import autocast
from rlinf_vla.types import Observation

if TYPE_CHECKING:
    from rlinf_vla.envs.base import EnvConfig
    from rlinf_vla.policies.base import PolicyConfig


class Routes(Protocol):
    """Which rollout worker serves an env stage (:class:`~rlinf_vla.pipelines.routing.Routing`)."""

    def rollout_of(self, source: tuple[int, int]) -> int: ...


def obs_key(env_rank: int, stage: int) -> str:
    return f"obs/{env_rank}/{stage}"


def act_key(env_rank: int, stage: int) -> str:
    return f"act/{env_rank}/{stage}"


def trajectory_key(actor_rank: int) -> str:
    return f"trajectory/{actor_rank}"


@dataclass
class EnvMessage:
    """What an env stage sends the rollout after each chunk (``b`` envs, ``K`` steps).

    The first message of a rollout carries only ``obs``.
    """

    obs: Observation
    reward: Tensor | None = None  # float32 [b, K]
    terminated: Tensor | None = None  # bool [b, K]
    truncated: Tensor | None = None  # bool [b, K]
    final_obs: Observation | None = None  # [b], for envs that ended in the chunk
    invalid: Tensor | None = None  # bool [b]
    expert: Tensor | None = None  # float32 [b, K, A]: the expert's labels (DAgger)


@dataclass
class Trajectory:
    """One env stage's rollout of ``T`` chunk steps, time-major.

    Attributes:
        obs: ``T`` observations (each ``[b]``) the actions were chosen from.
        replay: policy replay tensors, each ``[T, b, ...]``.
        actions: ``float32 [T, b, K, A]``.
        logprob: ``[T, b, ...]`` at the policy's log-prob granularity.
        value: ``float32 [T + 1, b]``: V of each observation, the last one for bootstrapping.
        final_value: ``float32 [T, b]``: V of the final observation of envs truncated at step
            ``t`` (0 elsewhere).
        reward, terminated, truncated: ``[T, b, K]``.
        invalid: ``bool [T, b]`` the episode that ended at ``t`` crashed (drop from metrics).
        source: ``(env_rank, stage)``.
        policy_version: the weights version that produced the actions.
        features: ``[T, b, ...]`` the policy's frozen features of the sampled actions, when
            the rollout worker was asked for them and the policy computed them while acting
            (``Policy.act_with_features``); else ``None``.
        expert: ``float32 [T, b, K, A]`` the scripted expert's action in the state of each
            step of each chunk (``obs[t]`` for step 0), when the env workers label them
            (``algo=dagger``); else ``None``.
    """

    obs: list[Observation]
    replay: dict[str, Tensor]
    actions: Tensor
    logprob: Tensor
    value: Tensor
    final_value: Tensor
    reward: Tensor
    terminated: Tensor
    truncated: Tensor
    invalid: Tensor
    source: tuple[int, int]
    policy_version: int = 0
    features: Tensor | None = None
    expert: Tensor | None = None

    @property
    def num_steps(self) -> int:
        return self.actions.shape[0]

    @property
    def num_envs(self) -> int:
        return self.actions.shape[1]


@dataclass
class _TrajectoryBuilder:
    source: tuple[int, int]
    obs: list[Observation] = field(default_factory=list)
    replay: list[dict[str, Tensor]] = field(default_factory=list)
    actions: list[Tensor] = field(default_factory=list)
    logprob: list[Tensor] = field(default_factory=list)
    value: list[Tensor] = field(default_factory=list)
    final_value: list[Tensor] = field(default_factory=list)
    reward: list[Tensor] = field(default_factory=list)
    terminated: list[Tensor] = field(default_factory=list)
    truncated: list[Tensor] = field(default_factory=list)
    invalid: list[Tensor] = field(default_factory=list)
    features: list[Tensor] = field(default_factory=list)
    expert: list[Tensor] = field(default_factory=list)

    def build(self, version: int) -> Trajectory:
        return Trajectory(
            obs=self.obs,
            replay={k: torch.stack([r[k] for r in self.replay]) for k in self.replay[0]},
            actions=torch.stack(self.actions),
            logprob=torch.stack(self.logprob),
            value=torch.stack(self.value),
            final_value=torch.stack(self.final_value),
            reward=torch.stack(self.reward),
            terminated=torch.stack(self.terminated),
            truncated=torch.stack(self.truncated),
            invalid=torch.stack(self.invalid),
            source=self.source,
            policy_version=version,
            features=torch.stack(self.features) if self.features else None,
            expert=torch.stack(self.expert) if self.expert else None,
        )


class EnvWorker(Worker):
    """Holds ``num_stages`` env batches; steps them with actions from the rollout workers.

    Args:
        env_name: a registered env (``rlinf_vla.envs.ENVS``).
        env_config: the env's typed config (its seed resolved, ``TrainJob.env_config``);
            ``num_envs`` is the total over all env workers, split evenly (whole GRPO groups)
            between workers and then between stages.
        num_stages: pipeline stages ``S`` per worker.
        expert: label every step's state with the env's scripted expert action and send the
            labels with each chunk's message (``algo=dagger``).
    """

    #: the lists :meth:`interact` returns: per episode (``return``, ``success``,
    #: ``first_success``, ``invalid``), per stage (``reset_s``, ``step_s``, ``wait_s``,
    #: ``wall_s``) and per worker (``send_s``, ``fetch_s``, and the same four parts on the
    #: worker's critical path: ``path_reset_s``... ``path_wall_s``)
    STATS = (
        "return",
        "success",
        "first_success",
        "invalid",
        "reset_s",
        "step_s",
        "wait_s",
        "wall_s",
        "send_s",
        "fetch_s",
        "path_reset_s",
        "path_step_s",
        "path_wait_s",
        "path_wall_s",
    )

    def __init__(
        self, env_name: str, env_config: EnvConfig, num_stages: int, expert: bool = False
    ) -> None:
        from rlinf_vla.envs import for_device, make_stage_envs, replace_config

        cfg = for_device(env_config, self.device)
        per_worker = cfg.num_envs // self.world_size
        if self.node_world_size > 1:
            # the env workers of a node simulate at the same time, on its cores: what their
            # envs share (ManiSkill's subprocess packing) is resolved for their envs together
            node_envs = per_worker * self.node_world_size
            cfg = replace_config(cfg, num_envs=node_envs).for_whole_batch()
        self.envs = make_stage_envs(
            env_name,
            num_stages,
            cfg,
            num_envs=per_worker,
            env_offset=cfg.env_offset + self.rank * per_worker,
        )
        self.expert = expert
        self.obs: list[Observation | None] = [None] * num_stages
        self.episode_return = [torch.zeros(env.num_envs) for env in self.envs]
        # envs still in the first episode of the rollout (set at each reset)
        self.in_first_episode = [torch.zeros(env.num_envs, dtype=torch.bool) for env in self.envs]

    def interact(
        self,
        channels: Channel | Sequence[Channel],
        num_chunks: int,
        routing: Routes | None = None,
    ) -> dict[str, list[float]]:
        """Run ``num_chunks`` chunk steps of every stage; returns finished episodes' stats
        (``return``, ``success``, ``invalid``: one entry per episode; ``first_success``: one
        entry per valid episode that was its env's first of the rollout), each stage's
        seconds in its reset (``reset_s``), in its chunk steps (``step_s``), in channel calls
        (``wait_s``: sending observations and waiting for actions) and in all (``wall_s``),
        and this worker's seconds serialising what it sent (``send_s``) and fetching the
        payloads it received from the object store (``fetch_s``), both inside ``wait_s``.
        ``path_*``: the reset, step, wait and wall seconds of the worker's critical path (the
        longest stage when stages step at the same time, every stage when they take turns).

        Stage ``s`` talks over ``channels[routing.rollout_of((rank, s))]``, the channel of
        the rollout worker that serves it (one channel alone: every stage's).

        Stages whose simulators run in subprocesses (:attr:`VectorEnv.workers`: LIBERO,
        MetaWorld, ManiSkill's CPU backend) step at the same time, one thread each: while one
        stage's processes simulate, the next stage's observation can go to the rollout.
        Otherwise (the toy env, ManiSkill on the GPU: they compute in this process) the
        stages take turns.
        """
        # Every rollout starts fresh episodes from the envs' reset-id cursors, so the state
        # of the envs between rollouts is just the cursors (see get_state / set_state).
        stages = range(len(self.envs))
        if isinstance(channels, Sequence):
            assert routing is not None, "several channels need the routing table"
            chans = [channels[routing.rollout_of((self.rank, s))] for s in stages]
        else:
            chans = [channels for _ in stages]
        used = list({id(c): c for c in chans}.values())
        stats: list[dict[str, list[float]]] = [{k: [] for k in self.STATS} for _ in stages]
        _take_timers(used)  # from here on
        concurrent = len(self.envs) > 1 and all(env.workers is not None for env in self.envs)
        if concurrent:
            pool = ThreadPoolExecutor(len(self.envs), thread_name_prefix="env-stage")
            futures = [
                pool.submit(self._run_stage, chans[s], num_chunks, s, stats[s]) for s in stages
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            # A failed stage ends the call at once; the others may be waiting for actions the
            # rollout will not send (their threads end with this worker).
            pool.shutdown(wait=False, cancel_futures=True)
            for f in futures:
                if f in done and f.exception() is not None:
                    raise f.exception()
        else:
            self._take_turns(chans, num_chunks, stats)
        timers = _take_timers(used)
        stats[0]["send_s"].append(timers["send_s"])
        stats[0]["fetch_s"].append(timers["fetch_s"])
        out = {
            k: [v for st in stats for v in st[k]] for k in self.STATS if not k.startswith("path_")
        }
        # this worker's critical path: the longest stage, or all of them when they took turns
        longest = max(stages, key=lambda s: stats[s]["wall_s"][0])
        path = [stats[longest]] if concurrent else stats
        for part in ("reset_s", "step_s", "wait_s"):
            out[f"path_{part}"] = [sum(st[part][0] for st in path)]
        out["path_wall_s"] = [stats[longest]["wall_s"][0]]
        return out

    def _run_stage(
        self, channel: Channel, num_chunks: int, s: int, stats: dict[str, list[float]]
    ) -> None:
        """Stage ``s`` alone: reset, then ``num_chunks`` request/response rounds."""
        start = time.perf_counter()
        self._reset(s, stats)
        pending = (obs_key(self.rank, s), EnvMessage(obs=self.obs[s]))
        for _ in range(num_chunks):
            actions = _timed(stats, channel.exchange, *pending, act_key(self.rank, s))
            pending = (obs_key(self.rank, s), self._step(s, actions, stats))
        _timed(stats, channel.put, *pending)
        stats["wall_s"].append(time.perf_counter() - start)

    def _take_turns(
        self, chans: list[Channel], num_chunks: int, stats: list[dict[str, list[float]]]
    ) -> None:
        """Every stage in turn. Each chunk step of a stage is a request/response: send the
        observation, receive the actions; the put of one stage and the get of the next go in
        one channel call where both stages use the same channel."""
        start = time.perf_counter()
        pending: tuple[str, EnvMessage] | None = None
        last = stats[-1]  # the stage whose message is pending when a channel call is made
        via = chans[-1]  # the channel of the pending message
        for s in range(len(self.envs)):
            self._reset(s, stats[s])
            if pending is not None:
                _timed(last, via.put, *pending)
            pending, last, via = (
                (obs_key(self.rank, s), EnvMessage(obs=self.obs[s])),
                stats[s],
                chans[s],
            )
        for _ in range(num_chunks):
            for s in range(len(self.envs)):
                if via is chans[s]:
                    actions = _timed(last, via.exchange, *pending, act_key(self.rank, s))
                else:
                    _timed(last, via.put, *pending)
                    actions = _timed(last, chans[s].get, act_key(self.rank, s))
                pending, last = (obs_key(self.rank, s), self._step(s, actions, stats[s])), stats[s]
                via = chans[s]
        _timed(last, via.put, *pending)
        wall = time.perf_counter() - start  # the stages share one clock: each reports it
        for st in stats:
            st["wall_s"].append(wall)

    def _reset(self, s: int, stats: dict[str, list[float]]) -> None:
        """Fresh episodes for stage ``s``; its seconds go to ``stats["reset_s"]``."""
        t0 = time.perf_counter()
        self.obs[s] = self.envs[s].reset()
        self.episode_return[s].zero_()
        self.in_first_episode[s].fill_(True)
        stats["reset_s"].append(time.perf_counter() - t0)
        stats["step_s"].append(0.0)
        stats["wait_s"].append(0.0)

    def _step(self, s: int, actions: Tensor, stats: dict[str, list[float]]) -> EnvMessage:
        """One chunk step of stage ``s``; the message for the rollout. Its seconds add to
        the stage's ``stats["step_s"]``."""
        t0 = time.perf_counter()
        result = self.envs[s].chunk_step(actions, expert=self.expert)
        stats["step_s"][-1] += time.perf_counter() - t0
        self.obs[s] = result.obs
        self._record(s, result, stats)
        return EnvMessage(
            obs=result.obs,
            reward=result.reward,
            terminated=result.terminated,
            truncated=result.truncated,
            final_obs=result.final_obs,
            invalid=result.info["invalid"],
            expert=result.info.get("expert_actions"),
        )

    def _record(self, stage: int, result: Any, stats: dict[str, list[float]]) -> None:
        """Accumulate returns; log the episodes that ended in this chunk (invalid ones apart),
        and apart the first episode of each env in the rollout."""
        ret = self.episode_return[stage]
        first = self.in_first_episode[stage]
        ret += result.reward.sum(dim=1)
        done = result.info["done"]
        for i in torch.nonzero(done).flatten().tolist():
            invalid = bool(result.info["invalid"][i])
            stats["invalid"].append(float(invalid))
            if not invalid:
                stats["return"].append(float(ret[i]))
                stats["success"].append(float(result.success[i]))
                if first[i]:
                    stats["first_success"].append(float(result.success[i]))
        ret[done] = 0.0
        first[done] = False

    def get_state(self) -> list[Tensor]:
        """The reset-id cursor of every stage (episodes started per env)."""
        return [env._episodes.clone() for env in self.envs]

    def set_state(self, state: list[Tensor]) -> None:
        for env, episodes in zip(self.envs, state, strict=True):
            env._episodes.copy_(episodes)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _take_timers(channels: list[Channel]) -> dict[str, float]:
    """The serialisation and fetch seconds of ``channels`` since their previous call, summed
    (:meth:`Channel.take_timers`); zeroes them."""
    out = {"send_s": 0.0, "fetch_s": 0.0}
    for channel in channels:
        for k, v in channel.take_timers().items():
            out[k] += v
    return out


def _timed(stats: dict[str, list[float]], call: Any, *args: Any) -> Any:
    """``call(*args)``, its seconds added to the stage's ``stats["wait_s"]``."""
    t0 = time.perf_counter()
    try:
        return call(*args)
    finally:
        stats["wait_s"][-1] += time.perf_counter() - t0


class RolloutWorker(Worker):
    """Runs the policy for the env stages assigned to it; sends trajectories to the actor.

    Args:
        policy_name: a registered policy (``rlinf_vla.policies.POLICIES``).
        policy_config: the policy's typed config as validation resolved it (with a
            checkpoint: the checkpoint's config, the command line's keys on top); the worker
            sets its ``device``.
        seed: seeds the action sampler (with the worker's rank).
        autocast: ``algo.autocast``.
        features: send the frozen features the policy computes while acting with each
            trajectory (``Policy.act_with_features``), for an actor that caches them
            (``algo.cache_frozen_features``); it then skips its own frozen pass.
    """

    def __init__(
        self,
        policy_name: str,
        policy_config: PolicyConfig,
        seed: int = 0,
        autocast: str = "off",
        features: bool = False,
        offload: bool = False,
    ) -> None:
        from rlinf_vla.policies import make_policy

        torch.manual_seed(seed + 7919 * (self.rank + 1))  # the action sampler's stream
        self.policy = make_policy(policy_name, policy_config, device=str(self.device)).eval()
        self.version = 0
        self._has_weights = False  # a first, complete weight sync arrived
        self.autocast = autocast  # algo.autocast: the same precision as the actor's update
        self.features = features
        self._eval_env: Any = None  # the greedy evaluation's env, made on first use
        # Collocated on a GPU: the policy waits in host memory while the actor trains.
        self.offload = offload and self.device.type == "cuda"
        if self.offload:
            offload_module(self.policy)

    def sync_from(self, collective_name: str, version: int) -> None:
        """Receive the actor's weights (broadcast from collective rank 0), wherever the policy
        is (an offloaded one takes them in host memory): all of them the first time, then the
        ones an update can change (``ActorWorker.sync_to``)."""
        state = self.collective(collective_name).broadcast_tensors(None, src=0)
        missing, unexpected = self.policy.load_state_dict(state, strict=False)
        if unexpected or (missing and not self._has_weights):
            raise RuntimeError(
                f"weight sync: the actor's weights do not fit the rollout policy "
                f"(unexpected: {sorted(unexpected)[:5]}, missing: {sorted(missing)[:5]})"
            )
        self._has_weights = True
        self.version = version

    def evaluate(
        self,
        env_name: str,
        env_config: EnvConfig,
        episodes: int,
        videos: bool,
        reset_ids: Tensor | None = None,
    ) -> tuple[dict[str, float], dict[str, bytes]]:
        """Greedy evaluation of the current weights (:func:`greedy_eval`) on the scenes
        ``reset_ids`` (``None``: the held-out ones).

        Runs where the policy already is (its device, ``algo.autocast``), on an env of its own
        made on the first call and kept. The sampler's random state is left as it was, so
        evaluating does not change the training that follows.

        Returns:
            The ``eval/*`` metrics, and the videos as file name -> MP4 bytes (the driver
            writes them into the run folder, which may be on another node).
        """
        from rlinf_vla.envs import for_device, make_env
        from rlinf_vla.pipelines.evaluation import greedy_eval

        if self._eval_env is None:
            self._eval_env = make_env(env_name, for_device(env_config, self.device))
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with tempfile.TemporaryDirectory() as tmp, torch.random.fork_rng(devices=cuda):
            with self._resident(), autocast(self.device, self.autocast):
                result = greedy_eval(
                    self.policy,
                    self._eval_env,
                    episodes,
                    reset_ids=reset_ids,
                    video_dir=tmp if videos else None,
                )
            files = {Path(v).name: Path(v).read_bytes() for v in result.videos}
        return result.metrics(), files

    def close(self) -> None:
        """Close the evaluation env (its simulator subprocesses), if one was made."""
        if self._eval_env is not None:
            self._eval_env.close()
            self._eval_env = None

    def rng_state(self) -> dict[str, Any]:
        """The action sampler's random state (CPU, and the GPU's when on one)."""
        return get_rng_state(self.device)

    def set_rng_state(self, state: dict[str, Any] | Tensor) -> None:
        set_rng_state(state, self.device)

    def _resident(self, times: dict[str, float] | None = None) -> Any:
        """The policy on the worker's device for the block (offloaded after it); the seconds
        of both copies add to ``times["copy_s"]``."""
        return resident(self.policy, self.device, enabled=self.offload, seconds=times)

    def generate(
        self,
        channel: Channel,
        num_chunks: int,
        sources: list[tuple[int, int]],
        destinations: list[str],
        greedy: bool = False,
        trajectories: Channel | None = None,
    ) -> dict[str, float]:
        """Serve ``sources`` (``(env_rank, stage)`` pairs) for ``num_chunks`` chunk steps,
        taking their observations from ``channel`` and answering there.

        Puts the :class:`Trajectory` of ``sources[i]`` on ``trajectories`` (default:
        ``channel``) under ``destinations[i]``. Returns where the call's seconds went:
        ``wall_s`` in all, ``copy_s`` moving an offloaded policy to the device and back,
        ``policy_s`` computing actions and values, ``wait_s`` in channel calls for the
        observations (sending the previous actions, waiting, receiving), ``finish_s``
        building and sending the trajectories after the last observation, and ``send_s`` /
        ``fetch_s`` serialising what it sent and fetching what it received (both inside
        ``wait_s`` and ``finish_s``); ``trajectories``: how many it sent.
        """
        start = time.perf_counter()
        out = channel if trajectories is None else trajectories
        used = [channel] if out is channel else [channel, out]
        _take_timers(used)
        times = dict.fromkeys(("copy_s", "policy_s", "wait_s", "finish_s"), 0.0)
        with self._resident(times), torch.no_grad():
            n = self._generate(channel, out, num_chunks, sources, destinations, greedy, times)
        return {
            **times,
            **_take_timers(used),
            "wall_s": time.perf_counter() - start,
            "trajectories": n,
        }

    def _generate(
        self,
        channel: Channel,
        trajectories: Channel,
        num_chunks: int,
        sources: list[tuple[int, int]],
        destinations: list[str],
        greedy: bool,
        times: dict[str, float],
    ) -> int:
        builders = {src: _TrajectoryBuilder(src) for src in sources}
        pending: tuple[str, Tensor] | None = None  # actions to send with the next get
        clock = time.perf_counter
        for t in range(num_chunks + 1):
            for src in sources:
                t0 = clock()
                if pending is None:
                    msg: EnvMessage = channel.get(obs_key(*src))
                else:
                    msg = channel.exchange(*pending, obs_key(*src))
                    pending = None
                t1 = clock()
                times["wait_s"] += t1 - t0
                b = builders[src]
                if t > 0:
                    b.reward.append(msg.reward)
                    b.terminated.append(msg.terminated)
                    b.truncated.append(msg.truncated)
                    b.invalid.append(msg.invalid)
                    b.final_value.append(self._final_values(msg))
                    if msg.expert is not None:
                        b.expert.append(msg.expert)
                if t < num_chunks:
                    t1 = clock()
                    with autocast(self.device, self.autocast):
                        if self.features and not greedy:
                            out, features = self.policy.act_with_features(msg.obs)
                        else:
                            out, features = self.policy.act(msg.obs, greedy=greedy), None
                    pending = (act_key(*src), out.actions.cpu())
                    if features is not None:
                        b.features.append(features.cpu())
                    b.obs.append(msg.obs)
                    b.replay.append({k: v.cpu() for k, v in out.replay.items()})
                    b.actions.append(out.actions.cpu())
                    b.logprob.append(out.logprob.float().cpu())
                    b.value.append(_value_or_zeros(out.value, msg.obs))
                else:
                    b.value.append(self._values(msg.obs))
                times["policy_s"] += clock() - t1
        t0 = clock()
        if pending is not None:
            channel.put(*pending)
        for src, key in zip(sources, destinations, strict=True):
            trajectories.put(key, builders[src].build(self.version))
        times["finish_s"] += clock() - t0
        return len(sources)

    def _values(self, obs: Observation) -> Tensor:
        with autocast(self.device, self.autocast):
            return _value_or_zeros(self.policy.value(obs), obs)

    def _final_values(self, msg: EnvMessage) -> Tensor:
        """V of the final observation of envs truncated in the chunk (bootstrapping)."""
        out = torch.zeros(msg.obs.batch_size)
        truncated = msg.truncated.any(dim=1) & ~msg.invalid
        if msg.final_obs is not None and truncated.any():
            rows = torch.nonzero(truncated).flatten()
            out[rows] = self._values(msg.final_obs.select(rows))
        return out


def _value_or_zeros(value: Tensor | None, obs: Observation) -> Tensor:
    return torch.zeros(obs.batch_size) if value is None else value.detach().float().cpu()

"""The vectorised env contract and the machinery every simulator shares.

A simulator implements three primitives on a batch of ``num_envs`` envs (:class:`VectorEnv`):

- ``_reset_envs(env_ids, reset_ids)``: put the selected envs in the initial scene of each id;
- ``_step_envs(actions, active, need_obs)``: advance the ``active`` envs by one control step;
- ``action_dim`` / ``config``: its sizes and its typed config.

Everything else lives here, once: action validation, action chunks, per-step rewards and dones,
time limits, auto-reset with ``final_obs``, reset-id cursors and GRPO groups, offload/onload
bookkeeping and video recording.

Chunk semantics (``chunk_step(actions [B, K, A])``):

- Step ``k`` of the chunk is executed for every env that has not ended earlier in the chunk.
- An env ends at step ``k`` when the simulator reports a terminal state (``terminated[:, k]``,
  e.g. success; disabled by ``ignore_terminations``), when its episode reaches its step limit
  (``truncated[:, k]``), or when its simulator crashed (``truncated[:, k]`` and
  ``info["invalid"]``; see below). ``terminated`` and ``truncated`` are never both set.
- After an env ended, its remaining actions in the chunk are ignored, its rewards, terminated and
  truncated are ``0``/``False`` for the rest of the chunk.
- At the end of the chunk the ended envs are reset (``auto_reset=True``, the default) to the next
  reset id of their own deterministic stream (see :meth:`VectorEnv.next_reset_ids`) and ``obs``
  holds their first observation of the new episode. ``final_obs`` (full batch) holds, for ended
  envs, their observation at the step they ended, and equals ``obs`` for the others; it is
  ``None`` when no env ended. With ``auto_reset=False`` ended envs stay ended (their rows of
  ``obs`` are their last observation) until the next :meth:`VectorEnv.reset`.
- ``success[i]`` is ``True`` when env ``i`` was in a success state at any executed step.

Invalid episodes: when the simulator of an env crashes (a subprocess dies), the env is restarted,
its episode ends with ``truncated=True`` and ``info["invalid"][i] = True``, its success is
``False`` and its reward at that step is ``0``. Metrics must drop invalid episodes: they are
neither failures nor successes.

``info`` of a :class:`ChunkResult` holds ``[B]`` tensors: ``invalid`` (bool), ``done`` (bool, the
env ended in the chunk), ``episode_reset_ids`` (long, the reset id of the episode that ran during
the chunk), ``reset_ids`` (long, the reset id of the episode now running) and ``elapsed_steps``
(long, steps of the episode now running). With ``chunk_step(actions, expert=True)`` it also holds
``expert_actions`` (float32 ``[B, K, A]``): the scripted expert's action (:meth:`VectorEnv.
expert_actions`) in the state each step of the chunk was taken from, DAgger's labels; after an
env ended in the chunk its row repeats its last label.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from rlinf_vla.types import ChunkResult, Observation

if TYPE_CHECKING:
    from rlinf_vla.envs.vector import SubprocEnvs

__all__ = [
    "ENVS",
    "EnvConfig",
    "StepOutput",
    "VectorEnv",
    "group_reset_ids",
    "register_env",
]

#: Registered env classes by name, filled by :func:`register_env`.
ENVS: dict[str, type[VectorEnv]] = {}

_E = TypeVar("_E", bound="type[VectorEnv]")

#: Reset ids drawn by the env's own cursor lie in ``[0, 2**31)`` unless the env has fewer.
_ID_RANGE = 2**31


def register_env(name: str) -> Callable[[_E], _E]:
    """Class decorator: register a :class:`VectorEnv` subclass under ``name`` for ``make_env``."""

    def decorator(cls: _E) -> _E:
        if name in ENVS and ENVS[name] is not cls:
            raise ValueError(f"env name {name!r} is already registered by {ENVS[name].__name__}")
        cls.name = name
        ENVS[name] = cls
        return cls

    return decorator


@dataclass(frozen=True)
class EnvSpec:
    """What an env provides: its cameras, action size and state size (``None`` where only the
    simulator knows)."""

    cameras: tuple[str, ...]
    action_dim: int | None
    state_dim: int | None


@dataclass
class EnvConfig:
    """Settings every env shares; each simulator's config subclasses this.

    Attributes:
        num_envs: number of envs in the batch ``B``.
        group_size: GRPO group size: ``group_size`` consecutive envs share each reset id drawn by
            the env's cursor (:meth:`VectorEnv.next_reset_ids`). Must divide ``num_envs``.
        seed: seed of the reset-id cursor (and of anything random in the simulator).
        env_offset: global index of this batch's first env, so that several env batches
            (pipeline stages, env workers) draw distinct, deterministic reset-id streams.
        max_episode_steps: time limit in control steps; ``None`` takes the env's default.
        ignore_terminations: a terminal state (success) does not end the episode; episodes end
            only at the time limit (evaluation "success at end").
        auto_reset: reset envs that ended at the end of the chunk (see module docstring).
        video_dir: write MP4 videos of the envs in ``video_env_ids`` there; ``None`` = off.
        video_env_ids: which envs (indices in the batch) are recorded.
        video_camera: which camera the videos show.
        video_fps: frames per second of the videos.
    """

    num_envs: int = 1
    group_size: int = 1
    seed: int = 0
    env_offset: int = 0
    max_episode_steps: int | None = None
    ignore_terminations: bool = False
    auto_reset: bool = True
    video_dir: str | None = None
    video_env_ids: tuple[int, ...] = (0,)
    video_camera: str = "main"
    video_fps: int = 10

    def __post_init__(self) -> None:
        self.video_env_ids = tuple(int(i) for i in self.video_env_ids)
        check_field(self, "num_envs", self.num_envs >= 1, "must be >= 1")
        check_field(self, "group_size", self.group_size >= 1, "must be >= 1")
        check_field(
            self,
            "group_size",
            self.num_envs % self.group_size == 0,
            f"must divide num_envs={self.num_envs}",
        )
        check_field(self, "env_offset", self.env_offset >= 0, "must be >= 0")
        check_field(
            self,
            "max_episode_steps",
            self.max_episode_steps is None or self.max_episode_steps >= 1,
            "must be >= 1 or None",
        )
        check_field(
            self,
            "video_env_ids",
            all(0 <= i < self.num_envs for i in self.video_env_ids),
            f"must lie in [0, num_envs={self.num_envs})",
        )
        check_field(self, "video_fps", self.video_fps >= 1, "must be >= 1")

    @property
    def cameras(self) -> tuple[str, ...]:
        """The ``images`` keys the env's observations will have (known before it starts)."""
        return ("main",)

    def keep_cameras(self, cameras: Collection[str]) -> EnvConfig:
        """This config rendering only those of its cameras in ``cameras`` (``train`` and
        ``eval`` pass the ones the policy reads and the video's). An env whose cameras are
        fixed returns itself."""
        return self

    def for_whole_batch(self) -> EnvConfig:
        """This config with whatever depends on the batch size resolved for the whole batch,
        before the batch is split into parts that step at the same time and share what the
        whole batch would (pipeline stages in :func:`~rlinf_vla.envs.make_stage_envs`, the env
        workers of one node). An env with nothing of the kind returns itself."""
        return self

    def describe(self) -> str:
        """What the env runs, after its name in a run's header (``PickCube-v1``,
        ``libero_goal tasks [2, 5]``; empty: nothing more to say)."""
        return ""

    def spec(self) -> EnvSpec:
        """What the env will provide, known before it starts (a policy's fit is checked
        against it)."""
        return EnvSpec(self.cameras, getattr(self, "action_dim", None), None)

    def episode_steps(self) -> int | None:
        """The longest time limit of the env's episodes in control steps, known before it
        starts: ``max_episode_steps``, else the env's own default (``None``: only the
        simulator knows it)."""
        return self.max_episode_steps

    def expert_problem(self, env_name: str) -> str | None:
        """Why this env has no scripted expert (:meth:`VectorEnv.expert_actions`; ``None``:
        it has one), known before it starts: the env class has none, or (ManiSkill) the
        task or the control mode has none."""
        cls = ENVS.get(env_name)
        if cls is not None and not cls.has_expert():
            with_one = sorted(n for n, c in ENVS.items() if c.has_expert())
            return f"env {env_name!r} has no scripted expert (envs with one: {with_one})"
        return None

    def eval_trials(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int, seed: int
    ) -> list[dict[str, Any]]:
        """The episodes of an evaluation (``rlinf-vla eval``), task by task: ``suite``,
        ``task``, ``task_index``, ``init_state``, ``reset_id`` and ``env_key`` (env config
        overrides of the trial's env) of each. By default one task, the env itself, with
        seeds ``seed .. seed + trials_per_task - 1`` as reset ids."""
        return [
            {
                "suite": env_name,
                "task": env_name,
                "task_index": 0,
                "init_state": seed + s,
                "reset_id": seed + s,
            }
            for s in range(trials_per_task)
        ]

    def eval_configs(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int
    ) -> list[tuple[str | None, EnvConfig]]:
        """The configs an evaluation (``rlinf-vla eval``) runs its trials with, each with the
        task it runs (``None``: the env's own tasks, one config for all), checked before
        anything starts; a policy's fit is checked against each. By default the env itself:
        it has one task, so ``tasks`` (``eval.tasks``) must be ``None``.

        Raises:
            ValueError: ``tasks`` or ``trials_per_task`` the env cannot run, naming the
                ``eval`` key.
        """
        if tasks is not None:
            raise ValueError(f"eval.tasks: env {env_name!r} has a single task; leave it null")
        return [(None, self)]

    @property
    def eval_uses_seed(self) -> bool:
        """Whether ``eval.seed`` decides an evaluation's trials (the seeds are their reset
        ids), and so belongs to its identity: a results folder resumes only with the same
        seed. ``False`` where the trials are fixed scenes (LIBERO's official init states,
        MetaWorld's task configurations); a sampled evaluation keeps the seed in its identity
        whatever this says (it draws the actions)."""
        return True

    @classmethod
    def eval_protocols(cls) -> tuple[str, ...]:
        """The values ``eval.protocol`` may take for this env, its default first
        (:mod:`rlinf_vla.eval.protocol`). By default ``package`` only: the env settings as
        given, there being no official evaluation loop to reproduce."""
        return ("package",)

    def check_protocol(self, protocol: str) -> None:
        """Check, before an evaluation starts, that this config follows ``protocol`` (one of
        :meth:`eval_protocols`). By default any config follows it.

        Raises:
            ValueError: naming every env key that departs from the protocol, its value and
                the protocol's.
        """

    def protocol_record(self, protocol: str) -> dict[str, Any]:
        """What an evaluation's ``results.json`` records under ``protocol``: by default its
        name, ``{"name": protocol}``; an env adds the settings that decide its trials."""
        return {"name": protocol}

    @classmethod
    def eval_perturbations(cls) -> tuple[str, ...]:
        """The out-of-distribution kinds ``eval.perturbation`` may name for this env, besides
        ``none`` (the tasks as they are). By default none."""
        return ()

    def plan_perturbations(
        self, env_name: str, kinds: list[str], seed: int, trials: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
        """The trials of an evaluation under each perturbation of ``kinds`` (some of
        :meth:`eval_perturbations`), drawn with ``seed``, from the unperturbed ``trials``
        (:meth:`eval_trials`' dicts, with ``env_key`` and ``perturbation``).

        Returns:
            What the run records about the kinds (``results.json``'s ``perturbation``, besides
            the kinds and the seed) and, per kind, its trials: each with ``perturbation`` set
            to the kind and its ``reset_id`` and ``env_key`` in the perturbed env.

        Raises:
            ValueError: the env has no perturbations (the default), or a kind it cannot plan,
                naming the ``eval`` key.
        """
        raise ValueError(f"eval.perturbation: env {env_name!r} has no perturbations")

    def camera_hint(self) -> str:
        """How to give this env a camera that a policy asks for and it lacks, added to the fit
        check's message (``""``, the default: no hint)."""
        return ""

    def robot_type(self, env_name: str) -> str:
        """The robot of the env's episodes, as a dataset's ``robot_type``
        (``rlinf-vla collect``). By default the env's name."""
        return env_name

    @classmethod
    def from_kwargs(cls, env_name: str = "", **kwargs: Any) -> EnvConfig:
        """Build the config from keyword arguments; unknown keys fail, naming them."""
        _check_keys(cls, kwargs, f"env {env_name or cls.__name__!r}")
        return cls(**kwargs)


def check_field(cfg: Any, name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{type(cfg).__name__}.{name} {message} (got {getattr(cfg, name)!r})")


@dataclass
class StepOutput:
    """What a simulator returns for one control step of the whole batch.

    Attributes:
        obs: observation ``[B]``. Rows of envs with ``need_obs`` or ``terminated`` must be the
            observation after this step; other rows may be stale (rendering skipped). Its
            tensors belong to the caller from then on (the env must not modify them later).
        reward: ``float32 [B]`` (ignored for inactive envs).
        terminated: ``bool [B]`` the simulator reached a terminal state.
        success: ``bool [B]`` the task is solved in the state after this step.
        invalid: ``bool [B]`` the simulator of that env crashed during this step and was
            restarted (its row of ``obs`` is stale), or ``None`` when none did.
    """

    obs: Observation
    reward: torch.Tensor
    terminated: torch.Tensor
    success: torch.Tensor
    invalid: torch.Tensor | None = None


def group_reset_ids(ids: torch.Tensor | list[int], group_size: int) -> torch.Tensor:
    """Expand one reset id per group into one per env: ``[G] -> [G * group_size]``.

    ``group_size`` consecutive envs get the same id, hence the same initial scene (GRPO groups).
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    return ids.repeat_interleave(group_size)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors holding values in ``[0, 2**32)``."""
    mask = 0xFFFFFFFF
    x = x & mask
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def hash_ints(*parts: torch.Tensor | int) -> torch.Tensor:
    """Deterministic hash of integer tensors (broadcast together) to int64 in ``[0, 2**32)``."""
    h = torch.zeros((), dtype=torch.long)
    for p in parts:
        p = torch.as_tensor(p, dtype=torch.long)
        h = _mix32(h * 31 + _mix32(p & 0xFFFFFFFF) + _mix32((p >> 32) & 0xFFFFFFFF) + 0x9E3779B9)
    return h


def put_rows(dst: Observation, rows: torch.Tensor, src: Observation) -> Observation:
    """A copy of ``dst`` whose rows ``rows`` are replaced by ``src`` (``len(src) == len(rows)``)."""
    images = {}
    for k, v in dst.images.items():
        v = v.clone()
        v[rows] = src.images[k].to(v.device)
        images[k] = v
    state = None
    if dst.state is not None:
        state = dst.state.clone()
        state[rows] = src.state.to(state.device)
    instruction = list(dst.instruction)
    for j, i in enumerate(rows.tolist()):
        instruction[i] = src.instruction[j]
    return Observation(images=images, state=state, instruction=instruction)


class VectorEnv(ABC):
    """A batch of ``num_envs`` envs behind the vectorised env contract.

    Public API: :meth:`reset`, :meth:`chunk_step`, :attr:`num_envs`, :attr:`action_dim`,
    :attr:`max_episode_steps`, :meth:`offload`, :meth:`onload`, :meth:`close`. The chunk,
    auto-reset and invalid-episode semantics are in this module's docstring.

    Subclasses implement :meth:`_reset_envs`, :meth:`_step_envs` and :attr:`action_dim`, set
    ``self._max_episode_steps`` (the default time limit) and may override
    :meth:`_episode_limits`, :attr:`num_reset_ids`, :meth:`_offload`, :meth:`_onload` and
    :meth:`_close`.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[EnvConfig]] = EnvConfig

    def __init__(self, config: EnvConfig, default_max_episode_steps: int) -> None:
        self.config = config
        n = config.num_envs
        self._max_episode_steps = config.max_episode_steps or default_max_episode_steps
        self._elapsed = torch.zeros(n, dtype=torch.long)
        self._episodes = torch.zeros(n, dtype=torch.long)
        self._reset_ids = torch.full((n,), -1, dtype=torch.long)
        self._limits = torch.full((n,), self._max_episode_steps, dtype=torch.long)
        self._ended = torch.ones(n, dtype=torch.bool)
        self._obs: Observation | None = None
        self._offloaded = False
        self._closed = False
        self._recorder = None
        if config.video_dir is not None:
            from rlinf_vla.envs.video import VideoRecorder

            self._recorder = VideoRecorder(
                config.video_dir,
                env_ids=config.video_env_ids,
                camera=config.video_camera,
                fps=config.video_fps,
                prefix=self.name or type(self).__name__,
                env_offset=config.env_offset,
            )

    # ------------------------------------------------------------------ simulator primitives
    @property
    @abstractmethod
    def action_dim(self) -> int:
        """Size ``A`` of one action."""

    @abstractmethod
    def _reset_envs(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        """Reset envs ``env_ids [n]`` to the scenes of ``reset_ids [n]``; their obs ``[n]``."""

    @abstractmethod
    def _step_envs(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        """One step of ``actions float32 [B, A]`` for the envs where ``active [B]`` is set.

        Inactive envs must not change (or, for simulators that cannot hold some envs still, may
        change: their episodes are over and get reset before they are used again).
        """

    def _episode_limits(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> torch.Tensor:
        """Time limit of the episodes that start with ``reset_ids`` (default: one limit)."""
        return torch.full_like(reset_ids, self._max_episode_steps)

    def _offload(self) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Free the simulator's device memory, keeping what :meth:`_onload` needs."""

    def _onload(self) -> None:  # noqa: B027
        """Restore what :meth:`_offload` freed."""

    def _close(self) -> None:  # noqa: B027
        """Release the simulator."""

    @property
    def num_reset_ids(self) -> int | None:
        """Number of distinct initial states (ids are taken modulo it), ``None`` if unbounded."""
        return None

    def expert_actions(self) -> torch.Tensor:
        """A scripted expert's action for each env's current state: float32 ``[B, A]``.

        The expert reads privileged simulator state (object, goal and gripper poses), so its
        actions are demonstrations, not a policy's. They are in the env's action units and
        gripper convention: pass them to :meth:`chunk_step` as ``actions[:, None]``. Rows of
        envs whose episode ended (``auto_reset=False``) are meaningless.

        Raises:
            NotImplementedError: the env has no scripted expert.
        """
        raise NotImplementedError(
            f"env {self.name or type(self).__name__!r} has no scripted expert"
        )

    # ------------------------------------------------------------------ contract
    @property
    def num_envs(self) -> int:
        return self.config.num_envs

    @property
    def workers(self) -> SubprocEnvs | None:
        """The subprocess pool the simulators run in (:mod:`rlinf_vla.envs.vector`), or
        ``None`` for an env that steps in this process. The pipeline stages of an env worker
        whose envs all have one step at the same time (:class:`~rlinf_vla.pipelines.rollout.EnvWorker`)."""
        return None

    @property
    def max_episode_steps(self) -> int:
        """The longest time limit of any episode this env runs."""
        return self._max_episode_steps

    @property
    def group_size(self) -> int:
        return self.config.group_size

    @property
    def reset_ids(self) -> torch.Tensor:
        """Reset id of the episode each env is running (``-1`` before the first reset)."""
        return self._reset_ids.clone()

    @property
    def elapsed_steps(self) -> torch.Tensor:
        return self._elapsed.clone()

    def next_reset_ids(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The ids the cursor gives the next episode of ``env_ids`` (all envs by default).

        Env ``i`` starting its ``n``-th episode gets ``hash(seed, group, n) % num_reset_ids``
        with ``group = (env_offset + i) // group_size``: deterministic, and shared by the envs
        of a GRPO group as long as they start their episodes together.
        """
        if env_ids is None:
            env_ids = torch.arange(self.num_envs)
        group = (self.config.env_offset + env_ids) // self.config.group_size
        h = hash_ints(self.config.seed, group, self._episodes[env_ids])
        return h % (self.num_reset_ids or _ID_RANGE)

    def reset(self, reset_ids: torch.Tensor | list[int] | None = None) -> Observation:
        """Reset every env; ``reset_ids [B]`` select the initial scenes (same id => same scene).

        Without ``reset_ids`` each env takes the next id of its cursor (:meth:`next_reset_ids`).
        Use :func:`group_reset_ids` to give ``group_size`` consecutive envs the same id.
        """
        self._check_usable()
        env_ids = torch.arange(self.num_envs)
        if reset_ids is None:
            ids = self.next_reset_ids(env_ids)
        else:
            ids = torch.as_tensor(reset_ids, dtype=torch.long).flatten().cpu()
            if ids.shape != (self.num_envs,):
                raise ValueError(
                    f"reset_ids must have shape [num_envs] = [{self.num_envs}], got "
                    f"{list(torch.as_tensor(reset_ids).shape)}"
                )
            if (ids < 0).any():
                raise ValueError(f"reset_ids must be >= 0, got {ids.tolist()}")
        self._obs = self._start_episodes(env_ids, ids)
        return self._obs

    @classmethod
    def has_expert(cls) -> bool:
        """Whether this env class has a scripted expert (:meth:`expert_actions`)."""
        return cls.expert_actions is not VectorEnv.expert_actions

    def chunk_step(self, actions: torch.Tensor, expert: bool = False) -> ChunkResult:
        """Execute an action chunk ``float32 [B, K, A]``; see the module docstring.
        ``expert``: label each step's state with the scripted expert's action
        (``info["expert_actions"]``)."""
        self._check_usable()
        if self._obs is None:
            raise RuntimeError("call reset() before chunk_step()")
        actions = self._validate_actions(actions)
        n, k_steps = self.num_envs, actions.shape[1]
        reward = torch.zeros(n, k_steps, dtype=torch.float32)
        terminated = torch.zeros(n, k_steps, dtype=torch.bool)
        truncated = torch.zeros(n, k_steps, dtype=torch.bool)
        success = torch.zeros(n, dtype=torch.bool)
        invalid = torch.zeros(n, dtype=torch.bool)
        episode_ids = self._reset_ids.clone()
        active = ~self._ended
        done = torch.zeros(n, dtype=torch.bool)
        final_parts: list[tuple[torch.Tensor, Observation]] = []
        record = self._recorder.mask(n) if self._recorder is not None else None
        obs = self._obs
        labels = torch.zeros(n, k_steps, actions.shape[-1]) if expert else None
        for k in range(k_steps):
            if not active.any():
                if labels is not None:  # every env ended: the rest repeat their last labels
                    labels[:, k:] = labels[:, k - 1 : k]
                break
            if labels is not None:
                prev = labels[:, k - 1] if k else labels[:, 0]
                labels[:, k] = torch.where(
                    active[:, None], self.expert_actions().cpu().float(), prev
                )
            hits_limit = active & (self._elapsed + 1 >= self._limits)
            need_obs = active & (hits_limit | (k == k_steps - 1))
            if record is not None:
                need_obs |= active & record
            out = self._step_envs(actions[:, k], active.clone(), need_obs)
            bad = active & (
                out.invalid if out.invalid is not None else torch.zeros(n, dtype=torch.bool)
            )
            good = active & ~bad
            term = good & out.terminated.cpu().bool() & (not self.config.ignore_terminations)
            trunc = (good & hits_limit & ~term) | bad
            reward[:, k] = torch.where(good, out.reward.cpu().float(), 0.0)
            terminated[:, k] = term
            truncated[:, k] = trunc
            success |= good & out.success.cpu().bool()
            invalid |= bad
            self._elapsed += active.long()
            ended_now = term | trunc
            fresh = need_obs | term
            fresh &= ~bad
            if fresh.all():
                obs = out.obs
            elif fresh.any():
                rows = torch.nonzero(fresh).flatten()
                obs = put_rows(obs, rows, out.obs.select(rows))
            if record is not None:
                self._recorder.add(obs, record & active & ~bad, out.success.cpu().bool())
            if ended_now.any():
                rows = torch.nonzero(ended_now).flatten()
                final_parts.append((rows, obs.select(rows)))
                if record is not None:
                    self._recorder.end(rows, invalid=bad)
            done |= ended_now
            active &= ~ended_now
        success &= ~invalid
        self._ended |= done
        final_obs = None
        if done.any():
            final_obs = obs
            for rows, part in final_parts:
                final_obs = put_rows(final_obs, rows, part)
            if self.config.auto_reset:
                rows = torch.nonzero(done).flatten()
                new = self._start_episodes(rows, self.next_reset_ids(rows))
                obs = put_rows(obs, rows, new)
        self._obs = obs
        info = {
            "invalid": invalid,
            "done": done,
            "episode_reset_ids": episode_ids,
            "reset_ids": self._reset_ids.clone(),
            "elapsed_steps": self._elapsed.clone(),
        }
        if labels is not None:
            info["expert_actions"] = labels
        return ChunkResult(
            obs=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            success=success,
            final_obs=final_obs,
            info=info,
        )

    def offload(self) -> None:
        """Save the simulator state and free its (device) memory; :meth:`onload` restores it."""
        if not self._offloaded:
            self._offload()
            self._offloaded = True

    def onload(self) -> None:
        """Restore the state saved by :meth:`offload`; stepping continues where it stopped."""
        if self._offloaded:
            self._onload()
            self._offloaded = False

    @property
    def is_offloaded(self) -> bool:
        return self._offloaded

    def flush_video(self) -> None:
        """Write the videos of episodes still running (partial episodes)."""
        if self._recorder is not None:
            self._recorder.flush()

    def close(self) -> None:
        """Release the simulator (and its subprocesses); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._recorder is not None:
                self._recorder.close()
        finally:
            self._close()

    def __enter__(self) -> VectorEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _start_episodes(self, env_ids: torch.Tensor, ids: torch.Tensor) -> Observation:
        obs = self._reset_envs(env_ids, ids)
        self._reset_ids[env_ids] = ids
        self._episodes[env_ids] += 1
        self._elapsed[env_ids] = 0
        self._limits[env_ids] = self._episode_limits(env_ids, ids)
        self._ended[env_ids] = False
        if self._recorder is not None:
            self._recorder.start(env_ids, obs)
        return obs

    def _validate_actions(self, actions: torch.Tensor) -> torch.Tensor:
        actions = torch.as_tensor(actions)
        expected = f"[num_envs, K, action_dim] = [{self.num_envs}, K, {self.action_dim}]"
        if (
            actions.ndim != 3
            or actions.shape[0] != self.num_envs
            or actions.shape[2] != self.action_dim
            or actions.shape[1] < 1
        ):
            raise ValueError(
                f"{self.name} env: actions must have shape {expected}, got {list(actions.shape)}"
            )
        if actions.is_complex() or actions.dtype == torch.bool:
            raise TypeError(f"{self.name} env: actions must be real numbers, got {actions.dtype}")
        actions = actions.detach().to("cpu", torch.float32)
        bad = ~torch.isfinite(actions)
        if bad.any():
            env_ids = torch.nonzero(bad.flatten(1).any(1)).flatten().tolist()
            step = int(torch.nonzero(bad[env_ids[0]].any(1)).flatten()[0])
            raise ValueError(
                f"{self.name} env: actions contain NaN or inf for env index(es) {env_ids} "
                f"(first at chunk step {step} of env {env_ids[0]})"
            )
        return actions

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} env is closed")
        if self._offloaded:
            raise RuntimeError(f"{self.name} env is offloaded; call onload() first")


def replace_config(config: EnvConfig, **overrides: Any) -> EnvConfig:
    """A copy of ``config`` with ``overrides``; unknown keys fail, naming them."""
    _check_keys(type(config), overrides, type(config).__name__)
    return dataclasses.replace(config, **overrides)


def _check_keys(cls: type[EnvConfig], keys: dict[str, Any], what: str) -> None:
    """Unknown config keys fail, naming them and the known ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise TypeError(f"unknown config key(s) {unknown} for {what}; known keys: {sorted(known)}")


def split_sizes(num_envs: int, num_stages: int, group_size: int = 1) -> list[int]:
    """Sizes of ``num_stages`` pipeline stages of ``num_envs`` envs, whole GRPO groups each."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    groups = num_envs // group_size
    if num_envs % group_size or groups % num_stages:
        raise ValueError(
            f"num_envs={num_envs} must split into num_stages={num_stages} stages of whole "
            f"groups of group_size={group_size} (num_envs must be a multiple of "
            f"{group_size * num_stages})"
        )
    return [num_envs // num_stages] * num_stages

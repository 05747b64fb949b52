"""The ``rlinf-vla train`` job: its sections, their typed configs and the cross-checks.

Validation is pure: it builds the typed configs of every section and checks how they fit
together (stages and env workers dividing the envs in whole groups, the policy's cameras,
action and state sizes against the env's, the placement against the devices) without starting
anything. A policy without a checkpoint takes the env's sizes where the command line leaves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rlinf_vla.algos.presets import ineffective_keys
from rlinf_vla.config import (
    ConfigError,
    SectionErrors,
    check_at_least,
    check_sections,
    config_fields,
    from_section,
    named_section,
)
from rlinf_vla.fit import fit_problems, for_policy, sized_for_env
from rlinf_vla.pipelines.evaluation import check_eval_episodes
from rlinf_vla.policies.resolve import policy_config_for
from rlinf_vla.run.tracking import LoggingConfig, resolve_resume
from rlinf_vla.runtime.cluster import ClusterConfig, local_device_count
from rlinf_vla.runtime.placement import Placement, PlacementConfig, resolve_placement
from rlinf_vla.training.algo_config import AlgoConfig

if TYPE_CHECKING:
    from rlinf_vla.envs.base import EnvConfig
    from rlinf_vla.policies.base import PolicyConfig


@dataclass
class TrainPlacementConfig(PlacementConfig):
    """The ``placement`` section: the runtime's placement plus the pipeline stage count.

    Attributes:
        mode: ``collocated``, ``disaggregated``, ``hybrid``, ``local`` (every component in
            this process on one device, no Ray: :mod:`rlinf_vla.runtime.local`), or ``auto``
            (profile the workload at start, then pick the mode, the device split and
            ``stages``; see :mod:`rlinf_vla.pipelines.auto`).
        stages: pipeline stages ``S`` per env worker (``hybrid``: env stage ``s`` steps while
            the rollout computes stage ``s - 1``).
        max_stages: ``auto`` only: the largest stage count it considers (1, 2, 4, ...).
        profile_chunks: ``auto`` only: chunk steps it times.
        offload: collocated and local on GPUs only: the policy copy that is idle (the
            actor's while the rollout runs, the rollout's while the actor trains) waits in
            host memory, so that each has the GPU's memory to itself. ``false`` keeps both on the GPU when they fit
            together (a 7B policy with LoRA: about 76 GiB of peaks on one GPU), which saves
            moving the weights to and from the GPU twice per iteration.
    """

    mode: Literal["collocated", "disaggregated", "hybrid", "local", "auto"] = "collocated"
    stages: int = 1
    max_stages: int = 4
    profile_chunks: int = 3
    offload: bool = True

    def __post_init__(self) -> None:
        check_at_least(self, "placement", ("stages", "max_stages", "profile_chunks"), 1)
        if self.mode == "auto":
            return
        for name in ("actor", "env", "rollout"):
            if name not in self.components:
                raise ConfigError(
                    f"placement.components.{name} is missing (actor, env and rollout are placed)"
                )


@dataclass
class RunnerConfig:
    """The ``runner`` section.

    Attributes:
        name: the run's name (the default output folder is ``runs/<name>-<timestamp>``).
        max_iterations: training iterations (rollout + update).
        rollout_chunks: chunk steps per env per rollout (``T``).
        seed: seed of the policy init, the samplers and the envs' reset-id cursors.
        output_dir: the run folder (``None``: ``runs/<name>-<timestamp>``).
        resume: a run folder to continue from its last checkpoint, or ``auto``: continue
            ``output_dir`` if it has a checkpoint, else start it.
        save_interval: save a checkpoint every N iterations (and at the end).
        max_nan_updates: abort after this many optimizer updates in a row were skipped for a
            non-finite loss or gradient (each skip is warned about and counted in
            ``train/skipped_updates``).
        logging: where metrics go besides ``metrics.jsonl`` (TensorBoard, wandb).
        eval_interval: every N iterations, evaluate the greedy policy on held-out scenes
            (``eval/*`` metrics; 0 = never).
        eval_at_start: also evaluate the starting policy, before the first iteration (the
            curve's first point, and the "before" of the run's closing before / after line).
        eval_episodes: episodes per evaluation.
        eval_scenes: the scenes they start from: ``held_out`` (reset ids from
            ``2**31 - 2**20``, the default) or ``validation`` (the block below, from
            ``2**31 - 2**21``; for choosing a checkpoint without looking at the held-out
            scenes).
        eval_num_envs: envs the evaluation runs its episodes on, in rounds (``None``:
            ``min(env.num_envs, eval_episodes)``). The evaluation builds them beside the
            training envs; fewer use less memory (each ManiSkill or LIBERO env on the CPU is a
            process) and give the same episodes: each episode's scene is set by its index.
        eval_videos: write an MP4 per evaluation round of the first env to
            ``<run>/videos/iter_<N>/``.
    """

    name: str = "train"
    max_iterations: int = 10
    rollout_chunks: int = 25
    seed: int = 0
    output_dir: str | None = None
    resume: str | None = None
    save_interval: int = 5
    max_nan_updates: int = 5
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval_interval: int = 10
    eval_at_start: bool = False
    eval_episodes: int = 4
    eval_scenes: Literal["held_out", "validation"] = "held_out"
    eval_num_envs: int | None = None
    eval_videos: bool = True

    def __post_init__(self) -> None:
        positive = ("max_iterations", "rollout_chunks", "save_interval", "max_nan_updates")
        check_at_least(self, "runner", positive, 1)
        check_at_least(self, "runner", ("seed", "eval_interval", "eval_episodes"), 0)
        check_at_least(self, "runner", ("eval_num_envs",), 1)
        check_eval_episodes(self.eval_episodes)
        self.resume = resolve_resume(self.resume, self.output_dir, "iter")


@dataclass
class TrainJob:
    """A validated ``rlinf-vla train`` job: every section typed, the placement resolved.

    ``env_config`` and ``policy_config`` are the typed configs the workers receive and build
    from, every default resolved: the env's ``seed`` is ``runner.seed`` unless ``env.seed`` is
    set; a policy with a checkpoint has the checkpoint's config with the command line's keys
    on top. ``env`` and ``policy`` only record what they were built from (the keys the command
    line set; ``policy`` also the env's sizes that a policy without a checkpoint takes).
    """

    cluster: ClusterConfig
    env_name: str
    env: dict[str, Any]
    policy_name: str
    policy: dict[str, Any]
    algo: AlgoConfig
    placement: TrainPlacementConfig
    runner: RunnerConfig
    env_config: EnvConfig
    policy_config: PolicyConfig
    resolved: Placement | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """Every setting, defaults included (:func:`~rlinf_vla.run.checkpoints
        .settings_of`): what a resume compares beside the command line's keys."""
        from rlinf_vla.run.checkpoints import settings_of

        return settings_of(
            {
                "cluster": self.cluster,
                "env": {"name": self.env_name, **config_fields(self.env_config)},
                "policy": {"name": self.policy_name, **config_fields(self.policy_config)},
                "algo": self.algo,
                "placement": self.placement,
                "runner": self.runner,
            }
        )


def validate(cfg: Any) -> TrainJob:
    """Typed configs and cross-checks for a composed ``train`` config; starts nothing. Every
    section is checked before any error is raised, then every check across sections, so that
    one run names all the problems of each stage."""
    check_sections(cfg, ("cluster", "env", "policy", "algo", "placement", "runner"))
    job = _typed_job(cfg)
    errors = SectionErrors()
    for message in _cross_problems(job, cfg["algo"]):
        errors.add(message)
    errors.build(lambda: _check_placement(job))
    errors.raise_any()
    return job


def _typed_job(cfg: Any) -> TrainJob:
    """The job of ``cfg`` with every section typed (every bad section named at once)."""
    from omegaconf import OmegaConf

    from rlinf_vla.envs import env_section_config, replace_config

    env_name, env = named_section(cfg["env"], "env")
    policy_name, policy = named_section(cfg["policy"], "policy")

    def resolve_policy() -> tuple[dict[str, Any], Any]:
        # The section holds what the command line set; a checkpoint's config decides the rest,
        # else the env's sizes fill in the ones the command line leaves (sized_for_env).
        settings = policy if env_cfg is None else sized_for_env(policy_name, policy, env_cfg)
        return settings, policy_config_for(policy_name, settings)

    errors = SectionErrors()
    algo = errors.build(lambda: from_section(AlgoConfig, cfg["algo"], "algo"))
    if algo is not None and "group_size" not in (cfg["algo"] or {}):
        # Groups follow env.group_size when the command line sets only that one; else both
        # take the algorithm's default.
        if algo.preset.uses_groups and env.get("group_size", 1) > 1:
            algo.group_size = env["group_size"]
        elif algo.preset.uses_groups:
            env["group_size"] = algo.group_size
    env_cfg = errors.build(lambda: env_section_config(env_name, env))
    policy, pol_cfg = errors.build(resolve_policy) or (policy, None)
    sections = {
        "cluster": ClusterConfig,
        "placement": TrainPlacementConfig,
        "runner": RunnerConfig,
    }
    built = {
        k: errors.build(lambda k=k, c=c: from_section(c, cfg[k], k)) for k, c in sections.items()
    }
    errors.raise_any()
    if "seed" not in env:  # the envs follow runner.seed unless env.seed is set
        env_cfg = replace_config(env_cfg, seed=built["runner"].seed)
    # Training keeps float32 weights, so AdamW's state and the checkpoints are float32 too, and
    # algo.autocast sets the compute precision; policy.dtype=bfloat16 still holds bf16 weights.
    if pol_cfg.dtype == "auto":
        pol_cfg = pol_cfg.replace(dtype="float32")
    return TrainJob(
        env_name=env_name,
        env=env,
        policy_name=policy_name,
        policy=policy,
        algo=algo,
        **built,
        env_config=env_cfg,
        policy_config=pol_cfg,
        raw=OmegaConf.to_container(cfg, resolve=True),
    )


def _cross_problems(job: TrainJob, algo_section: Any) -> list[str]:
    """What does not fit across the sections of ``job`` (``algo_section``: the ``algo``
    section as given, for the keys that do nothing). Where the env and the policy fit, the
    env keeps only the cameras the policy reads (one that nothing reads is not rendered)."""
    env_name, env_cfg, pol_cfg, algo = job.env_name, job.env_config, job.policy_config, job.algo
    problems = fit_problems(env_name, env_cfg, pol_cfg)
    if not problems:
        job.env_config = env_cfg = for_policy(env_cfg, pol_cfg)
    problems += ineffective_keys(algo_section, algo.preset, AlgoConfig.CONDITIONAL, algo.name)
    if algo.preset.imitation:
        problem = env_cfg.expert_problem(env_name)
        if problem:
            problems.append(
                f"algo={algo.name} labels states with the env's scripted expert: {problem}"
            )
    if algo.preset.uses_groups:
        if algo.group_size != env_cfg.group_size:
            problems.append(
                f"algo.group_size={algo.group_size} must equal env.group_size={env_cfg.group_size}: "
                f"{algo.name} compares the episodes of envs that share a reset id"
            )
        steps = job.runner.rollout_chunks * pol_cfg.chunk_size
        limit = env_cfg.episode_steps()
        if limit is not None and steps < limit:
            problems.append(
                f"{algo.name} scores whole episodes: runner.rollout_chunks x policy.chunk_size = {steps} env steps "
                f"is shorter than the env's time limit of {limit} steps (env.max_episode_steps)"
            )
    if job.runner.eval_interval > 0 and job.runner.eval_videos:
        from rlinf_vla.envs.video import require_ffmpeg

        try:
            require_ffmpeg("set runner.eval_videos=false")
        except RuntimeError as e:
            problems.append(f"runner.eval_videos=true: {e}")
    return problems


def _check_placement(job: TrainJob) -> None:
    """The placement fits the local cluster's devices (counted without starting it; a remote
    cluster is checked when it starts); ``job.resolved`` is the resolved placement."""
    devices = local_device_count(job.cluster)
    env_cfg = job.env_config
    if devices is not None and job.placement.mode == "auto":
        from rlinf_vla.pipelines.auto import Costs, candidate_plans, choose

        groups = env_cfg.num_envs // env_cfg.group_size
        plans = candidate_plans(Costs(1.0, 1.0, 1.0), devices, groups, 1, job.placement.max_stages)
        choose(plans)
    elif job.placement.mode == "local" and job.cluster.address is not None:
        raise ConfigError(
            f"placement=local runs in this process on this machine; cluster.address="
            f"{job.cluster.address!r} names a Ray cluster (use another placement there)"
        )
    elif devices is not None:
        job.resolved = resolve_placement(job.placement, devices)
        check_env_split(job, len(job.resolved.of("env")), len(job.resolved.of("actor")))


def check_env_split(job: TrainJob, env_workers: int, actor_workers: int = 1) -> None:
    """The envs must split into ``env_workers * stages`` batches of whole GRPO groups, and
    those batches (one trajectory each per iteration) evenly over the actor workers."""
    cfg = job.env_config
    parts = env_workers * job.placement.stages
    groups = cfg.num_envs // cfg.group_size
    if groups % parts:
        raise ConfigError(
            f"env.num_envs={cfg.num_envs} (groups of env.group_size={cfg.group_size}) cannot be split "
            f"evenly over {env_workers} env worker(s) x placement.stages={job.placement.stages}"
        )
    if parts % actor_workers:
        raise ConfigError(
            f"{env_workers} env worker(s) x placement.stages={job.placement.stages} = {parts} "
            f"trajectories per iteration cannot be shared evenly by {actor_workers} actor "
            "workers: raise placement.stages or put placement.components.actor on fewer devices"
        )

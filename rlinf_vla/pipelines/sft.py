"""``rlinf-vla sft``: behaviour cloning of a VLA policy on LeRobot datasets, on the RL runtime.

The actor workers of ``rlinf-vla train`` (data parallel or FSDP over ``sft.devices``, LoRA,
non-finite-update skip, checkpoints) train the policy family's own supervised loss
(:meth:`rlinf_vla.policies.Policy.loss`: OpenVLA's token cross-entropy, OFT's L1, π0's flow
matching) on frames of the datasets (:mod:`rlinf_vla.pipelines.demos`); a rollout worker
evaluates the greedy policy in the simulator every ``runner.eval_interval`` steps on held-out
scenes (success rate, videos). Metrics, TensorBoard, progress bar, resume: as ``train``.

The policy normalises with the datasets' statistics, which its checkpoints keep where the
family keeps them (OpenVLA ``dataset_statistics.json``, π0 ``norm_stats.json``), so
``policy.checkpoint=<run>/checkpoints/step_<N>`` works unchanged in ``train``, ``eval`` and
``serve``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from rlinf_vla.config import (
    ConfigError,
    SectionErrors,
    check_at_least,
    check_sections,
    from_section,
    to_dict,
)
from rlinf_vla.pipelines.demos import FeatureMap, combine_stats, map_features, value_problem
from rlinf_vla.pipelines.evaluation import check_eval_episodes
from rlinf_vla.run.tracking import LoggingConfig, resolve_resume, run_folder
from rlinf_vla.runtime.cluster import ClusterConfig
from rlinf_vla.training.algo_config import AlgoConfig

WEIGHTS = "sft-weights"
DATA_PARALLEL = "sft-dp"


@dataclass
class DataConfig:
    """The ``data`` section: which demonstrations, and how their features feed the policy.

    Attributes:
        paths: LeRobotDataset folders (v2.1 or v3.0); several are trained on together.
        cameras: policy camera -> dataset image feature, for cameras not named
            ``observation.images.<camera>`` in the dataset (e.g. ``{main: observation.images.top}``).
        state: the proprioceptive state feature (``None``: the policy gets no state).
        action: the action feature.
    """

    paths: list[str] = field(default_factory=list)
    cameras: dict[str, str] = field(default_factory=dict)
    state: str | None = "observation.state"
    action: str = "action"

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not self.paths:
            raise ConfigError("data.paths: name at least one LeRobotDataset folder")


@dataclass
class SFTConfig:
    """The ``sft`` section: the optimisation.

    Attributes:
        steps: optimizer steps of the run.
        batch_size: frames per optimizer step, over all actor workers.
        micro_batch_size: frames per forward/backward on one worker (gradient accumulation;
            the update does not depend on it).
        lr: AdamW learning rate; ``weight_decay`` its decay.
        lr_schedule: ``constant`` or ``linear`` decay to 0 over the run.
        warmup_steps: linear warmup of the learning rate.
        max_grad_norm: gradient clipping.
        autocast: ``auto`` (bf16 on CUDA), ``bf16`` or ``off``, as ``algo.autocast``.
        fsdp: shard the policy over the actor workers with FSDP2 (else replicas).
        devices: device range of the actor workers (``all``, ``0-3``...); evaluation runs on
            the first of them.
    """

    steps: int = 1000
    batch_size: int = 32
    micro_batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_schedule: Literal["constant", "linear"] = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    autocast: Literal["auto", "bf16", "off"] = "auto"
    fsdp: bool = False
    devices: str | int | list[int] = "all"

    def __post_init__(self) -> None:
        check_at_least(self, "sft", ("steps", "batch_size", "micro_batch_size"), 1)
        check_at_least(self, "sft", ("warmup_steps",), 0)
        bad = [
            f"{key} must be {rule}, got {value}"
            for key, value, ok, rule in (
                ("sft.lr", self.lr, self.lr > 0, "> 0"),
                ("sft.max_grad_norm", self.max_grad_norm, self.max_grad_norm > 0, "> 0"),
                ("sft.weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0"),
                (
                    "sft.micro_batch_size",
                    self.micro_batch_size,
                    self.micro_batch_size <= self.batch_size,
                    f"<= sft.batch_size={self.batch_size}",
                ),
            )
            if not ok
        ]
        if bad:
            raise ConfigError("; ".join(bad))


@dataclass
class SFTRunnerConfig:
    """The ``runner`` section of ``sft``.

    Attributes:
        name: the run's name (default folder ``runs/<name>-<timestamp>``).
        seed: seeds the policy init, the frame sampler and the evaluation.
        output_dir, resume: as ``train`` (``resume=auto`` continues ``output_dir``).
        save_interval: checkpoint every N steps (and at the end).
        max_nan_updates: abort after this many skipped (non-finite) updates in a row.
        logging: TensorBoard / wandb.
        eval_interval: greedy evaluation in ``env`` every N steps (0: never); also once
            before the first step when ``eval_at_start``.
        eval_at_start: evaluate the starting policy too (the curve's first point).
        eval_episodes: episodes per evaluation.
        eval_scenes: which scenes they start from: ``held_out`` (reset ids from
            ``2**31 - 2**20``, those ``train`` evaluates on) or ``validation`` (the block below
            them, from ``2**31 - 2**21``): choose a checkpoint on validation scenes and score
            it on others (:func:`~rlinf_vla.pipelines.evaluation.best_checkpoint`).
        eval_num_envs: envs the evaluation runs them on (``None``: ``min(env.num_envs,
            eval_episodes)``; as ``train``).
        eval_videos: an MP4 of the first env per evaluation in ``<run>/videos/step_<N>/``.
    """

    name: str = "sft"
    seed: int = 0
    output_dir: str | None = None
    resume: str | None = None
    save_interval: int = 500
    max_nan_updates: int = 5
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval_interval: int = 500
    eval_at_start: bool = False
    eval_episodes: int = 8
    eval_scenes: Literal["held_out", "validation"] = "held_out"
    eval_num_envs: int | None = None
    eval_videos: bool = True

    def __post_init__(self) -> None:
        check_at_least(self, "runner", ("save_interval", "max_nan_updates"), 1)
        check_at_least(self, "runner", ("seed", "eval_interval", "eval_episodes"), 0)
        check_at_least(self, "runner", ("eval_num_envs",), 1)
        check_eval_episodes(self.eval_episodes)
        self.resume = resolve_resume(self.resume, self.output_dir, "step")


@dataclass
class SFTJob:
    """A validated ``rlinf-vla sft`` job.

    ``env_config`` and ``policy_config`` are the typed configs the workers receive (the
    policy's with the datasets' statistics, and with a checkpoint the checkpoint's config under
    the command line's keys); ``env`` and ``policy`` record the settings they were built from.
    """

    cluster: ClusterConfig
    env_name: str
    env: dict[str, Any]
    policy_name: str
    policy: dict[str, Any]
    data: DataConfig
    sft: SFTConfig
    runner: SFTRunnerConfig
    features: list[FeatureMap]
    counts: dict[str, int]
    env_config: Any  # the evaluation's env (every default resolved); None: no evaluation
    policy_config: Any  # the actor's policy, statistics included
    raw: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """Every setting, defaults included (:func:`~rlinf_vla.run.checkpoints
        .settings_of`): what a resume compares beside the command line's keys."""
        from rlinf_vla.config import config_fields
        from rlinf_vla.run.checkpoints import settings_of

        sections: dict[str, Any] = {
            "cluster": self.cluster,
            "data": self.data,
            "sft": self.sft,
            "runner": self.runner,
            "policy": {"name": self.policy_name, **config_fields(self.policy_config)},
        }
        if self.env_config is not None:
            sections["env"] = {"name": self.env_name, **config_fields(self.env_config)}
        return settings_of(sections)

    def algo(self, ranks: int) -> AlgoConfig:
        """The actor workers' optimisation settings: ``sft``'s, as the ``algo`` section of
        ``train`` names them (the preset keys play no part in a supervised step)."""
        s = self.sft
        return AlgoConfig(
            minibatch_size=s.batch_size // ranks,
            micro_batch_size=min(s.micro_batch_size, s.batch_size // ranks),
            lr=s.lr,
            weight_decay=s.weight_decay,
            lr_schedule=s.lr_schedule,
            warmup_iterations=s.warmup_steps,
            max_grad_norm=s.max_grad_norm,
            autocast=s.autocast,
            fsdp=s.fsdp,
            cache_frozen_features=False,
        )


def _stat_lists(stats: dict[str, np.ndarray]) -> dict[str, list[float]]:
    return {k: [float(x) for x in np.asarray(v).reshape(-1)] for k, v in stats.items()}


def _dataset_name(paths: list[str]) -> str:
    return "+".join(Path(p).resolve().name for p in paths)


def _cameras_from_data(
    features: list[str], mapped: dict[str, str], default: list[str] | None
) -> list[str]:
    """The policy's cameras when the command line leaves them: those of the family's default
    the dataset has (by name or through ``data.cameras``), else the dataset's first camera."""
    from rlinf_vla.pipelines.demos import IMAGE_PREFIX

    names = [f.removeprefix(IMAGE_PREFIX) for f in features]
    kept = [c for c in default or [] if c in mapped or c in names]
    return kept or names[:1]


def _stats_problem(stats: dict[str, Any] | None, feature: str) -> str | None:
    """Why the dataset's statistics of ``feature`` cannot normalise it, or ``None``."""
    if stats is None:
        return "meta/stats.json is missing (the policy normalises with the data's statistics)"
    if feature not in stats:
        return f"meta/stats.json has no statistics of {feature!r}"
    bad = sorted(
        k for k, v in stats[feature].items() if not np.isfinite(np.asarray(v, dtype=float)).all()
    )
    if bad:
        return f"meta/stats.json: the statistics {bad} of {feature!r} hold NaN or inf"
    return None


def _open(paths: list[str]) -> list[Any]:
    from rlinf_vla.data import DatasetError, open_dataset

    out, problems = [], []
    for p in paths:
        try:
            out.append(open_dataset(Path(p).expanduser()))
        except (DatasetError, FileNotFoundError) as e:
            problems.append(f"data.paths: {e}")
    if problems:
        raise ConfigError("; ".join(problems))
    return out


def validate(cfg: Any) -> SFTJob:
    """Typed sections, the datasets' features matched to the policy and the env; starts
    nothing and reads only the datasets' metadata. Each stage names every problem it finds."""
    from omegaconf import OmegaConf

    from rlinf_vla.config import named_section

    check_sections(cfg, ("cluster", "env", "policy", "data", "sft", "runner"))
    env_name, env = named_section(cfg["env"], "env")
    policy_name, policy = named_section(cfg["policy"], "policy")
    built, env_cfg, datasets = _sections(cfg, env_name, env)
    data: DataConfig = built["data"]
    _check_datasets(data, datasets)
    settings, pol_cfg = _policy_from_data(policy_name, policy, data, datasets)
    reads_state = bool(getattr(pol_cfg, "use_proprio", True)) and data.state is not None
    errors = SectionErrors()
    features = _map_datasets(data, datasets, pol_cfg, reads_state, errors)
    if env_cfg is not None:  # the evaluation's env must take what the policy and the data give
        _check_eval_env(env_name, env_cfg, pol_cfg, reads_state, errors)
    errors.raise_any()
    policy, pol_cfg, counts = _with_statistics(policy_name, settings, data, datasets, reads_state)
    sft: SFTConfig = built["sft"]
    _check_devices(sft, built["cluster"])
    if built["runner"].eval_interval and built["runner"].eval_videos:
        from rlinf_vla.envs.video import require_ffmpeg

        try:
            require_ffmpeg("set runner.eval_videos=false")
        except RuntimeError as e:
            raise ConfigError(f"runner.eval_videos=true: {e}") from None
    return SFTJob(
        cluster=built["cluster"],
        env_name=env_name,
        env=env,
        policy_name=policy_name,
        policy=policy,
        data=data,
        sft=sft,
        runner=built["runner"],
        features=features,
        counts=counts,
        env_config=env_cfg,
        policy_config=pol_cfg,
        raw=OmegaConf.to_container(cfg, resolve=True),
    )


def _sections(
    cfg: Any, env_name: str, env: dict[str, Any]
) -> tuple[dict[str, Any], Any, list[Any]]:
    """The typed sections, the evaluation's env config (``None`` without an evaluation) and
    the opened datasets."""
    from rlinf_vla.envs import env_section_config

    errors = SectionErrors()
    built = {
        k: errors.build(lambda k=k, c=c: from_section(c, cfg[k], k))
        for k, c in (
            ("cluster", ClusterConfig),
            ("data", DataConfig),
            ("sft", SFTConfig),
            ("runner", SFTRunnerConfig),
        )
    }

    # Without an evaluation no env is built (nor its simulator imported): the dataset alone
    # decides the policy's sizes (real-robot data of any action and state size).
    runner = built["runner"]
    evaluates = runner is None or bool(runner.eval_interval or runner.eval_at_start)
    env_cfg = errors.build(lambda: env_section_config(env_name, env)) if evaluates else None
    datasets = errors.build(lambda: _open(built["data"].paths)) if built["data"] else None
    errors.raise_any()
    return built, env_cfg, datasets


def _check_datasets(data: DataConfig, datasets: list[Any]) -> None:
    """Every dataset has the features ``data`` names, usable statistics, finite values and
    videos that deliver their frames."""
    from rlinf_vla.data import DatasetError

    first = datasets[0]
    if data.action not in first.features:
        raise ConfigError(
            f"data.action={data.action!r} is not a feature of {data.paths[0]} "
            f"(its features: {sorted(first.features)})"
        )
    errors = SectionErrors()
    for path, ds in zip(data.paths, datasets, strict=True):
        if data.state is not None and data.state not in ds.features:
            tabular = sorted(k for k, f in ds.features.items() if f.get("dtype") == "float32")
            errors.add(
                f"data.state={data.state!r} is not a feature of {path} (its float features: "
                f"{tabular}): set data.state=<one of them>, or data.state=null to train "
                "without the robot's state"
            )
        read = [f for f in (data.action, data.state) if f is not None and f in ds.features]
        for feature in read:
            problem = _stats_problem(ds.stats, feature)
            if problem:
                errors.add(f"data.paths: {path}: {problem}")
        # every value, before anything starts (the tabular columns only: no video decoded)
        try:
            problem = value_problem(path, ds.load_tabular(), read)
        except DatasetError as e:
            problem = f"{path}: {e}"
        if problem:
            errors.add(f"data.paths: {problem}")
        for problem in ds.video_problems():  # each video delivers its last needed frame
            errors.add(f"data.paths: {path}: {problem}")
    errors.raise_any()


def _policy_from_data(
    policy_name: str, policy: dict[str, Any], data: DataConfig, datasets: list[Any]
) -> tuple[dict[str, Any], Any]:
    """The policy's settings and config: the first dataset decides its action (and proprio)
    size and cameras unless a checkpoint or the command line (``policy``) does."""
    from rlinf_vla.policies import POLICIES
    from rlinf_vla.policies.resolve import policy_config_for

    settings = dict(policy)  # what the command line set
    first = datasets[0]
    action_dim = int(first.features[data.action]["shape"][0])
    state_dim = (
        int(first.features[data.state]["shape"][0])
        if data.state and data.state in first.features
        else None
    )
    cls = POLICIES[policy_name].cls if policy_name in POLICIES else None
    if not policy.get("checkpoint"):
        # keys the command line did not set follow the data
        from_data: dict[str, Any] = {"action_dim": action_dim}
        if cls is not None and "proprio_dim" in cls.config_cls.__dataclass_fields__:
            from_data |= {"proprio_dim": state_dim or 1, "use_proprio": state_dim is not None}
        if "image_keys" not in policy and cls is not None:
            from_data["image_keys"] = _cameras_from_data(
                first.cameras, data.cameras, policy.get("image_keys")
            )
        settings.update({k: v for k, v in from_data.items() if k not in policy})
    errors = SectionErrors()
    pol_cfg = errors.build(lambda: policy_config_for(policy_name, settings))
    errors.raise_any()
    padded = getattr(pol_cfg, "max_state_dim", None)
    if (
        not policy.get("checkpoint")
        and "max_state_dim" not in policy
        and padded is not None
        and state_dim is not None
        and state_dim > padded
    ):
        # π0 / π0.5 zero-pad the state to max_state_dim: a fresh model grows it to the data's
        settings["max_state_dim"] = state_dim
        pol_cfg = errors.build(lambda: policy_config_for(policy_name, settings))
        errors.raise_any()
    return settings, pol_cfg


def _map_datasets(
    data: DataConfig, datasets: list[Any], pol_cfg: Any, reads_state: bool, errors: SectionErrors
) -> list[FeatureMap]:
    """Each dataset's features mapped to what the policy reads, and its sizes checked against
    the policy's (problems go to ``errors``)."""
    cameras = tuple(pol_cfg.image_keys)
    features = []
    for path, ds in zip(data.paths, datasets, strict=True):
        fmap = errors.build(
            lambda path=path, ds=ds: map_features(
                path,
                ds.features,
                cameras,
                data.cameras,
                data.state if reads_state else None,
                data.action,
            )
        )
        features.append(fmap)
        if data.action in ds.features:
            dim = int(ds.features[data.action]["shape"][0])
            if dim != pol_cfg.action_dim:
                errors.add(
                    f"data.paths: {path}: its actions have {dim} dims, the policy "
                    f"{pol_cfg.action_dim} (policy.action_dim)"
                )
        proprio = getattr(pol_cfg, "proprio_dim", None)
        padded = getattr(pol_cfg, "max_state_dim", None)
        if reads_state and data.state in ds.features:
            dim = int(ds.features[data.state]["shape"][0])
            if proprio is not None and dim != proprio:
                errors.add(
                    f"data.paths: {path}: its state has {dim} dims, the policy reads {proprio} "
                    "(policy.proprio_dim)"
                )
            if padded is not None and dim > padded:
                errors.add(
                    f"data.paths: {path}: its state has {dim} dims, more than the policy's "
                    f"policy.max_state_dim={padded}"
                )
    return features


def _check_eval_env(
    env_name: str, env_cfg: Any, pol_cfg: Any, reads_state: bool, errors: SectionErrors
) -> None:
    """The evaluation's env takes the policy's actions and gives its cameras and state."""
    from rlinf_vla.fit import state_problems

    no_eval = "; or runner.eval_interval=0 to train without evaluating"
    env_dim = getattr(env_cfg, "action_dim", None)
    if env_dim is not None and env_dim != pol_cfg.action_dim:
        errors.add(
            f"env {env_name!r} takes {env_dim}-dim actions, the policy and data "
            f"{pol_cfg.action_dim}: evaluate in the env the demonstrations come from" + no_eval
        )
    if reads_state:
        for message in state_problems(env_name, env_cfg, pol_cfg):
            errors.add(message + no_eval)
    missing = [c for c in pol_cfg.image_keys if c not in env_cfg.cameras]
    if missing:
        errors.add(
            f"the policy reads camera(s) {missing} that env {env_name!r} does not provide "
            f"for the evaluation (its cameras: {list(env_cfg.cameras)})" + no_eval
        )


def _with_statistics(
    policy_name: str,
    settings: dict[str, Any],
    data: DataConfig,
    datasets: list[Any],
    reads_state: bool,
) -> tuple[dict[str, Any], Any, dict[str, int]]:
    """The policy's settings and config with the datasets' combined statistics (what trains),
    and the datasets' ``frames`` and ``episodes``."""
    from rlinf_vla.policies import POLICIES
    from rlinf_vla.policies.resolve import policy_config_for

    frames = [ds.num_frames for ds in datasets]
    counts = {"frames": sum(frames), "episodes": sum(len(ds.episodes) for ds in datasets)}

    def stats_of(feature: str) -> dict[str, list[float]]:
        return _stat_lists(
            combine_stats([(ds.stats[feature], n) for ds, n in zip(datasets, frames, strict=True)])
        )

    state_stats = stats_of(data.state) if reads_state else None
    policy = dict(settings)
    try:
        policy.update(
            POLICIES[policy_name].cls.statistics_config(
                _dataset_name(data.paths), stats_of(data.action), state_stats, counts
            )
        )
    except NotImplementedError as e:
        raise ConfigError(f"policy {policy_name!r}: {e}") from None
    if policy.get("dtype", "auto") == "auto":
        policy["dtype"] = "float32"  # float32 weights and AdamW state; sft.autocast computes
    return policy, policy_config_for(policy_name, policy), counts


def _check_devices(sft: SFTConfig, cluster: ClusterConfig) -> None:
    """``sft.devices`` names devices of the local cluster (counted without starting it) and
    the batch splits evenly over them; a remote cluster is checked when it starts."""
    from rlinf_vla.runtime.cluster import local_device_count
    from rlinf_vla.runtime.placement import parse_devices

    count = local_device_count(cluster)
    if count is None:
        return
    ranks = len(parse_devices(sft.devices, count, "sft.devices"))
    if sft.batch_size % ranks:
        raise ConfigError(
            f"sft.batch_size={sft.batch_size} does not split evenly over the {ranks} actor "
            f"workers of sft.devices={sft.devices!r}"
        )


class SFTRunner:
    """The actor workers (and one rollout worker for evaluation) of an :class:`SFTJob`."""

    def __init__(self, job: SFTJob, cluster: Any, checkpoint: Any = None) -> None:
        """``checkpoint``: the :class:`~rlinf_vla.run.checkpoints.Resume` a resumed run
        continues from (default: the newest complete checkpoint of ``runner.resume``)."""
        from rlinf_vla.pipelines.actor import ActorWorker
        from rlinf_vla.pipelines.rollout import RolloutWorker
        from rlinf_vla.run.checkpoints import resume_checkpoint
        from rlinf_vla.runtime import WorkerGroup, create_collective, wait_started
        from rlinf_vla.runtime.placement import parse_devices

        self.job, self.cluster = job, cluster
        devices = parse_devices(job.sft.devices, cluster.num_devices, "sft.devices")
        ranks = len(devices)
        if job.sft.batch_size % ranks:
            raise ConfigError(
                f"sft.batch_size={job.sft.batch_size} does not split evenly over the {ranks} "
                f"actor workers of sft.devices={job.sft.devices!r}"
            )
        r = job.runner
        self.output_dir = run_folder(r.name, r.output_dir, r.resume)
        if r.resume and checkpoint is None:
            checkpoint = resume_checkpoint(r.resume, "step")
        self.checkpoint = checkpoint
        policy = job.policy_config.replace(seed=r.seed)
        self.sharded = job.sft.fsdp and ranks > 1
        evaluates = bool(r.eval_interval or r.eval_at_start)
        print(
            f"starting {ranks} actor worker(s)"
            + (f" and an evaluation worker ({job.env_name})" if evaluates else "")
            + " ...",
            file=sys.stderr,
        )
        started = time.perf_counter()
        try:
            self.actor = WorkerGroup(
                cluster,
                ActorWorker,
                "actor",
                devices,
                args=(job.policy_name, policy, job.algo(ranks), r.seed),
                wait=False,
            )
            self.rollout = None
            if evaluates:
                self.rollout = WorkerGroup(
                    cluster,
                    RolloutWorker,
                    "eval",
                    devices[:1],
                    args=(job.policy_name, policy, r.seed, job.sft.autocast),
                    wait=False,
                )
            wait_started([g for g in (self.actor, self.rollout) if g is not None])
            print(f"workers started in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            if self.rollout is not None:
                create_collective(WEIGHTS, [(self.actor, [0]), (self.rollout, None)])
            if self.sharded:
                create_collective(DATA_PARALLEL, [(self.actor, None)], as_default=True)
                self.actor.shard().wait()
            elif ranks > 1:
                create_collective(DATA_PARALLEL, [(self.actor, None)])
                self.actor.join_data_parallel(DATA_PARALLEL).wait()
            chunk = job.policy_config.chunk_size
            features = [to_dict(f) for f in job.features]
            t0 = time.perf_counter()
            self.loaded = self.actor.load_demonstrations(job.data.paths, features, chunk).wait()[0]
            self.load_s = time.perf_counter() - t0
            self.start_step = 0
            if self.checkpoint is not None:
                self.start_step = self._restore(self.checkpoint.path)
            self._synced: int | None = None
        except BaseException:
            self.shutdown()
            raise

    def header(self) -> list[str]:
        from rlinf_vla.run.loop import count_text, device_summary

        job = self.job
        counts = self.actor.parameter_counts(ranks=[0]).wait()[0]
        pol = job.policy_config
        source = (
            f"from {pol.checkpoint}" if pol.checkpoint else f"preset {pol.preset}, random weights"
        )
        fsdp = " (FSDP)" if self.sharded else ""
        return [
            f"rlinf-vla sft: {job.sft.steps} steps of {job.sft.batch_size} frames from "
            f"{self.loaded['episodes']} episodes / {self.loaded['frames']} frames "
            f"({len(job.data.paths)} dataset(s), read in {self.load_s:.1f} s)",
            f"policy {job.policy_name} ({source}): {count_text(counts['total'])} parameters, "
            f"{count_text(counts['trained'])} trained",
            f"{self.actor.world_size} actor worker(s){fsdp} on "
            f"{device_summary(self.cluster.devices)}; "
            + (f"evaluation in {job.env_name}" if job.env_config else "no evaluation"),
        ]

    def run(self) -> Path:
        from rlinf_vla.run.loop import RunLoop
        from rlinf_vla.runtime import wait_all

        job, r = self.job, self.job.runner
        loop = RunLoop(
            self.output_dir,
            job.raw,
            r.logging,
            command="sft",
            unit="step",
            total=job.sft.steps,
            save_interval=r.save_interval,
            max_nan_updates=r.max_nan_updates,
            devices=[str(d) for d in self.cluster.devices],
            header=self.header(),
            last_checkpoint=None if self.checkpoint is None else self.checkpoint.path,
            settings=job.settings(),
        )

        def step(i: int, logger: Any, say: Any) -> dict[str, Any]:
            t0 = time.perf_counter()
            per_rank = wait_all(
                [
                    self.actor.sft_step(i, job.sft.steps, ranks=[a])
                    for a in range(self.actor.world_size)
                ]
            )
            metrics = _average([m[0] for m in per_rank])
            metrics = {"iteration": i + 1, **metrics, "time/step_s": time.perf_counter() - t0}
            metrics["throughput/frames_per_s"] = job.sft.batch_size / metrics["time/step_s"]
            if r.eval_interval and (i + 1) % r.eval_interval == 0:
                say("greedy evaluation ...")
                metrics.update(self.evaluate(i + 1, logger))
            return metrics

        def before(logger: Any, say: Any) -> str | None:
            if not (r.eval_at_start and self.start_step == 0 and self.rollout is not None):
                return None
            say("greedy evaluation of the starting policy ...")
            m = self.evaluate(0, logger)
            logger.log({"iteration": 0, **m})
            return f"step 0: greedy success {m['eval/success_rate']:.2f}"

        return loop.run(self.start_step, step, self.save, _status, before=before)

    def evaluate(self, step: int, logger: Any) -> dict[str, float]:
        """Greedy episodes of the weights after ``step`` steps on held-out scenes."""
        from rlinf_vla.pipelines.evaluation import evaluate_on_worker
        from rlinf_vla.runtime import wait_all

        assert self.rollout is not None
        r = self.job.runner
        t0 = time.perf_counter()
        if self._synced != step:
            wait_all(
                [
                    self.actor.sync_to(WEIGHTS, ranks=None if self.sharded else [0]),
                    self.rollout.sync_from(WEIGHTS, step),
                ]
            )
            self._synced = step
        metrics = evaluate_on_worker(
            self.rollout,
            self.job.env_name,
            self.job.env_config,
            r,
            self.output_dir / "videos" / f"step_{step}",
            logger,
            step,
        )
        return {**metrics, "time/eval_s": time.perf_counter() - t0}

    def save(self, step: int) -> Path:
        from rlinf_vla.run.checkpoints import begin_checkpoint, finish_checkpoint

        path = begin_checkpoint(self.output_dir / "checkpoints" / f"step_{step}")
        self.actor.save(str(path)).wait()  # the actor workers (on this machine) have finished
        return finish_checkpoint(path, step)

    def _restore(self, path: Path) -> int:
        self.actor.load(str(path)).wait()
        return int(path.name.split("_")[1])

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker. ``graceful``: first let the rollout workers close their
        evaluation envs; a run that stopped on an error or a signal skips that (a stalled or
        blocked worker would not answer)."""
        if graceful and getattr(self, "rollout", None) is not None:
            with contextlib.suppress(Exception):
                self.rollout.close().wait(timeout=60)
        for name in ("actor", "rollout"):
            group = getattr(self, name, None)
            if group is not None:
                group.shutdown()


def _average(per_rank: list[dict[str, float]]) -> dict[str, float]:
    out = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
    out["train/skipped_updates"] = sum(m["train/skipped_updates"] for m in per_rank)
    out["train/nan_streak"] = max(m["train/nan_streak"] for m in per_rank)
    return out


def _status(metrics: dict[str, Any]) -> str:
    text = f"loss {metrics['train/loss']:.4f}"
    if "eval/success_rate" in metrics:
        text += f"  success {metrics['eval/success_rate']:.2f}"
    return text


def run(job: SFTJob) -> Path:
    """``rlinf-vla sft``: start the cluster, clone, print where the outputs are."""

    from rlinf_vla.run.checkpoints import prepare_resume
    from rlinf_vla.runtime import Cluster

    # A resume's config and checkpoint are checked before anything starts.
    checkpoint = prepare_resume(
        job.runner.resume,
        job.raw,
        "step",
        lambda line: print(line, file=sys.stderr),
        settings=job.settings(),
    )
    torch.manual_seed(job.runner.seed)
    with Cluster(job.cluster) as cluster:
        runner = SFTRunner(job, cluster, checkpoint)
        try:
            out = runner.run()
        except BaseException:
            runner.shutdown(graceful=False)
            raise
        runner.shutdown()
    print(f"run folder: {out}  (metrics.jsonl, config.yaml, checkpoints/step_<N>/policy)")
    return out

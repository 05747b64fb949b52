"""The ``rlinf-vla eval`` job: the ``eval`` section, the trial plan and the pre-flight checks.

:func:`validate` is pure: it types every section, checks that the policy fits the env (cameras,
action size, proprio size; from the checkpoint's own config files when one is given) and plans
the trials, without starting any process.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from rlinf_vla.config import (
    ConfigError,
    SectionErrors,
    check_at_least,
    check_sections,
    from_section,
    named_section,
)
from rlinf_vla.envs import ENVS, env_section_config
from rlinf_vla.eval import protocol as protocols
from rlinf_vla.eval.stats import condition
from rlinf_vla.fit import fit_problems, for_policy
from rlinf_vla.policies.resolve import policy_config_for
from rlinf_vla.runtime.cluster import ClusterConfig


@dataclass
class EvalConfig:
    """The ``eval`` section.

    Attributes:
        protocol: ``official`` (LIBERO: the official evaluation loop's episode for every
            (task, init state), and its env settings, checked), ``package`` (the env settings
            as given, unchecked) or ``None`` (LIBERO: ``official``; other envs: ``package``,
            their only protocol). See :mod:`rlinf_vla.eval.protocol`.
        trials_per_task: trials of every task. LIBERO: init states ``0 .. n - 1`` of each task,
            each used once (at most 50; 50 is the standard protocol). Other envs: seeds
            ``seed .. seed + n - 1``.
        tasks: ManiSkill task ids to evaluate (``None``: ``env.task``). LIBERO selects tasks
            with ``env.suite`` and ``env.task_ids``.
        seed: first seed of the trials of envs whose trials are seeds (ManiSkill, toy; LIBERO
            and MetaWorld run fixed scenes); also seeds torch for sampled actions.
        greedy: deterministic actions (the mode / argmax); ``false`` samples.
        output_dir: the results folder (``None``: ``runs/eval-<env>-<timestamp>``). Re-running
            into the same folder skips the trials already finished there.
        videos: MP4 per trial: ``none``, ``failures`` (failed and error trials) or ``all``.
        video_fps: frames per second of the videos.
        envs_per_worker: envs each Ray env worker holds (``env.num_envs`` envs in total).
        retries: how often a trial whose simulator crashed is run again before it is recorded
            as an error.
        device: torch device of the policy (``auto``: ``cuda`` when available, else ``cpu``).
        policy_threads: torch CPU threads of the policy in the driver (``None``: the cores left
            over by the env processes, at least 1; more threads than free cores make torch's
            thread pool spin against the simulators, many times slower).
        progress: show a progress bar (trials done and success rate per suite).
        perturbation: LIBERO only: the out-of-distribution variants to evaluate, one kind or a
            list (``[none, ood_object, ood_language]``): ``none`` (the tasks as they are) and
            LIBERO-PRO's kinds (:mod:`rlinf_vla.envs.libero.perturb`). Every kind runs the
            same tasks and init states; results keep each kind apart and compare it with
            ``none``. ``None``: the unperturbed tasks only, no comparison.
        perturbation_seed: the seed each task's variant (and its re-placed scenes) is drawn
            with; another seed gives other variants where LIBERO-PRO has several.
    """

    protocol: str | None = None
    trials_per_task: int = 50
    tasks: list[str] | None = None
    seed: int = 0
    greedy: bool = True
    output_dir: str | None = None
    videos: Literal["none", "failures", "all"] = "none"
    video_fps: int = 10
    envs_per_worker: int = 1
    retries: int = 1
    device: str = "auto"
    policy_threads: int | None = None
    progress: bool = True
    perturbation: str | list[str] | None = None
    perturbation_seed: int = 0

    def __post_init__(self) -> None:
        positive = ("trials_per_task", "envs_per_worker", "video_fps", "policy_threads")
        check_at_least(self, "eval", positive, 1)
        if self.protocol is not None and self.protocol not in protocols.PROTOCOLS:
            raise ConfigError(
                f"eval.protocol={self.protocol!r}: known protocols: "
                f"{', '.join(protocols.PROTOCOLS)} (or null: the env's default)"
            )
        if self.retries < 0:
            raise ConfigError(f"eval.retries must be >= 0, got {self.retries}")
        if self.seed < 0:
            raise ConfigError(f"eval.seed must be >= 0, got {self.seed}")
        if self.tasks is not None and not self.tasks:
            raise ConfigError("eval.tasks must name at least one task (or be null)")
        self._check_perturbation()

    def _check_perturbation(self) -> None:
        """``perturbation`` as a list of known kinds, each once."""
        if self.perturbation_seed < 0:
            raise ConfigError(f"eval.perturbation_seed must be >= 0, got {self.perturbation_seed}")
        if self.perturbation is None:
            return
        kinds = [self.perturbation] if isinstance(self.perturbation, str) else self.perturbation
        known = ("none", *_perturbation_kinds())
        unknown = [k for k in kinds if k not in known]
        if unknown or not kinds:
            raise ConfigError(
                f"eval.perturbation: unknown perturbation(s) {unknown or kinds}; known: "
                f"{', '.join(known)} ('none': the tasks unperturbed), one or a list, e.g. "
                "eval.perturbation=[none,ood_object]"
            )
        twice = sorted({k for k in kinds if kinds.count(k) > 1})
        if twice:
            raise ConfigError(f"eval.perturbation lists {twice} more than once")
        self.perturbation = list(kinds)

    @property
    def perturbations(self) -> list[str]:
        """The kinds to evaluate (empty without ``perturbation``)."""
        return list(self.perturbation or [])


def _perturbation_kinds() -> tuple[str, ...]:
    """Every env's perturbation kinds (:meth:`~rlinf_vla.envs.base.EnvConfig.eval_perturbations`),
    each once, in the order the envs are registered."""
    kinds = {k: None for cls in ENVS.values() for k in cls.config_cls.eval_perturbations()}
    return tuple(kinds)


@dataclass(frozen=True)
class Trial:
    """One planned episode.

    Attributes:
        suite: LIBERO suite of the task, or the env name for other envs.
        task: the task's name (LIBERO task name, ManiSkill env id, ``toy``).
        task_index: index of the task in its suite (LIBERO) or in ``eval.tasks``.
        init_state: LIBERO init-state index, or the seed of other envs.
        reset_id: the id the env is reset with (selects the task and scene deterministically).
        env_key: env config overrides of this trial's env (ManiSkill: ``{"task": id}``), as a
            sorted tuple of items; trials with the same key run in the same env.
    """

    suite: str
    task: str
    task_index: int
    init_state: int
    reset_id: int
    env_key: tuple[tuple[str, Any], ...] = ()
    perturbation: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        """What identifies a trial in the results (resume skips finished keys)."""
        return (self.suite, self.task, self.init_state, self.perturbation)

    @property
    def task_key(self) -> tuple[str, str, str | None]:
        """The task a trial runs (a perturbed variant is another task)."""
        return (self.suite, self.task, self.perturbation)

    @property
    def condition(self) -> str:
        """The results row of the trial: its suite, or ``<suite>/<perturbation>``."""
        return condition({"suite": self.suite, "perturbation": self.perturbation})


@dataclass
class EvalJob:
    """A validated ``rlinf-vla eval`` job.

    ``env_config`` and ``policy_config`` are the typed configs the env workers and the policy
    are built from (the policy's with its device and, with a checkpoint, the checkpoint's
    config under the command line's keys); ``env`` and ``policy`` hold the keys the command
    line set, which make the job's identity.
    """

    cluster: ClusterConfig
    env_name: str
    env: dict[str, Any]
    policy_name: str
    policy: dict[str, Any]
    eval: EvalConfig
    env_config: Any = None  # the env section resolved (num_envs: the envs run in parallel)
    policy_config: Any = None  # the policy as it is built, on its device
    trials: list[Trial] = field(default_factory=list)
    output_dir: str = ""
    identity: dict[str, Any] = field(default_factory=dict)
    protocol: dict[str, Any] = field(default_factory=lambda: {"name": "package"})
    perturbation: dict[str, Any] | None = None


# ------------------------------------------------------------------------------- validation
def check_fit(env_name: str, env_cfg: Any, pol: Any) -> None:
    """The policy's cameras, action size and proprio size must fit the env
    (:func:`~rlinf_vla.fit.fit_problems`)."""
    problems = fit_problems(env_name, env_cfg, pol)
    if problems:
        raise ConfigError("; ".join(problems))


def _default_output_dir(env_name: str, env_cfg: Any) -> str:
    import time

    what = getattr(env_cfg, "suite", None) or getattr(env_cfg, "task", None) or env_name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"eval-{env_name}-{str(what).lower()}-{stamp}")


def validate(cfg: Any) -> EvalJob:
    """Typed sections, policy/env fit and the trial plan for a composed ``eval`` config.

    Starts nothing (it may read the checkpoint's config files and the LIBERO task list).

    Raises:
        ConfigError: naming the offending key: an unknown section or key, an unknown LIBERO
            suite (listing the known ones) or ManiSkill task, a missing checkpoint, a policy
            whose cameras, action size or proprio size do not fit the env.
    """
    check_sections(cfg, ("cluster", "env", "policy", "eval"))
    env_name, env = named_section(cfg["env"], "env")
    policy_name, policy = named_section(cfg["policy"], "policy")
    if env_name not in ENVS:
        raise ConfigError(f"env.name: unknown env {env_name!r}; known envs: {sorted(ENVS)}")
    errors = SectionErrors()  # the independent sections are all checked before raising
    ev = errors.build(lambda: from_section(EvalConfig, cfg.get("eval"), "eval"))
    cluster = errors.build(lambda: from_section(ClusterConfig, cfg["cluster"], "cluster"))
    errors.raise_any()
    if ev.videos != "none":
        from rlinf_vla.envs.video import require_ffmpeg

        try:
            require_ffmpeg("set eval.videos=none")
        except RuntimeError as e:
            raise ConfigError(f"eval.videos={ev.videos}: {e}") from None
    protocol = protocols.resolve(env_name, ev.protocol)
    _check_perturbation_keys(env_name, env, ev)
    # The eval drives every env itself: one env per slot, resets chosen per trial.
    env["group_size"] = 1
    slots_cfg = env_section_config(env_name, env)  # num_envs: the envs run in parallel
    env_cfg = env_section_config(env_name, {}, slots_cfg, num_envs=1)  # each env's own config
    try:  # the env's own checks of eval.tasks and eval.trials_per_task
        run_configs = env_cfg.eval_configs(env_name, ev.tasks, ev.trials_per_task)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not policy.get("checkpoint") and policy.get("seed") is None:
        policy["seed"] = ev.seed  # random (preset) weights: the same ones on every run
    try:  # the env's own check of its settings against the protocol
        env_cfg.check_protocol(protocol)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pol = policy_config_for(policy_name, policy)
    for task, run_cfg in run_configs:  # e.g. each ManiSkill task with its own robot
        try:
            check_fit(env_name, run_cfg, pol)
        except ConfigError as e:
            raise ConfigError(f"task {task}: {e}" if task is not None else str(e)) from None
    job = EvalJob(
        cluster=cluster,
        env_name=env_name,
        env=env,
        policy_name=policy_name,
        policy=policy,
        eval=ev,
        env_config=for_policy(slots_cfg, pol),  # a camera that nothing reads is not rendered
        policy_config=pol.replace(device=_policy_device(policy, ev)),
        output_dir=ev.output_dir or _default_output_dir(env_name, env_cfg),
        protocol=env_cfg.protocol_record(protocol),
    )
    job.trials = plan_trials(env_name, env_cfg, ev)
    if ev.perturbation is not None:
        job.perturbation, job.trials = plan_perturbed(env_name, env_cfg, ev, job.trials)
    job.identity = identity(job)
    from rlinf_vla.eval.report import check_identity

    check_identity(job.output_dir, job.identity, write=False)
    return job


def _policy_device(policy: dict[str, Any], ev: EvalConfig) -> str:
    """``policy.device`` when set, else ``eval.device`` (``auto``: ``cuda`` when available)."""
    if "device" in policy:
        return str(policy["device"])
    if ev.device != "auto":
        return ev.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------- trial plan
def plan_trials(env_name: str, env_cfg: Any, ev: EvalConfig) -> list[Trial]:
    """Every trial of the evaluation, task by task, as the env plans them
    (:meth:`~rlinf_vla.envs.base.EnvConfig.eval_trials`: LIBERO's official init states,
    seeds elsewhere)."""
    trials = env_cfg.eval_trials(env_name, ev.tasks, ev.trials_per_task, ev.seed)
    return [Trial(**t) for t in trials]


def identity(job: EvalJob) -> dict[str, Any]:
    """The settings that decide a trial's outcome; a folder's results are only resumed by a
    job with the same identity (the number of trials, workers and videos may change)."""
    env = {k: v for k, v in job.env.items() if k not in ("num_envs", "video_fps", "video_dir")}
    policy = {k: v for k, v in job.policy.items() if k not in ("device",)}
    return {
        "env_name": job.env_name,
        "env": env,
        "policy_name": job.policy_name,
        "policy": policy,
        "greedy": job.eval.greedy,
        # the seed draws the trials of some envs, and the actions of a sampled evaluation
        "seed": job.eval.seed if job.env_config.eval_uses_seed or not job.eval.greedy else None,
        "protocol": job.protocol,
        **(
            {"perturbation_seed": job.eval.perturbation_seed}
            if any(k != "none" for k in job.eval.perturbations)
            else {}
        ),
    }


# ------------------------------------------------------------------------------- perturbations
def _check_perturbation_keys(env_name: str, env: dict[str, Any], ev: EvalConfig) -> None:
    """``eval.perturbation`` needs an env with perturbations
    (:meth:`~rlinf_vla.envs.base.EnvConfig.eval_perturbations`); the env's own perturbation
    keys are set per trial."""
    if ev.perturbation is not None and not ENVS[env_name].config_cls.eval_perturbations():
        with_some = sorted(n for n, c in ENVS.items() if c.config_cls.eval_perturbations())
        raise ConfigError(
            f"eval.perturbation={ev.perturbation}: env {env_name!r} has no perturbations "
            f"(envs with some: {', '.join(with_some)})"
        )
    given = [k for k in ("perturbation", "perturbation_seed") if env.get(k) is not None]
    if given:
        raise ConfigError(
            f"env.{given[0]}: rlinf-vla eval sets the env's perturbation per trial; use "
            f"eval.{given[0]} instead"
        )


def plan_perturbed(
    env_name: str, env_cfg: Any, ev: EvalConfig, trials: list[Trial]
) -> tuple[dict[str, Any], list[Trial]]:
    """The trials of every kind of ``eval.perturbation``, in its order (``none``: ``trials``
    as they are; the others as the env plans them:
    :meth:`~rlinf_vla.envs.base.EnvConfig.plan_perturbations`), and what the run records
    about them (the kinds, the seed and the env's record).

    Raises:
        ConfigError: a kind the env cannot plan (LIBERO: no variant of any selected task).
    """
    seed = ev.perturbation_seed
    kinds = [k for k in ev.perturbations if k != "none"]
    try:
        info, variants = env_cfg.plan_perturbations(
            env_name, kinds, seed, [dataclasses.asdict(t) for t in trials]
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    planned: list[Trial] = []
    for name in ev.perturbations:
        planned += trials if name == "none" else [Trial(**t) for t in variants[name]]
    return {"kinds": ev.perturbations, "seed": seed, **info}, planned

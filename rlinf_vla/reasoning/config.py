"""The ``rlinf-vla math-grpo`` job: its sections, their typed configs and the cross-checks.

Sections: ``model`` (:class:`~rlinf_vla.reasoning.model.ModelConfig`), ``data``
(:class:`~rlinf_vla.reasoning.data.DataConfig`), ``algo`` (:class:`MathAlgoConfig`),
``placement`` (:class:`MathPlacementConfig`), ``runner`` (:class:`MathRunnerConfig`) and
``cluster``. Validation is pure: nothing is loaded or started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rlinf_vla.algos import KL_ESTIMATORS
from rlinf_vla.algos.presets import (
    ALGORITHMS,
    AlgorithmPreset,
    AlgorithmSection,
    ineffective_keys,
)
from rlinf_vla.config import (
    ConfigError,
    SectionErrors,
    check_at_least,
    check_sections,
    from_section,
)
from rlinf_vla.reasoning.data import DataConfig
from rlinf_vla.reasoning.model import ModelConfig
from rlinf_vla.run.tracking import LoggingConfig, resolve_resume
from rlinf_vla.runtime.cluster import ClusterConfig
from rlinf_vla.runtime.placement import (
    Placement,
    PlacementConfig,
    parse_devices,
    resolve_placement,
)

COMPONENTS = ("rollout", "actor", "reward")


@dataclass
class MathAlgoConfig(AlgorithmSection):
    """The ``algo`` section of ``rlinf-vla math-grpo``.

    ``name`` (``grpo``, ``dapo``, ``reinforce_pp``, ``rloo`` or ``ppo``) and the preset keys: see
    :class:`~rlinf_vla.algos.presets.AlgorithmSection`. Per advantage: ``grpo`` / ``rloo`` compare the
    responses to one prompt; ``reinforce_pp`` whitens the score on each response's last token
    over the batch; ``gae`` (PPO) trains a value head on the model's last hidden states and
    estimates per-token advantages (discount ``gamma``, ``lam`` per token).

    Attributes:
        group_size: responses sampled per prompt (a GRPO group).
        prompts_per_step: prompts per training step (DAPO: groups kept after filtering).
        max_new_tokens: generation limit per response.
        temperature, top_p, top_k: sampling settings of the rollout (``top_k=0``: off).
        stop_strings: a response also ends once it contains one of these.
        lr: AdamW learning rate; ``weight_decay``, ``betas`` its other settings.
        value_lr: PPO: the value head's learning rate.
        value_coef, value_clip: PPO: weight and clipping range of the value loss.
        normalize_advantages: PPO: whiten the GAE advantages over the batch's tokens.
        warmup_steps: linear learning-rate warm-up from 0 over this many steps.
        max_grad_norm: gradient clipping (``0``: off).
        update_epochs: passes over each batch; more than 1 makes the update off-policy and
            needs the rollout-time log-probs (one extra forward pass per batch).
        minibatch_size: responses per optimizer step (``0``: the whole batch, one step).
        micro_batch_size: responses per forward/backward pass (gradient accumulation).
        kl_coef: weight of the KL to the frozen initial policy (``0``: no reference model).
            Added as a loss term, or folded into the reward where the preset says
            ``kl_in_reward`` (REINFORCE++).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        format_weight: reward for a ``\\boxed{}`` answer, added to the 0/1 correctness.
        overlong_penalty_factor: DAPO's overlong penalty at the limit (with
            ``overlong_buffer``).
        max_sample_rounds: with dynamic sampling: sampling rounds per step to fill
            ``prompts_per_step`` groups whose rewards are not all equal.
        skip_zero_advantage: responses whose advantage is exactly 0 (GRPO groups where every
            response scored the same) contribute no gradient; skip their forward and backward
            passes. The loss keeps its normalisation, so the update is unchanged. Only applies
            without a KL or value term.
        fallback_last_number: an answer without ``\\boxed{}`` or an "answer is" phrase is read
            from the last number of the response.
    """

    name: str = "grpo"
    # the trainer's keys
    group_size: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 96
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: list[str] = field(default_factory=list)
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    value_lr: float = 1e-4
    value_coef: float = 0.5
    value_clip: float | None = None
    normalize_advantages: bool = True
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    update_epochs: int = 1
    minibatch_size: int = 0
    micro_batch_size: int = 8
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    format_weight: float = 0.0
    overlong_penalty_factor: float = 1.0
    max_sample_rounds: int = 3
    skip_zero_advantage: bool = True
    fallback_last_number: bool = True

    #: trainer keys that change something only for some algorithms: key -> (test, why)
    CONDITIONAL: ClassVar[dict[str, tuple[Callable[[AlgorithmPreset], bool], str]]] = {
        **AlgorithmSection.CRITIC_KEYS,
        "max_sample_rounds": (lambda p: p.dynamic_sampling, "refills dynamic sampling"),
        "overlong_penalty_factor": (
            lambda p: bool(p.overlong_buffer),
            "scales the overlong penalty (overlong_buffer)",
        ),
    }

    def __post_init__(self) -> None:
        bad_preset = self.fill_preset()
        if bad_preset:
            raise ConfigError(bad_preset)
        if self.imitation:
            raise ConfigError(
                f"algo={self.name} learns from an env's scripted expert: it runs in "
                "`rlinf-vla train` only; math-grpo takes the RL algorithms "
                f"{[n for n in ALGORITHMS.names() if not ALGORITHMS[n].imitation]}"
            )
        KL_ESTIMATORS[self.kl_estimator]
        positive = ("prompts_per_step", "max_new_tokens", "update_epochs", "micro_batch_size")
        check_at_least(self, "algo", (*positive, "max_sample_rounds"), 1)
        if self.group_size < 1 or (self.uses_groups and self.group_size < 2):
            raise ConfigError(
                f"algo.group_size must be >= 2 for {self.name} (it compares the responses to "
                f"one prompt), got {self.group_size}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("algo: need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if self.lr <= 0 or self.value_lr <= 0:
            raise ConfigError("algo.lr and algo.value_lr must be > 0")
        if self.kl_coef < 0 or self.max_grad_norm < 0 or self.minibatch_size < 0:
            raise ConfigError("algo: need kl_coef, max_grad_norm, minibatch_size >= 0")
        if self.value_coef < 0 or (self.value_clip is not None and self.value_clip <= 0):
            raise ConfigError("algo: need value_coef >= 0 and value_clip > 0 or null")
        if len(self.betas) != 2 or not all(
            isinstance(b, int | float) and 0.0 <= b < 1.0 for b in self.betas
        ):
            raise ConfigError(
                f"algo.betas must be two numbers in [0, 1) (AdamW's decay rates), got {self.betas}"
            )

    @property
    def batch_size(self) -> int:
        """Responses per step."""
        return self.prompts_per_step * self.group_size

    @property
    def overlong_tokens(self) -> int:
        """The length of DAPO's overlong ramp in tokens (0: no penalty)."""
        return round((self.overlong_buffer or 0.0) * self.max_new_tokens)

    @property
    def on_policy(self) -> bool:
        """One optimizer step per batch: the rollout-time log-probs equal the current ones."""
        return self.update_epochs == 1 and self.minibatch_size in (0, self.batch_size)


@dataclass
class MathPlacementConfig(PlacementConfig):
    """The ``placement`` section: devices of the ``rollout``, ``actor`` and ``reward`` workers.

    ``collocated``: rollout and actor on the same devices, taking turns (on GPUs the idle
    model is moved to CPU memory between phases). ``disaggregated``: each on its own devices.
    The reward workers hold no model; they may share devices with either in both modes.
    """

    mode: Literal["collocated", "disaggregated"] = "collocated"

    def __post_init__(self) -> None:
        missing = [c for c in COMPONENTS if c not in self.components]
        if missing:
            raise ConfigError(
                f"placement.components is missing {missing} (rollout, actor and reward are placed)"
            )
        extra = sorted(set(self.components) - set(COMPONENTS))
        if extra:
            raise ConfigError(f"placement.components: unknown component(s) {extra}")

    def resolve(self, num_devices: int) -> Placement:
        """The devices of each component (the mode's rules apply to rollout and actor)."""
        models = PlacementConfig(
            self.mode, {k: v for k, v in self.components.items() if k != "reward"}
        )
        placed = resolve_placement(models, num_devices)
        reward = parse_devices(
            self.components["reward"], num_devices, "placement.components.reward"
        )
        return Placement(placed.mode, {**placed.devices, "reward": reward}, num_devices)


@dataclass
class MathRunnerConfig:
    """The ``runner`` section.

    Attributes:
        name: the run's name (default folder ``runs/<name>-<timestamp>``).
        max_steps: training steps (sample, score, update).
        seed: seed of sampling, the prompt order and the model init (random-init models).
        output_dir: the run folder (``None``: ``runs/<name>-<timestamp>``).
        resume: a run folder to continue from its last checkpoint, or ``auto``: continue
            ``output_dir`` if it has a checkpoint, else start it.
        save_interval: checkpoint every N steps (and at the end).
        keep_checkpoints: how many of the newest checkpoints to keep (older ones are deleted
            once a newer one is complete; ``0``: keep all). A SmolLM2-135M checkpoint takes
            about 1.6 GB (weights and AdamW state).
        eval_interval: greedy accuracy on the held-out split every N steps, and before the
            first step (``0``: never).
        eval_max_new_tokens: generation limit of the evaluation (``None``: algo.max_new_tokens).
        eval_batch_size: held-out prompts per generation batch.
        max_nan_updates: abort after this many skipped (non-finite) updates in a row.
        logging: TensorBoard / wandb besides ``metrics.jsonl``.
    """

    name: str = "math-grpo"
    max_steps: int = 30
    seed: int = 0
    output_dir: str | None = None
    resume: str | None = None
    save_interval: int = 5
    keep_checkpoints: int = 2
    eval_interval: int = 5
    eval_max_new_tokens: int | None = None
    eval_batch_size: int = 32
    max_nan_updates: int = 5
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        positive = ("max_steps", "save_interval", "eval_batch_size", "max_nan_updates")
        check_at_least(self, "runner", positive, 1)
        check_at_least(self, "runner", ("seed", "eval_interval", "keep_checkpoints"), 0)
        self.resume = resolve_resume(self.resume, self.output_dir, "step")


@dataclass
class MathGrpoJob:
    """A validated ``rlinf-vla math-grpo`` job."""

    cluster: ClusterConfig
    model: ModelConfig
    data: DataConfig
    algo: MathAlgoConfig
    placement: MathPlacementConfig
    runner: MathRunnerConfig
    resolved: Placement | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """Every setting, defaults included (:func:`~rlinf_vla.run.checkpoints
        .settings_of`): what a resume compares beside the command line's keys."""
        from rlinf_vla.run.checkpoints import settings_of

        names = ("cluster", "model", "data", "algo", "placement", "runner")
        return settings_of({name: getattr(self, name) for name in names})


def validate(cfg: Any) -> MathGrpoJob:
    """Typed configs and cross-checks for a composed ``math_grpo`` config; starts nothing."""
    from omegaconf import OmegaConf

    from rlinf_vla.runtime.cluster import local_device_count

    check_sections(cfg, ("cluster", "model", "data", "algo", "placement", "runner"))
    sections = {
        "cluster": ClusterConfig,
        "model": ModelConfig,
        "data": DataConfig,
        "algo": MathAlgoConfig,
        "placement": MathPlacementConfig,
        "runner": MathRunnerConfig,
    }
    errors = SectionErrors()  # every section is checked, so that one run names them all
    built = {
        k: errors.build(lambda k=k, c=c: from_section(c, cfg[k], k)) for k, c in sections.items()
    }
    errors.raise_any()
    for message in ineffective_keys(
        cfg["algo"], built["algo"].preset, MathAlgoConfig.CONDITIONAL, built["algo"].name
    ):
        errors.add(message)
    errors.raise_any()
    job = MathGrpoJob(**built, raw=OmegaConf.to_container(cfg, resolve=True))
    job.model.source()  # the weights exist
    a = job.algo
    if a.minibatch_size and a.batch_size % a.minibatch_size:
        raise ConfigError(
            f"algo.minibatch_size={a.minibatch_size} must divide the batch of "
            f"algo.prompts_per_step x algo.group_size = {a.batch_size} responses"
        )
    devices = local_device_count(job.cluster)
    if devices is not None:
        job.resolved = job.placement.resolve(devices)
        rollout = len(job.resolved.of("rollout"))
        if a.prompts_per_step < rollout:
            raise ConfigError(
                f"algo.prompts_per_step={a.prompts_per_step} is fewer than the {rollout} rollout "
                "workers of placement.components.rollout: each needs at least one prompt"
            )
    return job

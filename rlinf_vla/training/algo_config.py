"""The ``algo`` section of ``rlinf-vla train``: :class:`AlgoConfig`, the embodied trainer's
typed config (the algorithm's preset keys and the update's settings), validated on
construction. The actor worker receives it; the CLI, the run's config and the placement
search read it without importing the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from rlinf_vla.algos.presets import AlgorithmPreset, AlgorithmSection, estimator_kind
from rlinf_vla.config import ConfigError, check_at_least

#: ``algo.group_size`` of a group algorithm (GRPO, DAPO, RLOO) when it is not given.
DEFAULT_GROUP_SIZE = 4


@dataclass
class AlgoConfig(AlgorithmSection):
    """The ``algo`` section of ``rlinf-vla train``.

    ``name`` (``ppo``, ``grpo``, ``dapo``, ``reinforce_pp`` or ``rloo``) and the preset keys: see
    :class:`~rlinf_vla.algos.presets.AlgorithmSection`. Per algorithm, on chunk-level rewards:

    - ``gae`` (PPO): GAE over chunk steps, bootstrapping truncated episodes from the value of
      their final observation; value loss.
    - ``grpo`` / ``rloo`` (GRPO, DAPO, RLOO): each env's first episode in the rollout is scored
      by its return (discounted by ``gamma`` per chunk step) and compared within groups of
      ``group_size`` envs that share a reset id; its chunk steps share the advantage, later
      episodes are masked out. DAPO's dynamic sampling masks out groups whose scores are all
      equal. ``overlong_buffer`` has no meaning for episodes and is left out.
    - ``reinforce_pp``: discounted chunk returns (not across episode boundaries), whitened
      over the batch.
    - ``dagger`` (an imitation algorithm): no reward enters the update. The env's scripted
      expert labels every state of the rollout; the chunk steps' observations, each with the
      expert's labels of the chunk's steps as its target chunk, join everything gathered so
      far, and the policy learns them with its own supervised loss (``Policy.loss``, that of
      ``rlinf-vla sft``): ``update_epochs x ceil(new samples / minibatch_size)`` optimizer
      steps per iteration on minibatches drawn uniformly from the aggregate.

    Attributes:
        group_size: envs per group (must equal ``env.group_size``; the shipped env configs
            follow it); ``None``: 4 for a group algorithm, else 1.
        value_coef, value_clip: weight and clipping range of the value loss (with a critic).
        entropy_coef: weight of the entropy bonus.
        kl_coef: weight of a KL penalty to the policy the run started from (the
            ``policy.checkpoint``, also after a resume), estimated per log-prob entry on the
            sampled actions (chains) and aggregated like the policy term; ``0``: none. The
            actor keeps a frozen copy of the starting policy for it (twice the policy's
            weights; offloaded with the policy). Not with ``kl_in_reward`` presets
            (``reinforce_pp``), whose KL ``train`` does not fold into rewards.
        kl_estimator: ``k2`` (``(log π - log π_ref)² / 2``, the default here), ``k1`` or
            ``k3`` (``exp(-d) + d - 1``, math-grpo's default). The log-probs of continuous
            actions move by tens between nearby policies (a Gaussian of std 0.08 per entry),
            where ``k3``'s exponential overflows: on PushCube it was ``inf`` in the first
            iteration.
        normalize_advantages: PPO: whiten the GAE advantages over the batch.
        update_epochs: passes over the rollout batch per iteration.
        minibatch_size: samples (env chunk steps) per optimizer step.
        micro_batch_size: samples per forward/backward (gradient accumulation; the update
            does not depend on it).
        max_grad_norm: gradient clipping.
        lr, value_lr: AdamW learning rates of the policy and of the critic (its value head,
            and its own encoder with ``policy.value_encoder=cnn``).
        log_std_lr: AdamW learning rate of the policy's state-independent log-std (parameters
            named ``log_std``, e.g. OpenVLA-OFT's Gaussian head) in a third group; ``None``:
            ``lr``, in the main group. Like ``lr``, 0 during the critic warm-up.
        weight_decay: AdamW weight decay.
        lr_schedule: ``constant`` or ``linear`` decay to 0 over the run.
        warmup_iterations: linear warmup of the learning rate.
        critic_epochs: with a critic: after the update epochs, this many more passes over the
            rollout batch fit the critic alone (its value loss; the other parameters' rates
            are 0 for them), ``minibatch_size`` samples a step, as PPG's auxiliary phase fits
            its value function; the critic's steps per iteration then no longer depend on how
            many the policy takes. Cheap with a critic of its own (``policy.value_encoder=cnn``:
            its encoder alone runs); with a value head on the backbone each step runs the whole
            forward pass. ``0`` (the default): the critic learns in the update epochs only.
            Not with ``fsdp``.
        critic_warmup_iterations: with a critic: for the first N iterations only the critic
            learns (the policy's learning rate is 0), so the first policy updates use
            advantages from a critic fitted to the starting policy's returns rather than from
            a random one.
        fsdp: with several actor workers, shard the policy, its gradients and the optimizer
            state over them with FSDP2 (``False``: every worker holds a replica and gradients
            are all-reduced).
        cache_frozen_features: when only the policy's read-out trains (LoRA or fine-tuning of
            the action logits and the value head, the rest frozen), compute the frozen part's
            features once per iteration and run only the read-out in the update epochs
            (``Policy.frozen_features``); the same losses, without recomputing the backbone in
            every epoch. Where the policy computes them while acting (OpenVLA), the rollout
            workers send them with the trajectories and the actor skips that pass too.
            Policies that cannot split, and FSDP, always run the whole pass.
        autocast: mixed precision of the policy's forward passes in the rollout and the
            update: ``auto`` (bf16 on CUDA devices, off on CPU), ``bf16`` (also on CPU) or
            ``off``. Weights, optimizer state and losses stay float32.
        episode_weight: group algorithms (GRPO, DAPO, RLOO), which score each env's first
            episode: ``equal`` (the default, RLinf's weighting of such rollouts) weighs each
            episode's chunk steps by ``mean length / its length`` in the policy term, so every
            episode counts the same however many steps it ran; ``step``: every chunk step
            counts the same, so long episodes (on success-terminated tasks, the failed ones)
            carry more of the loss.
        bootstrap_truncated: GAE: an episode the env's time limit cut continues from V of its
            final observation (``True``, the default: the limit is not part of the task's
            state, as in an infinite-horizon MDP); ``False``: the time limit is terminal, so an
            episode that reaches it without success is worth 0 from there on, as an evaluation
            that counts success within the limit scores it. Episodes the rollout's end cuts
            are bootstrapped either way.
        reward_scale: GAE: the rewards are multiplied by this before the advantages and the
            critic's targets are computed (ManiSkill's PPO baselines' ``reward_scale``), so a
            critic whose returns run to the hundreds (a dense reward summed over long episodes)
            fits targets of a size its value head reaches in fewer steps. Where the advantages
            are normalised (``normalize_advantages``, the default) the scale reaches the policy
            only through what the critic has learnt. The env's rewards, successes and ``env/`` metrics are never scaled;
            ``train/return_mean``, ``train/value_mean`` and the value loss are in scaled units.
            ``1.0``: the rewards as the env gives them.
        buffer_size: ``dagger``: the aggregate keeps the newest N samples (chunk steps);
            ``None`` (the default): every sample of the run, as DAgger aggregates. A sample
            holds its observation's images (a 64 x 64 camera: 12 KiB), so long runs with large
            images need a bound.
        target_kl: stop an iteration's update early: before each optimizer step the
            minibatch's ``approx_kl`` (the mean over every rank's samples of the k3 estimate of
            KL(π_old || π_θ), where the epochs have taken the policy so far) is compared with
            ``1.5 * target_kl``; above it, that step and every later one of the iteration are
            left out (``train/kl_stopped``: 1, ``train/update_steps``: the steps taken). Keeps
            one iteration's move of the policy bounded when its advantages pull hard. ``None``
            (the default): every epoch runs.
        skip_zero_advantage: a minibatch whose every sample has an advantage of exactly 0
            (GRPO groups whose episodes all scored the same) makes no optimizer step, on every
            rank alike, where the loss has no other term (no value, entropy or KL term): its
            gradient is 0, and a step would only carry AdamW's momentum and weight decay on.
            As math-grpo's key of the same name.
    """

    # the trainer's keys
    group_size: int | None = None
    value_coef: float = 0.5
    value_clip: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    normalize_advantages: bool = True
    update_epochs: int = 2
    minibatch_size: int = 32
    micro_batch_size: int = 16
    max_grad_norm: float = 1.0
    lr: float = 1e-4
    value_lr: float = 1e-3
    log_std_lr: float | None = None
    weight_decay: float = 0.0
    lr_schedule: Literal["constant", "linear"] = "constant"
    warmup_iterations: int = 0
    critic_warmup_iterations: int = 0
    critic_epochs: int = 0
    cache_frozen_features: bool = True
    autocast: Literal["auto", "bf16", "off"] = "auto"
    fsdp: bool = False
    skip_zero_advantage: bool = True
    episode_weight: Literal["equal", "step"] = "equal"
    bootstrap_truncated: bool = True
    reward_scale: float = 1.0
    target_kl: float | None = None
    buffer_size: int | None = None

    #: trainer keys that change something only for some algorithms: key -> (test, why)
    CONDITIONAL: ClassVar[dict[str, tuple[Callable[[AlgorithmPreset], bool], str]]] = {
        **AlgorithmSection.CRITIC_KEYS,
        "critic_warmup_iterations": (lambda p: p.use_critic, "needs a critic (use_critic)"),
        "critic_epochs": (lambda p: p.use_critic, "needs a critic (use_critic)"),
        "bootstrap_truncated": (
            lambda p: estimator_kind(p.advantage) == "critic",
            "only a critic's advantages (GAE) bootstrap",
        ),
        "reward_scale": (
            lambda p: estimator_kind(p.advantage) == "critic",
            "only a critic's targets are scaled",
        ),
        "group_size": (lambda p: p.uses_groups, "only group advantages (grpo, rloo) use groups"),
        "episode_weight": (
            lambda p: p.uses_groups,
            "only group advantages (grpo, rloo) score whole episodes",
        ),
        "kl_coef": (
            lambda p: not p.kl_in_reward and not p.imitation,
            "train does not fold the KL into rewards (the preset's kl_in_reward); "
            "imitation has no policy-gradient loss",
        ),
        **{
            key: (lambda p: not p.imitation, "imitation has no policy-gradient loss")
            for key in (
                "entropy_coef",
                "kl_estimator",
                "target_kl",
                "skip_zero_advantage",
                "cache_frozen_features",
            )
        },
        "buffer_size": (lambda p: p.imitation, "only dagger aggregates expert-labelled states"),
    }

    def __post_init__(self) -> None:
        bad_preset = self.fill_preset()  # named below with the other bad values
        uses_groups = self.uses_groups
        if self.group_size is None:
            self.group_size = DEFAULT_GROUP_SIZE if uses_groups else 1
        check_at_least(
            self, "algo", ("update_epochs", "minibatch_size", "micro_batch_size", "buffer_size"), 1
        )
        if self.minibatch_size % self.micro_batch_size:
            raise ConfigError(
                f"algo.micro_batch_size={self.micro_batch_size} must divide "
                f"algo.minibatch_size={self.minibatch_size}"
            )
        if uses_groups and self.group_size < 2:
            raise ConfigError(
                f"algo.group_size must be >= 2 for {self.name} (it compares the episodes of a "
                f"group), got {self.group_size}"
            )
        # Every bad value is named at once (inf / nan are refused when the section is built).
        bad = (
            ["algo.lr and algo.value_lr must be > 0"] if self.lr <= 0 or self.value_lr <= 0 else []
        )
        bad += [
            f"algo.{key} {rule}, got {getattr(self, key)}"
            for key, ok, rule in [
                ("log_std_lr", self.log_std_lr is None or self.log_std_lr > 0, "must be > 0"),
                ("group_size", self.group_size >= 1, "must be >= 1"),
                (
                    "value_clip",
                    self.value_clip is None or self.value_clip > 0,
                    "must be > 0 or null",
                ),
                ("value_coef", self.value_coef >= 0, "must be >= 0"),
                ("entropy_coef", self.entropy_coef >= 0, "must be >= 0 (a bonus, not a penalty)"),
                ("kl_coef", self.kl_coef >= 0, "must be >= 0"),
                ("target_kl", self.target_kl is None or self.target_kl > 0, "must be > 0 or null"),
                ("reward_scale", self.reward_scale > 0, "must be > 0"),
                ("max_grad_norm", self.max_grad_norm > 0, "must be > 0 (the gradient's norm cap)"),
                ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
                ("warmup_iterations", self.warmup_iterations >= 0, "must be >= 0"),
                ("critic_warmup_iterations", self.critic_warmup_iterations >= 0, "must be >= 0"),
                ("critic_epochs", self.critic_epochs >= 0, "must be >= 0"),
                (
                    "critic_epochs",
                    not (self.critic_epochs and self.fsdp),
                    "must be 0 with algo.fsdp (the critic's passes do not shard)",
                ),
            ]
            if not ok
        ]
        if bad or bad_preset:
            raise ConfigError("; ".join(([bad_preset] if bad_preset else []) + bad))

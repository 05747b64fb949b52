"""Config of π0 and π0.5 (PaliGemma + a Gemma action expert, flow matching)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rlinf_vla.policies.base import PolicyConfig, PolicyNeeds, check

__all__ = ["GEMMA_VARIANTS", "RUN_FIELDS", "SIGLIP_SO400M", "FlowMatchingConfig", "Pi0Config"]

#: openpi ``gemma.get_config`` variants as ``GemmaConfig`` keyword arguments.
GEMMA_VARIANTS: dict[str, dict[str, Any]] = {
    "gemma_2b": {
        "hidden_size": 2048,
        "intermediate_size": 16384,
        "num_hidden_layers": 18,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 257152,
    },
    "gemma_300m": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 18,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 257152,
    },
}

#: PaliGemma's SigLIP So400m/14 at 224 px (``SiglipVisionConfig`` keyword arguments).
SIGLIP_SO400M: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
}

#: Same module and key structure as π0 / π0.5, a few hundred thousand parameters.
TINY_PI0: dict[str, Any] = {
    "paligemma_variant": "custom",
    "action_expert_variant": "custom",
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    },
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 512,
    },
    "expert_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
    },
    "action_horizon": 4,
    "chunk_size": 4,  # the whole (tiny) horizon; the full model executes 5 of its 50
    "max_action_dim": 8,
    "max_state_dim": 8,
    "max_token_len": 128,
    "num_steps": 3,
    "value_hidden_sizes": (32,),
    "noise_hidden_sizes": (16,),
}


#: Fields of a flow-matching config that belong to the run, never written to or read from a
#: checkpoint's own config section.
RUN_FIELDS = (
    "checkpoint",
    "lora_rank",
    "lora_adapter",
    "device",
    "dtype",
    "tokenizer",
    "seed",
    "norm_stats",
    "greedy_noise",
    "greedy_seed",
)


@dataclass
class FlowMatchingConfig(PolicyConfig):
    """Settings of the flow-matching policies (π0 / π0.5 and SmolVLA): the action chunk, the
    denoising chain and its RL log-probabilities (plus the shared :class:`PolicyConfig`).

    Sizes and inputs:
        action_horizon: ``H``, actions per denoised chunk.
        max_action_dim / max_state_dim: the padded action / state size of the model.
        min_period / max_period: the shortest and longest period of the sinusoidal embedding of
            the flow-matching time (openpi and lerobot: 0.004 and 4.0).
        image_keys: cameras in slot order.

    Flow matching and RL:
        chunk_size: ``K``, the executed actions (the first ``K`` of ``H``).
        num_steps: Euler denoising steps (openpi: 10; RLinf's RL runs: 4-5).
        noise_method: ``flow_sde`` (one random step per sample made stochastic, the
            log-prob is that step's Gaussian transition) or ``flow_noise`` (a learned noise-std
            network, every step stochastic, log-prob averaged over the chain).
        noise_level: ``a`` in ``sigma_t = a sqrt(t / (1 - t))`` (Flow-SDE).
        sde_ignore_last: never pick the last denoising step for the SDE.
        joint_logprob: Flow-SDE: make every denoising step stochastic (each with its
            ``sigma_k``) and score the whole chain, its log-prob the mean of the transitions'
            (and of the starting noise's) as Flow-Noise does, instead of one random step whose
            log-prob is its own. With one step, the ODE steps before and after it also change
            with the weights but no ratio covers them; with every step scored, the ratio is the
            chain's. Flow-Noise always scores the whole chain.
        noise_std_range: the range of the learned std (Flow-Noise).
        noise_hidden_sizes: hidden sizes of the noise-std network.
        value_source: ``expert`` (mean of the expert's action outputs) or ``prefix`` (mean of
            the VLM prefix outputs); ``auto`` lets the family pick.
        time_beta: ``(alpha, beta)`` of the training time distribution.

    Greedy actions (``act(obs, greedy=True)``: the ODE, no SDE step or learned noise):
        greedy_noise: where the integration starts. ``sample`` (openpi's ``sample_actions``):
            a ``N(0, I)`` draw from a generator seeded by ``greedy_seed`` and a hash of the
            observation, so equal observations give equal actions (reproducible evaluation,
            whatever the batching) and torch's global RNG is not used. ``zero``: the noise
            mode ``x_0 = 0`` (this package's behaviour before; not openpi's).
        greedy_seed: the seed of ``sample``; another seed gives other noise.
    """

    action_horizon: int = 50
    max_action_dim: int = 32
    max_state_dim: int = 32
    chunk_size: int = 5
    image_keys: tuple[str, ...] = ("main", "wrist")
    num_steps: int = 10
    noise_method: Literal["flow_sde", "flow_noise"] = "flow_sde"
    noise_level: float = 0.5
    sde_ignore_last: bool = False
    joint_logprob: bool = False
    noise_std_range: tuple[float, float] = (0.08, 0.16)
    noise_hidden_sizes: tuple[int, ...] = (128, 64)
    value_source: Literal["auto", "expert", "prefix"] = "auto"
    value_hidden_sizes: tuple[int, ...] = (512, 256, 128)
    time_beta: tuple[float, float] = (1.5, 1.0)
    min_period: float = 4e-3
    max_period: float = 4.0
    greedy_noise: Literal["sample", "zero"] = "sample"
    greedy_seed: int = 0

    def needs(self) -> PolicyNeeds:
        """Its cameras and a state of at most ``max_state_dim`` values (zero-padded)."""
        return PolicyNeeds(
            cameras=tuple(self.image_keys),
            action_dim=self.action_dim,
            max_state_dim=self.max_state_dim,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.image_keys = tuple(self.image_keys)
        self.noise_std_range = tuple(float(x) for x in self.noise_std_range)
        self.noise_hidden_sizes = tuple(int(x) for x in self.noise_hidden_sizes)
        self.time_beta = tuple(float(x) for x in self.time_beta)
        check(
            self,
            "value_source",
            self.value_source in ("auto", "expert", "prefix"),
            "must be 'auto', 'expert' or 'prefix'",
        )
        check(
            self, "action_dim", self.action_dim <= self.max_action_dim, "must be <= max_action_dim"
        )
        check(
            self, "chunk_size", self.chunk_size <= self.action_horizon, "must be <= action_horizon"
        )
        check(self, "num_steps", self.num_steps >= 1, "must be >= 1")
        check(
            self,
            "num_steps",
            not (self.sde_ignore_last and self.num_steps < 2),
            "must be >= 2 with sde_ignore_last",
        )
        check(
            self,
            "noise_method",
            self.noise_method in ("flow_sde", "flow_noise"),
            "must be 'flow_sde' or 'flow_noise'",
        )
        check(self, "noise_level", self.noise_level > 0, "must be > 0")
        check(
            self,
            "joint_logprob",
            not self.joint_logprob or self.noise_method == "flow_sde",
            "is Flow-SDE's (Flow-Noise always scores the whole chain)",
        )
        check(
            self,
            "sde_ignore_last",
            not (self.sde_ignore_last and self.joint_logprob),
            "picks Flow-SDE's one step; joint_logprob makes every step stochastic",
        )
        check(
            self,
            "greedy_noise",
            self.greedy_noise in ("sample", "zero"),
            "must be 'sample' or 'zero'",
        )
        lo, hi = self.noise_std_range
        check(self, "noise_std_range", 0 < lo < hi, "must be (low, high) with 0 < low < high")
        check(self, "image_keys", len(self.image_keys) >= 1, "must name at least one camera")

    @property
    def one_sde_step(self) -> bool:
        """Flow-SDE with one stochastic (and scored) step per sample, the rest ODE."""
        return self.noise_method == "flow_sde" and not self.joint_logprob


@dataclass
class Pi0Config(FlowMatchingConfig):
    """π0 / π0.5 settings (plus the shared :class:`FlowMatchingConfig`); defaults are openpi's.

    Architecture:
        pi05: π0.5 (adaRMS time conditioning of the expert, no state token, quantile
            normalisation, value from the VLM prefix) instead of π0.
        paligemma_variant / action_expert_variant: openpi names (``gemma_2b`` / ``gemma_300m``)
            or ``custom`` (then ``text_config`` / ``expert_config`` give the sizes).
        vision_config: SigLIP sizes (``SiglipVisionConfig`` arguments).
        text_config / expert_config: ``GemmaConfig`` arguments of the VLM and of the expert
            (filled from the variants); both must share depth, heads, kv heads and head dim.
        action_horizon: ``H`` (50; ``pi05_libero``: 10); ``max_action_dim`` /
            ``max_state_dim``: 32.
        max_token_len: prompt length in tokens (``None``: 48 for π0, 200 for π0.5).

    Inputs:
        image_keys: cameras in slot order (``base_0_rgb``, ``left_wrist_0_rgb``, ...).
        num_empty_cameras: extra all-black, masked-out slots (LIBERO: the right wrist).
        discrete_state_input: write the discretised state into the prompt (``None``: π0.5,
            openpi's ``Pi0Config`` default). A checkpoint's own record wins over the default;
            openpi's converted checkpoints keep none, and ``pi05_libero`` was trained with
            ``False``: set it for that checkpoint.
        normalization: ``zscore`` (π0) or ``quantile`` (π0.5); ``auto`` picks by model (or
            by the mode a lerobot checkpoint records).
        norm_stats: openpi ``norm_stats.json`` content ``{"state": {...}, "actions": {...}}``
            (``mean``, ``std``, ``q01``, ``q99``), or the path of such a file or of a folder
            holding statistics in a layout a checkpoint uses (read at construction). Loading a
            checkpoint finds its own when this is unset, and fails when it has none.
        asset_id: which ``assets/<asset_id>/norm_stats.json`` of an openpi checkpoint to read
            (openpi's ``AssetsConfig.asset_id``, e.g. ``physical-intelligence/libero``); needed
            only when the checkpoint holds several.

    RL: ``value_source`` ``auto`` is ``expert`` for π0 and ``prefix`` for π0.5.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": TINY_PI0, "full": {}}

    pi05: bool = False
    paligemma_variant: str = "gemma_2b"
    action_expert_variant: str = "gemma_300m"
    vision_config: dict[str, Any] = field(default_factory=lambda: dict(SIGLIP_SO400M))
    text_config: dict[str, Any] = field(default_factory=dict)
    expert_config: dict[str, Any] = field(default_factory=dict)
    max_token_len: int | None = None
    num_empty_cameras: int = 1
    discrete_state_input: bool | None = None
    normalization: Literal["auto", "zscore", "quantile"] = "auto"
    norm_stats: dict[str, Any] | str | None = None
    asset_id: str | None = None

    def __post_init__(self) -> None:
        if self.value_source == "auto":
            self.value_source = "prefix" if self.pi05 else "expert"
        super().__post_init__()
        for name, variant in (
            ("text_config", self.paligemma_variant),
            ("expert_config", self.action_expert_variant),
        ):
            if variant != "custom":
                check(
                    self,
                    name,
                    variant in GEMMA_VARIANTS,
                    f"variant {variant!r} unknown (known: {sorted(GEMMA_VARIANTS)} or 'custom')",
                )
                setattr(self, name, {**GEMMA_VARIANTS[variant], **getattr(self, name)})
        if self.max_token_len is None:
            self.max_token_len = 200 if self.pi05 else 48
        if self.discrete_state_input is None:
            self.discrete_state_input = self.pi05
        if self.normalization == "auto":
            self.normalization = "quantile" if self.pi05 else "zscore"
        t, e = self.text_config, self.expert_config
        for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            check(
                self,
                "expert_config",
                key in t and key in e and t[key] == e[key],
                f"must share {key} with text_config (attention is computed jointly)",
            )
        check(self, "num_empty_cameras", self.num_empty_cameras >= 0, "must be >= 0")
        if isinstance(self.norm_stats, str | Path):
            self.norm_stats = _read_norm_stats(Path(self.norm_stats).expanduser(), self.asset_id)
        if self.norm_stats is not None:
            check(
                self,
                "norm_stats",
                "actions" in self.norm_stats,
                "needs an 'actions' entry (openpi norm_stats.json layout)",
            )

    @property
    def image_size(self) -> int:
        return int(self.vision_config.get("image_size", 224))


def _read_norm_stats(path: Path, asset_id: str | None) -> dict[str, Any]:
    """``norm_stats=<path>``: a ``norm_stats.json`` file, or a folder read like a checkpoint."""
    from rlinf_vla.policies.pi0.processor import find_norm_stats, read_openpi_norm_stats

    if path.is_file():
        return read_openpi_norm_stats(path)
    found = find_norm_stats(path, asset_id) if path.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"norm_stats={str(path)!r}: no normalisation statistics there")
    return found.stats

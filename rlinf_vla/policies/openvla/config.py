"""Config of OpenVLA (Prismatic DINOv2+SigLIP -> 3-layer GELU projector -> Llama-2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlinf_vla.policies.base import PolicyConfig, check

__all__ = ["VISION_BACKBONES", "OpenVLAConfig"]

#: Prismatic ``vision_backbone_id`` -> (timm ids, image sizes, act-layer overrides).
VISION_BACKBONES: dict[str, tuple[tuple[str, ...], tuple[int, ...], tuple[str | None, ...]]] = {
    "dinosiglip-vit-so-224px": (
        ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"),
        (224, 224),
        (None, None),
    ),
    "dinosiglip-vit-so-384px": (
        ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_384"),
        (384, 384),
        (None, None),
    ),
    "siglip-vit-so400m": (("vit_so400m_patch14_siglip_224",), (224,), (None,)),
    "dinoclip-vit-l-336px": (
        ("vit_large_patch14_reg4_dinov2.lvd142m", "vit_large_patch14_clip_336.openai"),
        (336, 336),
        (None, "quick_gelu"),
    ),
}

#: Same module and key structure as openvla-7b, about 0.4 M parameters (MODELS.md §1.12).
TINY_OPENVLA: dict[str, Any] = {
    "timm_kwargs": (
        {"embed_dim": 32, "depth": 3, "num_heads": 2},
        {"embed_dim": 48, "depth": 3, "num_heads": 2, "mlp_ratio": 2.0},
    ),
    "image_sizes": (28, 28),
    "llm_backbone_id": "tiny-llama",
    "text_config": {
        "vocab_size": 1024 + 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "pad_token_id": 1024,
    },
    "value_hidden_sizes": (32,),
}


@dataclass
class OpenVLAConfig(PolicyConfig):
    """OpenVLA settings (plus the shared :class:`PolicyConfig`).

    Architecture (read from / written to the checkpoint's ``config.json``):
        vision_backbone_id: Prismatic backbone id; fills ``timm_model_ids``/``image_sizes``
            for the published ids (``dinosiglip-vit-so-224px`` for openvla-7b).
        timm_model_ids: timm model names of the featurizer (and fused featurizer).
        timm_override_act_layers: per-backbone ``act_layer`` overrides.
        timm_kwargs: per-backbone keyword overrides of the timm architecture (tiny preset).
        image_sizes: per-backbone input resolution.
        image_resize_strategy: ``resize-naive`` (squash) or ``letterbox`` (pad to square with
            the mean colour first).
        llm_backbone_id: informational (``llama2-7b-pure``).
        text_config: ``LlamaConfig`` keyword arguments; openvla-7b stores only the non-default
            ones (``vocab_size=32064``, ``pad_token_id=32000``).
        pad_to_multiple_of: the embedding rows added after the base vocabulary (the base
            vocabulary is ``text_config.vocab_size - pad_to_multiple_of``).
        n_action_bins: number of action token ids (the last ids of the base vocabulary).

    Inputs and sampling:
        image_keys: cameras fed to the model, in order (OpenVLA: one, ``main``).
        center_crop: crop the central 90% of the image area before resizing.
        temperature: sampling temperature of the action tokens (RLinf: 1.0 train).
        top_k: keep only the k most likely action tokens (0 = off).
        norm_stats: ``dataset_statistics.json`` (``{dataset: {"action": {q01, q99, mask}}}``).
        unnorm_key: which dataset's statistics un-normalise the actions; required when
            ``norm_stats`` has several.
        gripper: the convention of the last action dim the model outputs. ``rlds``: OpenVLA's
            RLDS data (1 = open, 0 = close), which every official OpenVLA and OpenVLA-OFT
            checkpoint learned; env actions get ``-sign(2 a - 1)`` (+1 close, -1 open, what
            the envs and robots here take), as the official LIBERO evaluation maps it. ``env``:
            the model outputs the envs' convention. ``auto``: ``rlds`` for a checkpoint this
            package did not write (an official one), the recorded value for one it wrote,
            ``env`` without a checkpoint.
        exact_logprob: ``act`` re-scores the sampled tokens with ``evaluate``'s teacher-forced
            pass (one extra forward), so ``evaluate`` reproduces the log-probs exactly; off,
            the decoding logits are used (they differ by float rounding).
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": TINY_OPENVLA, "full": {}}

    vision_backbone_id: str = "dinosiglip-vit-so-224px"
    timm_model_ids: tuple[str, ...] = ()
    timm_override_act_layers: tuple[str | None, ...] = ()
    timm_kwargs: tuple[dict[str, Any], ...] = ()
    image_sizes: tuple[int, ...] = ()
    image_resize_strategy: str = "resize-naive"
    llm_backbone_id: str = "llama2-7b-pure"
    text_config: dict[str, Any] = field(
        default_factory=lambda: {"vocab_size": 32064, "pad_token_id": 32000}
    )
    pad_to_multiple_of: int = 64
    n_action_bins: int = 256
    image_keys: tuple[str, ...] = ("main",)
    center_crop: bool = False
    temperature: float = 1.0
    top_k: int = 0
    norm_stats: dict[str, Any] | None = None
    unnorm_key: str | None = None
    gripper: str = "auto"
    exact_logprob: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        known = VISION_BACKBONES.get(self.vision_backbone_id)
        if known is not None:
            ids, sizes, acts = known
            self.timm_model_ids = tuple(self.timm_model_ids) or ids
            self.image_sizes = tuple(self.image_sizes) or sizes
            self.timm_override_act_layers = tuple(self.timm_override_act_layers) or acts
        self.timm_model_ids = tuple(self.timm_model_ids)
        self.image_sizes = tuple(int(s) for s in self.image_sizes)
        self.image_keys = tuple(self.image_keys)
        n = len(self.timm_model_ids)
        self.timm_override_act_layers = tuple(self.timm_override_act_layers) or (None,) * n
        self.timm_kwargs = tuple(dict(k) for k in self.timm_kwargs) or ({},) * n
        check(
            self,
            "timm_model_ids",
            n in (1, 2),
            f"must name 1 or 2 backbones (unknown vision_backbone_id "
            f"{self.vision_backbone_id!r} needs explicit ids; known: {sorted(VISION_BACKBONES)})",
        )
        for name in ("image_sizes", "timm_override_act_layers", "timm_kwargs"):
            check(self, name, len(getattr(self, name)) == n, f"needs {n} entries")
        check(self, "image_sizes", len(set(self.image_sizes)) == 1, "must all be equal")
        check(
            self,
            "image_resize_strategy",
            self.image_resize_strategy in ("resize-naive", "letterbox"),
            "must be 'resize-naive' or 'letterbox'",
        )
        check(self, "image_keys", len(self.image_keys) >= 1, "must name at least one camera")
        check(self, "gripper", self.gripper in ("auto", "rlds", "env"), "must be auto, rlds or env")
        if self.gripper == "auto":  # a checkpoint's folder decides it before (config_from_dir)
            self.gripper = "env"
        check(self, "temperature", self.temperature > 0, "must be > 0")
        check(self, "top_k", self.top_k >= 0, "must be >= 0")
        check(
            self,
            "n_action_bins",
            2 <= self.n_action_bins <= self.base_vocab_size,
            f"must lie in [2, base vocab {self.base_vocab_size}]",
        )
        if self.norm_stats is not None and self.unnorm_key is not None:
            check(
                self,
                "unnorm_key",
                self.unnorm_key in self.norm_stats,
                f"is not in norm_stats (known: {sorted(self.norm_stats)})",
            )

    @property
    def base_vocab_size(self) -> int:
        """The tokenizer's base vocabulary (32000): embedding rows minus the padding rows."""
        return int(self.text_config.get("vocab_size", 32000)) - self.pad_to_multiple_of

    @property
    def use_fused_vision_backbone(self) -> bool:
        return len(self.timm_model_ids) == 2

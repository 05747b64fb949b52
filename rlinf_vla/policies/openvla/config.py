"""Config of OpenVLA (Prismatic DINOv2+SigLIP -> 3-layer GELU projector -> Llama-2)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rlinf_vla.policies.base import PolicyConfig, PolicyNeeds, check

__all__ = [
    "IMAGE_PIPELINES",
    "VISION_BACKBONES",
    "CheckpointFiles",
    "OpenVLAConfig",
    "backbone_mean_std",
    "checkpoint_files",
]

#: ``image_pipeline`` values (see :class:`OpenVLAConfig`).
IMAGE_PIPELINES = ("auto", "rlds", "torch")
VALUE_ENCODERS = ("backbone", "cnn")

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


def backbone_mean_std(timm_id: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The exact normalisation of a timm backbone's pretraining (Prismatic takes it from timm);
    the released checkpoints' ``preprocessor_config.json`` holds rounded copies, which win."""
    if "siglip" in timm_id:
        return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    if "clip" in timm_id:
        return (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    return (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class CheckpointFiles:
    """What the files of a checkpoint folder say about its conventions.

    Attributes:
        path: the folder.
        written_here: its ``config.json`` has the ``rlinf_vla`` section this package writes
            (otherwise it is an official checkpoint, or another tool's).
        recorded: that section (empty for an official checkpoint).
        preprocessor: ``preprocessor_config.json``, or ``None``.
    """

    path: Path
    written_here: bool
    recorded: dict[str, Any]
    preprocessor: dict[str, Any] | None


def checkpoint_files(checkpoint: str | None) -> CheckpointFiles | None:
    """The :class:`CheckpointFiles` of a checkpoint folder; ``None`` without a checkpoint or
    when the folder has no ``config.json`` (nothing to read conventions from)."""
    if not checkpoint:
        return None
    path = Path(checkpoint)
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    pre = path / "preprocessor_config.json"
    return CheckpointFiles(
        path=path,
        written_here="rlinf_vla" in data,
        recorded=dict(data.get("rlinf_vla") or {}),
        preprocessor=json.loads(pre.read_text()) if pre.is_file() else None,
    )


def preprocessor_mean_std(
    data: dict[str, Any], n: int, source: str
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """Per-backbone ``(means, stds)`` of a ``preprocessor_config.json``: those of
    ``tvf_normalize_params`` (what the official ``PrismaticImageProcessor`` normalises with:
    the loaded JSON overrides the values it derives from ``means``/``stds``), else ``means``
    and ``stds``."""
    if data.get("tvf_normalize_params"):
        params = data["tvf_normalize_params"]
        means = [p.get("mean") for p in params]
        stds = [p.get("std") for p in params]
    else:
        means, stds = data.get("means"), data.get("stds")
    ok = (
        isinstance(means, list)
        and isinstance(stds, list)
        and len(means) == len(stds) == n
        and all(isinstance(v, list) and len(v) == 3 for v in [*means, *stds])
    )
    if not ok:
        raise ValueError(
            f"{source} does not hold 3 means and 3 stds for each of the {n} backbone(s) "
            f"(tvf_normalize_params or means/stds); set image_mean and image_std"
        )
    return (
        tuple(tuple(float(x) for x in m) for m in means),
        tuple(tuple(float(x) for x in sd) for sd in stds),
    )


#: Norm-stats keys of the official LIBERO fine-tunes (``libero_spatial_no_noops``...), which
#: were trained with random-crop augmentation: their evaluation needs ``center_crop``.
LIBERO_FINETUNE_KEY = re.compile(r"^libero_.*_no_noops$")


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
        image_pipeline: how a camera image becomes the model's ``S x S`` input. ``rlds``: the
            official evaluations' (and the RLDS training data's) path: a JPEG round trip at
            quality 95 and a Lanczos-3 antialiased resize to ``S`` with PIL on the host, in
            ``uint8``; the center crop (if on) is quantised back to ``uint8`` as the official
            one. ``torch``: a bicubic antialiased resize in float on the policy's device (no
            JPEG, no quantisation; this package's fast path). ``auto``: ``rlds`` for a
            checkpoint this package did not write (an official one), the recorded value for
            one it wrote (``torch`` if it recorded none), ``torch`` without a checkpoint.
        center_crop: after the resize, cut the centred box of side ``sqrt(0.9)`` and resample
            it to ``S`` on TensorFlow's ``crop_and_resize`` grid, as the official evaluations
            of checkpoints trained with random-crop augmentation do. ``auto``: on for an
            official LIBERO fine-tune (a ``libero_*_no_noops`` dataset in its statistics, or
            ``image_aug`` in its folder name: the official evaluation asserts it), off for
            other official checkpoints and without a checkpoint; the recorded value for a
            checkpoint this package wrote.
        image_mean: per backbone, the 3 channel means the pixels are normalised with; empty ->
            the checkpoint's ``preprocessor_config.json`` (``tvf_normalize_params``, else
            ``means``: the released checkpoints hold bfloat16-rounded values such as
            0.484375), else the backbone's exact ImageNet / SigLIP values.
        image_std: the matching standard deviations (set both or neither).
        temperature: sampling temperature of the action tokens (RLinf: 1.0 train).
        top_k: keep only the k most likely action tokens (0 = off).
        norm_stats: ``dataset_statistics.json`` (``{dataset: {"action": {q01, q99, mask}}}``).
        unnorm_key: which dataset's statistics un-normalise the actions; required when
            ``norm_stats`` has several. As the official LIBERO evaluation, ``<key>_no_noops``
            is used when ``<key>`` is absent and it is present (``libero_spatial`` ->
            ``libero_spatial_no_noops``).
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

    The critic:
        value_encoder: what the value head reads. ``backbone`` (the default, RLinf's critic):
            the language model's hidden state, the features the actions are read from.
            ``cnn``: features of its own, from the cameras at the env's resolution (each at
            least 36 pixels) and, for a family that reads proprioception, the normalised
            robot state (:class:`~rlinf_vla.policies.heads.CriticEncoder`); the value loss
            then never moves the actor's features, and ``detach_value_input`` has no effect.
            A checkpoint whose critic read other features loads without its value head.
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
    image_pipeline: str = "auto"
    center_crop: bool | str = "auto"
    image_mean: tuple[tuple[float, ...], ...] = ()
    image_std: tuple[tuple[float, ...], ...] = ()
    temperature: float = 1.0
    top_k: int = 0
    norm_stats: dict[str, Any] | None = None
    unnorm_key: str | None = None
    gripper: str = "auto"
    exact_logprob: bool = True
    value_encoder: str = "backbone"

    def needs(self) -> PolicyNeeds:
        """Its cameras; OpenVLA reads no robot state."""
        return PolicyNeeds(cameras=tuple(self.image_keys), action_dim=self.action_dim)

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
        check(
            self,
            "value_encoder",
            self.value_encoder in VALUE_ENCODERS,
            f"must be one of {list(VALUE_ENCODERS)}",
        )
        check(
            self,
            "value_encoder",
            self.value_encoder == "backbone" or self.value_head,
            "needs value_head=true (a critic to feed)",
        )
        files = checkpoint_files(self.checkpoint)
        check(
            self,
            "image_pipeline",
            self.image_pipeline in IMAGE_PIPELINES,
            f"must be one of {list(IMAGE_PIPELINES)}",
        )
        if self.image_pipeline == "auto":
            self.image_pipeline = self._checkpoint_default(files, "image_pipeline", "rlds", "torch")
        if self.center_crop == "auto":
            libero = any(LIBERO_FINETUNE_KEY.match(k) for k in self.norm_stats or {})
            official_crop = files is not None and (libero or "image_aug" in files.path.name)
            self.center_crop = self._checkpoint_default(files, "center_crop", official_crop, False)
        check(
            self,
            "center_crop",
            isinstance(self.center_crop, bool),
            "must be true, false or auto",
        )
        self._resolve_mean_std(files, n)
        check(self, "gripper", self.gripper in ("auto", "rlds", "env"), "must be auto, rlds or env")
        if self.gripper == "auto":
            self.gripper = self._checkpoint_default(files, "gripper", "rlds", "env")
        check(self, "temperature", self.temperature > 0, "must be > 0")
        check(self, "top_k", self.top_k >= 0, "must be >= 0")
        check(
            self,
            "n_action_bins",
            2 <= self.n_action_bins <= self.base_vocab_size,
            f"must lie in [2, base vocab {self.base_vocab_size}]",
        )
        if self.norm_stats is not None and self.unnorm_key is not None:
            no_noops = f"{self.unnorm_key}_no_noops"
            if self.unnorm_key not in self.norm_stats and no_noops in self.norm_stats:
                self.unnorm_key = no_noops  # the official LIBERO evaluation's fallback
            check(
                self,
                "unnorm_key",
                self.unnorm_key in self.norm_stats,
                f"is not in norm_stats (known: {sorted(self.norm_stats)})",
            )

    @staticmethod
    def _checkpoint_default(
        files: CheckpointFiles | None, key: str, official: Any, otherwise: Any
    ) -> Any:
        """What an ``auto`` convention resolves to: ``official`` for a checkpoint this package
        did not write, the value recorded in the ``rlinf_vla`` section of one it wrote
        (``otherwise`` if it recorded none), ``otherwise`` without a checkpoint."""
        if files is None:
            return otherwise
        if files.written_here:
            return files.recorded.get(key, otherwise)
        return official

    def _resolve_mean_std(self, files: CheckpointFiles | None, n: int) -> None:
        if bool(self.image_mean) != bool(self.image_std):
            raise ValueError(
                f"{type(self).__name__}: set both image_mean and image_std, or neither "
                f"(got image_mean={self.image_mean!r}, image_std={self.image_std!r})"
            )
        if not self.image_mean:
            if files is not None and files.preprocessor is not None:
                source = str(files.path / "preprocessor_config.json")
                means, stds = preprocessor_mean_std(files.preprocessor, n, source)
            else:
                means, stds = zip(*(backbone_mean_std(t) for t in self.timm_model_ids), strict=True)
            self.image_mean, self.image_std = tuple(means), tuple(stds)
        self.image_mean = tuple(tuple(float(x) for x in m) for m in self.image_mean)
        self.image_std = tuple(tuple(float(x) for x in sd) for sd in self.image_std)
        for name in ("image_mean", "image_std"):
            values = getattr(self, name)
            check(
                self,
                name,
                len(values) == n and all(len(v) == 3 for v in values),
                f"needs 3 values for each of the {n} backbone(s)",
            )
        check(
            self,
            "image_std",
            all(x > 0 for sd in self.image_std for x in sd),
            "must be > 0",
        )

    @property
    def base_vocab_size(self) -> int:
        """The tokenizer's base vocabulary (32000): embedding rows minus the padding rows."""
        return int(self.text_config.get("vocab_size", 32000)) - self.pad_to_multiple_of

    @property
    def use_fused_vision_backbone(self) -> bool:
        return len(self.timm_model_ids) == 2

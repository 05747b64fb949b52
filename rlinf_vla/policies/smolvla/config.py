"""Config of SmolVLA (a truncated SmolVLM2 + a smaller Llama action expert, flow matching)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from rlinf_vla.policies.base import check
from rlinf_vla.policies.pi0.config import RUN_FIELDS, FlowMatchingConfig

__all__ = ["KNOWN_VLMS", "NOT_SAVED", "TINY_VLM", "SmolVLAConfig", "read_vlm_config"]

#: ``SmolVLMConfig`` arguments of the backbones SmolVLA checkpoints name in ``vlm_model_name``
#: (their ``config.json``, which lerobot fetches from the hub when it builds the policy).
KNOWN_VLMS: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": {
        "scale_factor": 4,
        "vision_config": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 512,
            "patch_size": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
        },
        "text_config": {
            "model_type": "llama",
            "hidden_size": 960,
            "intermediate_size": 2560,
            "num_hidden_layers": 32,
            "num_attention_heads": 15,
            "num_key_value_heads": 5,
            "head_dim": 64,
            "vocab_size": 49280,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False,
        "vocab_size": 49280,
    },
}

#: A SmolVLM backbone with the real module and key structure and a few hundred thousand
#: parameters: 32 px images in 8 px patches (16 patches, pixel-shuffled by 2 into 4 tokens).
TINY_VLM: dict[str, Any] = {
    "scale_factor": 2,
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    },
    "text_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    "tie_word_embeddings": False,
    "vocab_size": 512,
}

TINY_SMOLVLA: dict[str, Any] = {
    "vlm_model_name": "tiny",
    "vlm_config": TINY_VLM,
    "num_vlm_layers": 4,
    "resize_imgs_with_padding": (32, 32),
    "action_horizon": 4,
    "chunk_size": 4,
    "max_action_dim": 8,
    "max_state_dim": 8,
    "tokenizer_max_length": 32,
    "num_steps": 3,
    "value_hidden_sizes": (32,),
    "noise_hidden_sizes": (16,),
}

#: Config fields never written to or read from a checkpoint (they belong to the run).
NOT_SAVED = RUN_FIELDS

#: The parts of a ``SmolVLMConfig`` dict this port builds from (others take their defaults).
_VLM_KEYS = ("scale_factor", "vision_config", "text_config", "tie_word_embeddings", "vocab_size")


def read_vlm_config(name: str, base: Path | None = None) -> dict[str, Any]:
    """The ``SmolVLMConfig`` arguments of backbone ``name``: a folder holding its
    ``config.json`` (absolute, relative to ``base`` (a checkpoint folder) or to the working
    directory), the model in the local Hugging Face cache, or one of :data:`KNOWN_VLMS`.

    Raises:
        FileNotFoundError: none of these; the message says how to give the config.
    """
    candidates = [Path(name).expanduser()]
    if base is not None and not Path(name).is_absolute():
        candidates.insert(0, Path(base) / name)
    for folder in candidates:
        if (folder / "config.json").is_file():
            return _vlm_dict(json.loads((folder / "config.json").read_text()))
    cached = _cached_config(name)
    if cached is not None:
        return _vlm_dict(json.loads(cached.read_text()))
    if name in KNOWN_VLMS:
        return copy.deepcopy(KNOWN_VLMS[name])
    raise FileNotFoundError(
        f"vlm_model_name={name!r}: no config.json in a folder of that name, nothing in the local "
        f"Hugging Face cache, and not a built-in backbone ({sorted(KNOWN_VLMS)}); set "
        "vlm_config=<the backbone's SmolVLMConfig as a dict, or the folder of its config.json>"
    )


def _cached_config(name: str) -> Path | None:
    if name.count("/") != 1 or Path(name).exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(name, "config.json")
    return Path(found) if isinstance(found, str) else None


def _vlm_dict(data: dict[str, Any]) -> dict[str, Any]:
    out = {k: copy.deepcopy(data[k]) for k in _VLM_KEYS if k in data}
    if "vision_config" not in out or "text_config" not in out:
        raise ValueError("a SmolVLM config needs 'vision_config' and 'text_config'")
    out["text_config"].setdefault("model_type", "llama")
    return out


@dataclass
class SmolVLAConfig(FlowMatchingConfig):
    """SmolVLA settings (plus the shared :class:`FlowMatchingConfig`); defaults are lerobot's
    ``SmolVLAConfig`` (the ``smolvla_base`` architecture).

    Architecture:
        vlm_model_name: the SmolVLM backbone the checkpoint was built from (lerobot's field).
        vlm_config: its ``SmolVLMConfig`` arguments (``vision_config``, ``text_config``,
            ``scale_factor``) or the folder of its ``config.json``; ``None`` reads them for
            ``vlm_model_name`` (:func:`read_vlm_config`: a folder, the local Hugging Face cache,
            or the built-in SmolVLM2-500M-Video-Instruct).
        num_vlm_layers: the VLM's text layers that are kept (the first ones; 16).
        num_expert_layers: layers of the action expert (``<= 0``: as many as the VLM; else a
            divisor of ``num_vlm_layers``, the expert then joins every ``n``-th VLM layer).
        self_attn_every_n_layers: with ``attention_mode="cross_attn"``, layers ``0, n, 2n,
            ...`` are joint self-attention over prefix and actions, the others let the actions
            cross-attend to the VLM's keys and values of that layer.
        expert_width_multiplier: the expert's width relative to the VLM's (0.75).
        attention_mode: ``cross_attn`` (interleaved, as above) or ``self_attn`` (every layer
            joint).
        action_horizon: ``H`` (lerobot's ``chunk_size``, 50); ``max_action_dim`` /
            ``max_state_dim``: 32.

    Inputs:
        image_keys: the cameras in the order of the checkpoint's image features (a lerobot
            checkpoint's ``observation.images.<name>``; set them to the env's cameras).
        num_empty_cameras: extra all-black, masked-out image slots (lerobot's
            ``empty_cameras``).
        resize_imgs_with_padding: ``(width, height)`` the images are resized to keeping their
            aspect ratio, padded at the left and top with black; ``None``: as they come.
        tokenizer_max_length: prompt length in tokens (longer prompts are cut).
        pad_language_to: ``longest`` (the batch's longest prompt) or ``max_length``.
        prefix_length: pad the prefix to this many tokens (``< 0``: no padding).
        normalization: ``zscore`` (lerobot's ``MEAN_STD``, SmolVLA's default) or ``quantile``
            (``QUANTILES``).
        norm_stats: ``{"state": {...}, "actions": {...}}`` with ``mean`` / ``std`` (...), or a
            folder holding statistics in a layout a checkpoint uses (lerobot's processor
            files). Loading a checkpoint finds its own when this is unset.
        lerobot_features: a lerobot checkpoint's ``input_features`` / ``output_features``
            (set when it is loaded), written back by the export; ``None``: the export derives
            them from the cameras, the statistics and the action size.

    RL: ``value_source`` ``auto`` is ``expert``.
    """

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": TINY_SMOLVLA, "full": {}}

    vlm_model_name: str = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    vlm_config: dict[str, Any] | str | None = None
    num_vlm_layers: int = 16
    num_expert_layers: int = -1
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    attention_mode: Literal["cross_attn", "self_attn"] = "cross_attn"
    resize_imgs_with_padding: tuple[int, int] | None = (512, 512)
    num_empty_cameras: int = 0
    tokenizer_max_length: int = 48
    pad_language_to: Literal["longest", "max_length"] = "longest"
    prefix_length: int = -1
    normalization: Literal["zscore", "quantile"] = "zscore"
    norm_stats: dict[str, Any] | str | None = None
    lerobot_features: dict[str, Any] | None = None
    max_state_dim: int = 32
    value_hidden_sizes: tuple[int, ...] = (512, 256, 128)

    def __post_init__(self) -> None:
        if self.value_source == "auto":
            self.value_source = "expert"
        super().__post_init__()
        if isinstance(self.vlm_config, str | Path):
            folder = Path(self.vlm_config).expanduser()
            self.vlm_config = _vlm_dict(json.loads((folder / "config.json").read_text()))
        elif self.vlm_config is None:
            self.vlm_config = read_vlm_config(self.vlm_model_name)
        else:
            self.vlm_config = _vlm_dict(dict(self.vlm_config))
        if self.resize_imgs_with_padding is not None:
            self.resize_imgs_with_padding = tuple(int(x) for x in self.resize_imgs_with_padding)
            check(
                self,
                "resize_imgs_with_padding",
                len(self.resize_imgs_with_padding) == 2,
                "must be (width, height) or None",
            )
        total = int(self.vlm_config["text_config"]["num_hidden_layers"])
        check(
            self,
            "num_vlm_layers",
            self.num_vlm_layers <= total,
            f"must be <= the backbone's {total} text layers (<= 0: all of them)",
        )
        if self.num_vlm_layers <= 0:
            self.num_vlm_layers = total
        n_vlm, n_exp = self.num_vlm_layers, self.expert_layers
        check(
            self,
            "num_expert_layers",
            n_vlm % n_exp == 0,
            f"must divide num_vlm_layers={n_vlm} (<= 0: as many as the VLM)",
        )
        check(
            self,
            "attention_mode",
            self.attention_mode in ("cross_attn", "self_attn"),
            "must be 'cross_attn' or 'self_attn'",
        )
        every = n_vlm // n_exp
        # an expert layer beside a joint layer must project its own hidden states to keys and
        # values, one beside a cross-attention layer the VLM's keys and values
        bad = [i for i in range(n_vlm) if not self._expert_fits(i, every)]
        check(
            self,
            "num_expert_layers",
            not bad,
            f"with self_attn_every_n_layers={self.self_attn_every_n_layers} leaves VLM layers "
            f"{bad} without a fitting expert layer (with fewer expert layers than VLM layers, "
            "only self_attn_every_n_layers <= 0, cross-attention everywhere, fits)",
        )
        check(self, "num_empty_cameras", self.num_empty_cameras >= 0, "must be >= 0")
        check(self, "tokenizer_max_length", self.tokenizer_max_length >= 1, "must be >= 1")
        check(
            self,
            "pad_language_to",
            self.pad_language_to in ("longest", "max_length"),
            "must be 'longest' or 'max_length'",
        )
        check(
            self,
            "normalization",
            self.normalization in ("zscore", "quantile"),
            "must be 'zscore' or 'quantile'",
        )
        if isinstance(self.norm_stats, str | Path):
            from rlinf_vla.policies.pi0.processor import find_norm_stats

            found = find_norm_stats(Path(self.norm_stats).expanduser())
            if found is None:
                raise FileNotFoundError(
                    f"norm_stats={self.norm_stats!r}: no normalisation statistics there"
                )
            self.norm_stats = found.stats
        if self.norm_stats is not None:
            check(self, "norm_stats", "actions" in self.norm_stats, "needs an 'actions' entry")

    @property
    def expert_layers(self) -> int:
        """The number of action-expert layers."""
        return self.num_expert_layers if self.num_expert_layers > 0 else self.num_vlm_layers

    def is_self_attn_layer(self, i: int) -> bool:
        """Whether VLM layer ``i`` is joint self-attention (else the actions cross-attend)."""
        if self.attention_mode != "cross_attn":
            return True
        n = self.self_attn_every_n_layers
        return n > 0 and i % n == 0

    def _expert_fits(self, i: int, every: int) -> bool:
        joint = self.is_self_attn_layer(i)
        if i % every:  # no expert layer here: only a cross-attention layer can skip it
            return not joint
        return joint == self.expert_has_self_kv(i // every)

    def expert_has_self_kv(self, j: int) -> bool:
        """Whether expert layer ``j``'s ``k_proj`` / ``v_proj`` read its own hidden states
        (else the VLM's keys and values: lerobot numbers these by expert layer)."""
        if self.attention_mode != "cross_attn":
            return True
        n = self.self_attn_every_n_layers
        return n > 0 and j % n == 0

    @property
    def vlm_width(self) -> int:
        return int(self.vlm_config["text_config"]["hidden_size"])

    @property
    def expert_width(self) -> int:
        return int(self.vlm_width * self.expert_width_multiplier)

    @property
    def expert_intermediate_size(self) -> int:
        """lerobot's expert MLP width: ``4 * int(2 w / 3)`` rounded up to a multiple of 256."""
        hidden = 4 * int(2 * self.expert_width / 3)
        return 256 * ((hidden + 255) // 256)

"""SmolVLA transforms: camera images -> ``[-1, 1]`` slots with masks, the prompt with its
newline, the state and the actions (un)normalised as lerobot's processor pipelines do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlinf_vla.policies.base import require_cameras
from rlinf_vla.policies.smolvla.config import SmolVLAConfig
from rlinf_vla.policies.tokenizers import (
    build_offline_tokenizer,
    has_tokenizer_files,
    load_text_tokenizer,
)
from rlinf_vla.policies.transforms import images_to_float
from rlinf_vla.types import Observation

__all__ = [
    "LeRobotNorm",
    "SmolVLAInputs",
    "SmolVLAProcessor",
    "resize_with_pad_top_left",
]

#: lerobot's normaliser epsilon (``NormalizerProcessorStep.eps``).
LEROBOT_EPS = 1e-8


def resize_with_pad_top_left(x: Tensor, width: int, height: int) -> Tensor:
    """Resize ``[B, 3, H, W]`` keeping the aspect ratio (bilinear, no antialiasing) so it fits
    ``height x width``, then pad with zeros at the left and the top (SmolVLA's layout)."""
    h, w = x.shape[-2:]
    ratio = max(w / width, h / height)
    nh, nw = int(h / ratio), int(w / ratio)
    y = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False)
    return F.pad(y, (max(0, width - nw), 0, max(0, height - nh), 0), value=0.0)


class LeRobotNorm:
    """lerobot's normalisation of one feature: ``zscore`` ``(x - mean) / (std + eps)`` and back
    ``x std + mean``; ``quantile`` ``2 (x - q01) / (q99 - q01) - 1`` (``eps`` for a zero
    range) and back. Without statistics: the identity."""

    def __init__(self, stats: Mapping[str, Any] | None, mode: str) -> None:
        self.mode = mode
        self.stats = (
            {k: torch.as_tensor(v, dtype=torch.float32) for k, v in stats.items()}
            if stats is not None
            else None
        )

    def _get(self, key: str, x: Tensor) -> Tensor:
        return self.stats[key][: x.shape[-1]].to(x.device)

    def _range(self, x: Tensor) -> tuple[Tensor, Tensor]:
        lo, hi = self._get("q01", x), self._get("q99", x)
        d = hi - lo
        return lo, torch.where(d == 0, torch.full_like(d, LEROBOT_EPS), d)

    def normalize(self, x: Tensor) -> Tensor:
        x = x.float()
        if self.stats is None:
            return x
        if self.mode == "zscore":
            return (x - self._get("mean", x)) / (self._get("std", x) + LEROBOT_EPS)
        lo, d = self._range(x)
        return 2.0 * (x - lo) / d - 1.0

    def unnormalize(self, x: Tensor) -> Tensor:
        x = x.float()
        if self.stats is None:
            return x
        if self.mode == "zscore":
            return x * self._get("std", x) + self._get("mean", x)
        lo, d = self._range(x)
        return (x + 1.0) * d / 2.0 + lo


@dataclass
class SmolVLAInputs:
    """Model inputs of one batch.

    Attributes:
        images: ``float32 [B, n_slots, 3, S_h, S_w]`` in ``[-1, 1]``.
        image_masks: ``bool [B, n_slots]`` (False for the empty slots).
        tokens: ``long [B, L]`` prompt ids, right-padded.
        token_mask: ``bool [B, L]``.
        state: ``float32 [B, max_state_dim]`` normalised and zero-padded.
    """

    images: Tensor
    image_masks: Tensor
    tokens: Tensor
    token_mask: Tensor
    state: Tensor


class SmolVLAProcessor:
    """The frozen transforms around the SmolVLA model.

    Args:
        config: the policy config.
        tokenizer: the backbone's tokenizer (a ``transformers`` tokenizer with a pad token).
    """

    def __init__(self, config: SmolVLAConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        stats = config.norm_stats or {}
        self.action_norm = LeRobotNorm(stats.get("actions"), config.normalization)
        self.state_norm = LeRobotNorm(stats.get("state"), config.normalization)

    @classmethod
    def make_tokenizer(cls, config: SmolVLAConfig, checkpoint: Path | None = None) -> Any:
        """``config.tokenizer``, else tokenizer files in the checkpoint (or its ``tokenizer/``
        folder), else the backbone's folder or cache entry, else (random weights only) an
        offline tokenizer of the backbone's vocabulary size."""
        candidates = [config.tokenizer]
        if checkpoint is not None:
            candidates += [checkpoint, checkpoint / "tokenizer", checkpoint / config.vlm_model_name]
        candidates.append(Path(config.vlm_model_name).expanduser())
        for candidate in candidates:
            if candidate is not None and has_tokenizer_files(candidate):
                return _with_pad(load_text_tokenizer(candidate))
        cached = _cached_tokenizer(config.vlm_model_name)
        if cached is not None:
            return _with_pad(load_text_tokenizer(cached))
        if checkpoint is not None:
            raise FileNotFoundError(
                f"{checkpoint} has no tokenizer files and {config.vlm_model_name!r} is not in "
                "the local Hugging Face cache: set tokenizer=<folder with the backbone's "
                "tokenizer.json> (lerobot loads it from the backbone's hub repo)"
            )
        vocab = int(config.vlm_config["text_config"]["vocab_size"])
        return _with_pad(build_offline_tokenizer(vocab, "gemma"))

    # -- inputs ---------------------------------------------------------------------------------
    def images(
        self, obs: Observation, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """Image slots ``float32 [B, n_slots, 3, S_h, S_w]`` in ``[-1, 1]`` and their mask."""
        cfg = self.config
        require_cameras(obs, cfg.image_keys, "smolvla")
        slots = []
        for key in cfg.image_keys:
            x = images_to_float(obs.images[key].to(device))
            if cfg.resize_imgs_with_padding is not None:
                x = resize_with_pad_top_left(x, *cfg.resize_imgs_with_padding)
            slots.append(x * 2.0 - 1.0)
        if len({s.shape for s in slots}) > 1:
            raise ValueError(
                "smolvla: cameras of different sizes need resize_imgs_with_padding "
                f"(got {[tuple(s.shape[-2:]) for s in slots]})"
            )
        slots += [torch.full_like(slots[-1], -1.0)] * cfg.num_empty_cameras
        masks = torch.zeros(obs.batch_size, len(slots), dtype=torch.bool)
        masks[:, : len(cfg.image_keys)] = True
        return torch.stack(slots, dim=1), masks

    def state(self, obs: Observation) -> Tensor:
        """Normalised state zero-padded to ``max_state_dim``."""
        cfg = self.config
        if obs.state is None:
            raise KeyError(
                "policy 'smolvla' needs proprioception (obs.state), the observation has None"
            )
        if obs.state.shape[-1] > cfg.max_state_dim:
            raise ValueError(
                f"obs.state has {obs.state.shape[-1]} dims, more than max_state_dim="
                f"{cfg.max_state_dim}"
            )
        state = self.state_norm.normalize(obs.state.cpu())
        return F.pad(state, (0, cfg.max_state_dim - state.shape[-1]))

    def tokens(self, instructions: list[str]) -> tuple[Tensor, Tensor]:
        """Prompt ids and mask: each instruction ends with a newline, right-padded."""
        cfg = self.config
        texts = [t if t.endswith("\n") else f"{t}\n" for t in instructions]
        enc = self.tokenizer(
            texts,
            max_length=cfg.tokenizer_max_length,
            truncation=True,
            padding=cfg.pad_language_to,
            padding_side="right",
            return_tensors="pt",
        )
        return enc["input_ids"].long(), enc["attention_mask"].bool()

    def __call__(self, obs: Observation, device: torch.device | str | None = None) -> SmolVLAInputs:
        """The model inputs of ``obs``; with ``device`` the images are transformed there."""
        images, masks = self.images(obs, device)
        tokens, token_mask = self.tokens(list(obs.instruction))
        return SmolVLAInputs(images, masks, tokens, token_mask, self.state(obs))

    # -- outputs --------------------------------------------------------------------------------
    def unnormalize_actions(self, actions: Tensor) -> Tensor:
        """Model actions ``[B, K, max_action_dim]`` -> env actions ``[B, K, action_dim]``."""
        return self.action_norm.unnormalize(actions[..., : self.config.action_dim])

    def normalize_actions(self, actions: Tensor) -> Tensor:
        """Env actions ``[B, K, A]`` -> normalised, zero-padded to ``max_action_dim``."""
        x = self.action_norm.normalize(actions)
        return F.pad(x, (0, self.config.max_action_dim - x.shape[-1]))


def _with_pad(tokenizer: Any) -> Any:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _cached_tokenizer(name: str) -> Path | None:
    if name.count("/") != 1 or Path(name).exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(name, "tokenizer.json")
    return Path(found).parent if isinstance(found, str) else None

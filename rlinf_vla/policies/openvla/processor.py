"""OpenVLA's transforms: images -> pixel values, instructions -> prompt ids, actions <-> tokens.

Separate from the model (openpi's split): everything here is frozen and has no parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.policies.base import require_cameras
from rlinf_vla.policies.openvla.config import OpenVLAConfig, backbone_mean_std
from rlinf_vla.policies.tokenizers import (
    ActionTokenizer,
    build_offline_tokenizer,
    has_tokenizer_files,
    load_text_tokenizer,
)
from rlinf_vla.policies.transforms import (
    Bounds,
    BoundsQ99,
    EnvGripper,
    Identity,
    ProprioBounds,
    ProprioBoundsQ99,
    RLDSGripper,
    center_crop,
    float_to_uint8_tf,
    images_to_float,
    normalize_images,
    resize_images,
    rlds_resize,
)
from rlinf_vla.types import Observation

__all__ = [
    "PROMPT",
    "OpenVLAProcessor",
    "PromptBatch",
    "backbone_mean_std",
    "load_norm_stats",
    "select_stats",
]

#: OpenVLA's inference prompt (``PurePromptBuilder("openvla")``); instructions are lower-cased.
PROMPT = "In: What action should the robot take to {instruction}?\nOut:"


@dataclass
class PromptBatch:
    """Tokenised prompts, laid out ``[BOS, PAD..., prompt tokens..., ▁]``.

    The BOS stays at position 0 so the image patches can follow it, the padding sits between BOS
    and the text (RLinf's left padding), and every prompt ends at the last column, so the
    positions after the prompt (action tokens) line up across the batch.

    Attributes:
        input_ids: ``long [B, L]``.
        attention_mask: ``long [B, L]`` (0 on padding).
    """

    input_ids: Tensor
    attention_mask: Tensor


def load_norm_stats(path: Path) -> dict[str, Any] | None:
    """``dataset_statistics.json`` of a checkpoint folder, or ``None``."""
    file = path / "dataset_statistics.json"
    return json.loads(file.read_text()) if file.exists() else None


def select_stats(norm_stats: dict[str, Any] | None, key: str | None) -> dict[str, Any] | None:
    """The statistics of dataset ``key`` (the only one when ``key`` is ``None``)."""
    if not norm_stats:
        return None
    if key is None:
        if len(norm_stats) != 1:
            raise ValueError(
                f"norm_stats has {len(norm_stats)} datasets; set unnorm_key to one of "
                f"{sorted(norm_stats)}"
            )
        key = next(iter(norm_stats))
    if key not in norm_stats:
        raise KeyError(f"unnorm_key {key!r} not in norm_stats (known: {sorted(norm_stats)})")
    return norm_stats[key]


class OpenVLAProcessor:
    """Input transforms (images, prompt) and output transforms (tokens -> env actions).

    Args:
        config: the policy config.
        tokenizer: a ``transformers`` tokenizer with the Llama-2 layout (BOS ``<s>``, word piece
            ``▁``), e.g. ``load_text_tokenizer(path)`` or :func:`build_offline_tokenizer`.
    """

    #: the policy name used in error messages.
    policy_name = "openvla"
    #: ``+eps`` inside the un-normalisation (openvla's ``predict_action``: none; OFT: 1e-8).
    unnorm_eps: float = 0.0

    def __init__(self, config: OpenVLAConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.action_tokenizer = ActionTokenizer(config.base_vocab_size, config.n_action_bins)
        self.bos_id = int(tokenizer.bos_token_id)
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(config.text_config.get("pad_token_id", config.base_vocab_size))
        self.space_id = int(tokenizer.convert_tokens_to_ids("▁"))
        self.mean_std = list(zip(config.image_mean, config.image_std, strict=True))
        stats = select_stats(config.norm_stats, config.unnorm_key)
        self.action_stats = stats.get("action") if stats else None
        self.proprio_stats = stats.get("proprio") if stats else None
        action_cls, proprio_cls = self.normalization_classes()
        self.action_norm = (
            action_cls(self.action_stats, eps=self.unnorm_eps) if stats else Identity()
        )
        self.gripper = RLDSGripper() if config.gripper == "rlds" else EnvGripper()
        self.proprio_norm = (
            proprio_cls(self.proprio_stats) if self.proprio_stats is not None else Identity()
        )

    def normalization_classes(self) -> tuple[type[Bounds], type[ProprioBounds]]:
        """The action and proprio normalisations: OpenVLA's ``BOUNDS_Q99``."""
        return BoundsQ99, ProprioBoundsQ99

    @classmethod
    def make_tokenizer(cls, config: OpenVLAConfig, checkpoint: Path | None = None) -> Any:
        """``config.tokenizer``, else the checkpoint's tokenizer files, else an offline tokenizer
        with the configured base vocabulary and ``<PAD>`` at ``pad_token_id``."""
        for candidate in (config.tokenizer, checkpoint):
            if candidate is not None and has_tokenizer_files(candidate):
                return load_text_tokenizer(candidate)
        if checkpoint is not None:
            raise FileNotFoundError(
                f"{checkpoint} has no tokenizer files (tokenizer.json / tokenizer.model): set "
                "tokenizer=<folder with the Llama-2 tokenizer of the checkpoint>"
            )
        tok = build_offline_tokenizer(config.base_vocab_size, "llama", pad_token="<PAD>")
        pad_id = int(config.text_config.get("pad_token_id", config.base_vocab_size))
        if tok.pad_token_id != pad_id:
            raise ValueError(
                f"the offline tokenizer puts <PAD> at {tok.pad_token_id}, the config at {pad_id}"
            )
        return tok

    # -- inputs ---------------------------------------------------------------------------------
    #: ``image_pipeline=rlds`` does the JPEG round trip also for images already at the model
    #: size (openvla's ``resize_image`` always runs; OFT's ``resize_image_for_policy`` only for
    #: other sizes).
    rlds_jpeg_at_model_size: bool = True

    def pixel_values(self, obs: Observation, device: torch.device | str | None = None) -> Tensor:
        """``float32 [B, 3 * n_backbones * n_cameras, S, S]``: per camera, one normalised copy
        per backbone (DINOv2 channels first, then SigLIP), cameras in ``image_keys`` order.

        With ``device`` the ``uint8`` images move there first and the transforms run there (a
        quarter of the bytes of the float pixels cross to a GPU, and the resize runs on it);
        ``image_pipeline=rlds`` resizes on the host first."""
        cfg = self.config
        require_cameras(obs, cfg.image_keys, self.policy_name)
        out = []
        for key in cfg.image_keys:
            x = self.camera_pixels(obs.images[key], device)
            out += [normalize_images(x, mean, std) for mean, std in self.mean_std]
        return torch.cat(out, dim=1)

    def camera_pixels(self, images: Tensor, device: torch.device | str | None = None) -> Tensor:
        """One camera's ``uint8 [B, H, W, 3]`` -> ``float32 [B, 3, S, S]`` in ``[0, 1]``, before
        the per-backbone normalisation: resized (``image_pipeline``), then center-cropped."""
        cfg = self.config
        size = cfg.image_sizes[0]
        if cfg.image_pipeline == "rlds":
            # The official order: the RLDS resize squashes to S x S (so a letterbox has nothing
            # left to pad), the crop works on uint8 pixels and returns uint8 pixels.
            same = tuple(images.shape[1:3]) == (size, size)
            jpeg = self.rlds_jpeg_at_model_size or not same
            if jpeg:
                images = rlds_resize(images, size, jpeg=jpeg)
            x = images_to_float(images.to(device))
            if cfg.center_crop:
                x = float_to_uint8_tf(center_crop(x, 0.9)).float() / 255.0
            return x
        x = images_to_float(images.to(device))
        if cfg.image_resize_strategy == "letterbox":
            x = _letterbox(x, self.letterbox_fill)
        x = resize_images(x, size)
        if cfg.center_crop:
            x = center_crop(x, 0.9)
        return x

    @property
    def letterbox_fill(self) -> tuple[float, ...]:
        """Prismatic's letterbox colour: ``int(255 * mean)`` of the last backbone's mean (the
        official processor's loop over the backbones keeps the last one)."""
        return tuple(int(m * 255) / 255.0 for m in self.config.image_mean[-1])

    def prompt(self, instruction: str) -> str:
        return PROMPT.format(instruction=instruction.lower())

    def prompts(self, instructions: list[str], device: torch.device | str = "cpu") -> PromptBatch:
        """Tokenise the prompts (with BOS, ending with ``▁``), padded after the BOS."""
        rows = []
        for text in instructions:
            ids = list(self.tokenizer(self.prompt(text)).input_ids)
            if ids[0] != self.bos_id:
                ids = [self.bos_id, *ids]
            if ids[-1] != self.space_id:
                ids.append(self.space_id)
            rows.append(ids)
        length = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, ids in enumerate(rows):
            n = len(ids) - 1
            input_ids[i, 0] = ids[0]
            mask[i, 0] = 1
            input_ids[i, length - n :] = torch.tensor(ids[1:])
            mask[i, length - n :] = 1
        return PromptBatch(input_ids.to(device), mask.to(device))

    def proprio(self, obs: Observation, dim: int) -> Tensor:
        """Normalised proprioception ``float32 [B, dim]`` (OFT's ``normalize_proprio`` with the
        ``proprio`` stats, :class:`ProprioBoundsQ99`)."""
        if obs.state is None:
            raise KeyError("this policy needs proprioception (obs.state), the observation has None")
        if obs.state.shape[-1] != dim:
            raise ValueError(f"obs.state has {obs.state.shape[-1]} dims, the policy expects {dim}")
        return self.proprio_norm.normalize(obs.state)

    # -- outputs --------------------------------------------------------------------------------
    def tokens_to_actions(self, ids: Tensor) -> Tensor:
        """Action token ids ``[B, K, A]`` -> env actions ``float32 [B, K, A]`` (un-normalised,
        the gripper in the envs' convention)."""
        return self.unnormalize_actions(self.action_tokenizer.decode(ids))

    def actions_to_tokens(self, actions: Tensor) -> Tensor:
        """Env actions ``[B, K, A]`` -> action token ids ``long [B, K, A]``."""
        return self.action_tokenizer.encode(self.normalize_actions(actions))

    def normalize_actions(self, actions: Tensor) -> Tensor:
        """Env actions -> the model's normalised actions (``gripper`` convention, then
        ``BOUNDS_Q99``)."""
        return self.action_norm.normalize(self.gripper.from_env(actions))

    def unnormalize_actions(self, actions: Tensor) -> Tensor:
        """The model's normalised actions -> env actions."""
        return self.gripper.to_env(self.action_norm.unnormalize(actions))


def _letterbox(x: Tensor, fill: tuple[float, ...]) -> Tensor:
    """Pad ``[B, 3, H, W]`` to a square with the colour ``fill`` (Prismatic's letterbox)."""
    h, w = x.shape[-2:]
    if h == w:
        return x
    side = max(h, w)
    top, left = (side - h) // 2, (side - w) // 2
    out = torch.empty(x.shape[0], 3, side, side, dtype=x.dtype, device=x.device)
    out[:] = torch.tensor(fill, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    out[..., top : top + h, left : left + w] = x
    return out

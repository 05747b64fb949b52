"""Small, frozen input/output transforms shared by the processors (openpi's "transforms").

Images arrive as ``uint8 [B, H, W, 3]``; every function here returns ``float32 [B, 3, S, S]``.
Normalisation statistics follow the layouts of the official checkpoints (see each function).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BoundsQ99",
    "EnvGripper",
    "ProprioBoundsQ99",
    "RLDSGripper",
    "ZScore",
    "center_crop",
    "images_to_float",
    "normalize_images",
    "resize_images",
    "resize_with_pad",
]


def images_to_float(images: Tensor) -> Tensor:
    """``uint8 [B, H, W, 3]`` -> ``float32 [B, 3, H, W]`` in ``[0, 1]``."""
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be [B, H, W, 3], got {tuple(images.shape)}")
    return images.permute(0, 3, 1, 2).float() / 255.0


def resize_images(x: Tensor, size: int, mode: str = "bicubic") -> Tensor:
    """Resize ``[B, 3, H, W]`` to ``[B, 3, size, size]`` (antialiased, clamped to ``[0, 1]``)."""
    if x.shape[-2:] == (size, size):
        return x
    y = F.interpolate(x, size=(size, size), mode=mode, antialias=True, align_corners=False)
    return y.clamp(0.0, 1.0)


def center_crop(x: Tensor, area_scale: float = 0.9) -> Tensor:
    """Crop the central ``area_scale`` of the image area and resize back to the input size
    (OpenVLA-OFT's test-time counterpart of its random-crop augmentation)."""
    h, w = x.shape[-2:]
    ch, cw = round(h * math.sqrt(area_scale)), round(w * math.sqrt(area_scale))
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = x[..., top : top + ch, left : left + cw]
    return F.interpolate(crop, size=(h, w), mode="bilinear", antialias=True, align_corners=False)


def resize_with_pad(x: Tensor, size: int) -> Tensor:
    """Resize keeping the aspect ratio, then pad with zeros (black) to ``size x size``
    (openpi's ``resize_with_pad``)."""
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    ratio = max(h / size, w / size)
    nh, nw = int(h / ratio), int(w / ratio)
    y = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
    pad_h, pad_w = size - nh, size - nw
    top, left = pad_h // 2, pad_w // 2
    return F.pad(y.clamp(0.0, 1.0), (left, pad_w - left, top, pad_h - top), value=0.0)


def normalize_images(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def _vec(stats: Mapping[str, Any], key: str, dim: int | None = None) -> Tensor:
    v = torch.as_tensor(stats[key], dtype=torch.float32)
    return v if dim is None else v[:dim]


class BoundsQ99:
    """OpenVLA's ``BOUNDS_Q99`` normalisation with a per-dim mask.

    ``normalize: x_n = clip(2 (x - q01) / (q99 - q01 + 1e-8) - 1, -1, 1)`` where ``mask``
    (``x`` itself elsewhere); ``unnormalize: x = 0.5 (x_n + 1) (q99 - q01 + eps) + q01`` where
    ``mask``. ``stats`` holds ``q01``, ``q99`` and optionally ``mask`` (default all ``True``),
    as ``dataset_statistics.json[<dataset>]["action"]``.
    """

    def __init__(self, stats: Mapping[str, Any], eps: float = 0.0) -> None:
        self.q01 = _vec(stats, "q01")
        self.q99 = _vec(stats, "q99")
        mask = stats.get("mask")
        self.mask = (
            torch.ones_like(self.q01, dtype=torch.bool)
            if mask is None
            else torch.as_tensor(mask, dtype=torch.bool)
        )
        self.eps = eps

    @property
    def dim(self) -> int:
        return self.q01.numel()

    def _parts(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        d = x.shape[-1]
        if d > self.dim:
            raise ValueError(f"statistics have {self.dim} dims, data has {d}")
        return (self.q01[:d].to(x.device), self.q99[:d].to(x.device), self.mask[:d].to(x.device))

    def normalize(self, x: Tensor) -> Tensor:
        q01, q99, mask = self._parts(x)
        y = (2 * (x.float() - q01) / (q99 - q01 + 1e-8) - 1).clamp(-1, 1)
        y = torch.where(q01 == q99, torch.zeros_like(y), y)
        return torch.where(mask, y, x.float())

    def unnormalize(self, x: Tensor) -> Tensor:
        q01, q99, mask = self._parts(x)
        y = 0.5 * (x.float() + 1) * (q99 - q01 + self.eps) + q01
        return torch.where(mask, y, x.float())


class ProprioBoundsQ99(BoundsQ99):
    """OpenVLA-OFT's ``normalize_proprio`` at inference: ``clip(where(mask, 2 (x - q01) /
    (q99 - q01 + 1e-8) - 1, x), -1, 1)``. Unlike the training data's action normalisation
    (:class:`BoundsQ99`) a dim with ``q01 == q99`` is not zeroed (it goes to -1 or +1) and the
    clip covers unmasked dims too."""

    def normalize(self, x: Tensor) -> Tensor:
        q01, q99, mask = self._parts(x)
        y = 2 * (x.float() - q01) / (q99 - q01 + 1e-8) - 1
        return torch.where(mask, y, x.float()).clamp(-1, 1)


class ZScore:
    """``(x - mean) / (std + 1e-6)`` and back (openpi's normalisation for π0)."""

    def __init__(self, stats: Mapping[str, Any]) -> None:
        self.mean = _vec(stats, "mean")
        self.std = _vec(stats, "std")

    def normalize(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        return (x.float() - self.mean[:d].to(x.device)) / (self.std[:d].to(x.device) + 1e-6)

    def unnormalize(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        return x.float() * (self.std[:d].to(x.device) + 1e-6) + self.mean[:d].to(x.device)


class Quantile:
    """``(x - q01) / (q99 - q01 + 1e-6) * 2 - 1`` and back (openpi's normalisation for π0.5)."""

    def __init__(self, stats: Mapping[str, Any]) -> None:
        self.q01 = _vec(stats, "q01")
        self.q99 = _vec(stats, "q99")

    def normalize(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        q01, q99 = self.q01[:d].to(x.device), self.q99[:d].to(x.device)
        return (x.float() - q01) / (q99 - q01 + 1e-6) * 2.0 - 1.0

    def unnormalize(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        q01, q99 = self.q01[:d].to(x.device), self.q99[:d].to(x.device)
        return (x.float() + 1.0) / 2.0 * (q99 - q01 + 1e-6) + q01


class Identity:
    """No normalisation (a policy built without statistics works in normalised units)."""

    def normalize(self, x: Tensor) -> Tensor:
        return x.float()

    def unnormalize(self, x: Tensor) -> Tensor:
        return x.float()


class RLDSGripper:
    """The gripper convention of OpenVLA's RLDS training data (last action dim: 1 = open,
    0 = close) to and from the one every env and robot of this package takes (+1 close,
    -1 open).

    ``to_env``: ``-sign(2 a - 1)``, the official LIBERO evaluation's ``normalize_gripper_action``
    (``[0, 1] -> [-1, +1]``, binarised) followed by ``invert_gripper_action``. ``from_env``:
    ``(1 - g) / 2``, so demonstrations in the env's convention train the model in its own
    (``to_env(from_env(g)) == g`` for ``g = +-1``). The other dims pass unchanged.
    """

    def to_env(self, actions: Tensor) -> Tensor:
        out = actions.clone()
        out[..., -1] = -torch.sign(2 * actions[..., -1] - 1)
        return out

    def from_env(self, actions: Tensor) -> Tensor:
        out = actions.clone()
        out[..., -1] = (1 - actions[..., -1]) / 2
        return out


class EnvGripper:
    """The model already speaks the envs' gripper convention: nothing to map."""

    def to_env(self, actions: Tensor) -> Tensor:
        return actions

    def from_env(self, actions: Tensor) -> Tensor:
        return actions

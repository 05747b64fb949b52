"""Small, frozen input/output transforms shared by the processors (openpi's "transforms").

Images arrive as ``uint8 [B, H, W, 3]``; every function here returns ``float32 [B, 3, S, S]``.
Normalisation statistics follow the layouts of the official checkpoints (see each function).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Bounds",
    "BoundsQ99",
    "EnvGripper",
    "ProprioBounds",
    "ProprioBoundsQ99",
    "RLDSGripper",
    "ZScore",
    "center_crop",
    "crop_and_resize",
    "float_to_uint8_tf",
    "images_to_float",
    "normalize_images",
    "resize_images",
    "resize_with_pad",
    "rlds_resize",
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


def crop_and_resize(
    x: Tensor, box: Sequence[float], size: tuple[int, int], extrapolation_value: float = 0.0
) -> Tensor:
    """TensorFlow's ``tf.image.crop_and_resize`` (bilinear) of every image of ``[B, C, H, W]``
    with one ``box`` ``(y1, x1, y2, x2)`` in normalised coordinates, to ``size`` ``(h, w)``.

    TF's kernel maps a normalised coordinate ``y`` to the pixel coordinate ``y (H - 1)``
    (corner-aligned) and samples, in float32, ``in_y(i) = y1 (H - 1) + i (y2 - y1) (H - 1) /
    (h - 1)`` (``0.5 (y1 + y2) (H - 1)`` when ``h == 1``), likewise for x, then interpolates
    ``top = tl + (tr - tl) fx``, ``bottom = bl + (br - bl) fx``, ``top + (bottom - top) fy``
    between the pixels at ``floor`` and ``ceil``; points outside ``[0, H - 1]`` get
    ``extrapolation_value``. No antialiasing. Returns float32.
    """
    h_in, w_in = x.shape[-2:]
    y1, x1, y2, x2 = (torch.tensor(float(v), dtype=torch.float32) for v in box)
    ys = _tf_sample_points(y1, y2, h_in, size[0], x.device)
    xs = _tf_sample_points(x1, x2, w_in, size[1], x.device)
    ys_ok = (ys >= 0) & (ys <= h_in - 1)
    xs_ok = (xs >= 0) & (xs <= w_in - 1)
    ys_c, xs_c = ys.clamp(0, h_in - 1), xs.clamp(0, w_in - 1)
    top, bottom = ys_c.floor().long(), ys_c.ceil().long()
    left, right = xs_c.floor().long(), xs_c.ceil().long()
    fy = (ys_c - top.float()).view(-1, 1)
    fx = (xs_c - left.float()).view(1, -1)
    img = x.float()
    rows_t, rows_b = img[..., top, :], img[..., bottom, :]
    tl, tr = rows_t[..., left], rows_t[..., right]
    bl, br = rows_b[..., left], rows_b[..., right]
    t = tl + (tr - tl) * fx
    b = bl + (br - bl) * fx
    out = t + (b - t) * fy
    inside = ys_ok.view(-1, 1) & xs_ok.view(1, -1)
    return torch.where(inside, out, torch.full_like(out, extrapolation_value))


def _tf_sample_points(lo: Tensor, hi: Tensor, n_in: int, n_out: int, device: Any) -> Tensor:
    """The float32 sample coordinates of TF's ``crop_and_resize`` along one axis."""
    if n_out == 1:
        return (0.5 * (lo + hi) * (n_in - 1)).view(1).to(device)
    scale = (hi - lo) * (n_in - 1) / (n_out - 1)
    i = torch.arange(n_out, dtype=torch.float32)
    return (lo * (n_in - 1) + i * scale).to(device)


def center_crop(x: Tensor, area_scale: float = 0.9) -> Tensor:
    """The official test-time crop of OpenVLA and OpenVLA-OFT (``crop_and_resize`` in their
    ``experiments/robot/openvla_utils.py``, the counterpart of the RLDS random-crop
    augmentation): a centred box of side ``sqrt(area_scale)`` (float32, as TF computes it)
    cut and resampled to the input size by :func:`crop_and_resize`."""
    side = torch.tensor(area_scale, dtype=torch.float32).sqrt().clamp(0, 1)
    offset = (1 - side) / 2
    box = (offset.item(), offset.item(), (offset + side).item(), (offset + side).item())
    return crop_and_resize(x, box, (x.shape[-2], x.shape[-1]))


def float_to_uint8_tf(x: Tensor) -> Tensor:
    """``tf.image.convert_image_dtype(clip(x, 0, 1), tf.uint8, saturate=True)``: float32
    ``x * 255.5`` truncated (not rounded) to ``uint8``, as the official crop returns it."""
    return (x.float().clamp(0, 1) * 255.5).clamp(0, 255).to(torch.uint8)


def rlds_resize(images: Tensor, size: int, jpeg: bool = True, quality: int = 95) -> Tensor:
    """The resize of the RLDS dataset builder, which the official OpenVLA / OpenVLA-OFT
    evaluations apply to every camera image (``resize_image`` / ``resize_image_for_policy``):
    a JPEG round trip (TF's ``encode_jpeg`` defaults: quality 95, 4:2:0 chroma subsampling),
    then a Lanczos-3 antialiased resize to ``size x size``, rounded to ``uint8``.

    Done with PIL on the host, image by image: ``uint8 [B, H, W, 3]`` (any device) ->
    ``uint8 [B, size, size, 3]`` on the CPU. PIL's Lanczos runs in fixed point on 8-bit
    pixels, TF's in float32 before the rounding: a pixel may differ by one level.
    ``jpeg=False`` skips the round trip (OFT skips the whole step for images already at the
    model size).
    """
    import io

    import numpy as np
    from PIL import Image

    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != torch.uint8:
        raise ValueError(
            f"images must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}"
        )
    out = []
    for frame in images.cpu().numpy():
        img = Image.fromarray(frame, "RGB")
        if jpeg:
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=quality, subsampling=2)
            buf.seek(0)
            img = Image.open(buf).convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.LANCZOS)
        out.append(np.asarray(img, dtype=np.uint8))
    return torch.from_numpy(np.stack(out))


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


class Bounds:
    """OpenVLA-OFT's ``BOUNDS`` normalisation (min/max, its ALOHA checkpoints) with a per-dim
    mask; :class:`BoundsQ99` is the same with the 1st/99th percentiles.

    ``normalize`` (the RLDS training data's): ``x_n = clip(2 (x - lo) / (hi - lo + 1e-8) - 1,
    -1, 1)`` where ``mask`` (``x`` itself elsewhere), and 0 on dims with ``min == max``;
    ``unnormalize`` (``predict_action``): ``x = 0.5 (x_n + 1) (hi - lo + eps) + lo`` where
    ``mask``. ``stats`` is ``dataset_statistics.json[<dataset>]["action"]``: ``lo``/``hi``
    under :attr:`low_key`/:attr:`high_key`, ``mask`` optional (default all ``True``).
    """

    low_key = "min"
    high_key = "max"

    def __init__(self, stats: Mapping[str, Any], eps: float = 0.0) -> None:
        for key in (self.low_key, self.high_key):
            if key not in stats:
                raise KeyError(
                    f"{type(self).__name__} needs the statistics' {key!r} entry; they have "
                    f"{sorted(stats)}"
                )
        self.low = _vec(stats, self.low_key)
        self.high = _vec(stats, self.high_key)
        mask = stats.get("mask")
        self.mask = (
            torch.ones_like(self.low, dtype=torch.bool)
            if mask is None
            else torch.as_tensor(mask, dtype=torch.bool)
        )
        # The training data zeroes the dims with min == max (whatever the bounds).
        if "min" in stats and "max" in stats:
            self.constant = _vec(stats, "min") == _vec(stats, "max")
        else:
            self.constant = self.low == self.high
        self.eps = eps

    @property
    def dim(self) -> int:
        return self.low.numel()

    def _parts(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        d = x.shape[-1]
        if d > self.dim:
            raise ValueError(f"statistics have {self.dim} dims, data has {d}")
        return (self.low[:d].to(x.device), self.high[:d].to(x.device), self.mask[:d].to(x.device))

    def normalize(self, x: Tensor) -> Tensor:
        lo, hi, mask = self._parts(x)
        y = (2 * (x.float() - lo) / (hi - lo + 1e-8) - 1).clamp(-1, 1)
        y = torch.where(mask, y, x.float())
        constant = self.constant[: x.shape[-1]].to(x.device)
        return torch.where(constant, torch.zeros_like(y), y)

    def unnormalize(self, x: Tensor) -> Tensor:
        lo, hi, mask = self._parts(x)
        y = 0.5 * (x.float() + 1) * (hi - lo + self.eps) + lo
        return torch.where(mask, y, x.float())


class BoundsQ99(Bounds):
    """OpenVLA's ``BOUNDS_Q99`` normalisation: :class:`Bounds` between ``q01`` and ``q99``."""

    low_key = "q01"
    high_key = "q99"


class ProprioBounds(Bounds):
    """OpenVLA-OFT's ``normalize_proprio`` at inference: ``clip(where(mask, 2 (x - lo) /
    (hi - lo + 1e-8) - 1, x), -1, 1)`` (min/max here, q01/q99 in :class:`ProprioBoundsQ99`).
    Unlike the training data's action normalisation a dim with ``lo == hi`` is not zeroed (it
    goes to -1 or +1) and the clip covers unmasked dims too."""

    def normalize(self, x: Tensor) -> Tensor:
        lo, hi, mask = self._parts(x)
        y = 2 * (x.float() - lo) / (hi - lo + 1e-8) - 1
        return torch.where(mask, y, x.float()).clamp(-1, 1)


class ProprioBoundsQ99(ProprioBounds):
    """:class:`ProprioBounds` between ``q01`` and ``q99`` (OFT's LIBERO checkpoints)."""

    low_key = "q01"
    high_key = "q99"


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

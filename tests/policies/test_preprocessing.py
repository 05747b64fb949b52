"""Image preprocessing of OpenVLA / OpenVLA-OFT against references computed here: TensorFlow's
``crop_and_resize`` sampling grid re-derived with numpy from its kernel's formula, the RLDS
resize with PIL directly, the normalisation by hand."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from rlinf_vla.policies import make_policy
from rlinf_vla.policies.transforms import center_crop, crop_and_resize, float_to_uint8_tf
from tests.policies.conftest import bounds_stats, make_obs


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------
def tf_crop_reference(img: np.ndarray, box, out_h: int, out_w: int) -> np.ndarray:
    """``tf.image.crop_and_resize`` (bilinear, extrapolation 0) of an ``[H, W, C]`` image,
    written from the kernel's formula: a normalised y maps to ``y (H - 1)``; sample ``i`` sits
    at ``y1 (H - 1) + i (y2 - y1) (H - 1) / (out_h - 1)``; bilinear between floor and ceil."""
    h, w = img.shape[:2]
    y1, x1, y2, x2 = (np.float32(v) for v in box)
    f32 = np.float32
    hs = (y2 - y1) * f32(h - 1) / f32(out_h - 1)
    ws = (x2 - x1) * f32(w - 1) / f32(out_w - 1)
    out = np.zeros((out_h, out_w, img.shape[2]), dtype=np.float64)
    for i in range(out_h):
        iy = float(y1 * f32(h - 1) + f32(i) * hs)
        if iy < 0 or iy > h - 1:
            continue
        t, b = math.floor(iy), math.ceil(iy)
        fy = iy - t
        for j in range(out_w):
            ix = float(x1 * f32(w - 1) + f32(j) * ws)
            if ix < 0 or ix > w - 1:
                continue
            lft, rgt = math.floor(ix), math.ceil(ix)
            fx = ix - lft
            top = img[t, lft] + (img[t, rgt] - img[t, lft]) * fx
            bot = img[b, lft] + (img[b, rgt] - img[b, lft]) * fx
            out[i, j] = top + (bot - top) * fy
    return out


def official_center_box() -> tuple[float, float, float, float]:
    # openvla's crop_and_resize: side sqrt(0.9), offsets (1 - side) / 2, in float32
    side = np.sqrt(np.float32(0.9))
    off = (np.float32(1) - side) / np.float32(2)
    return (off, off, off + side, off + side)


def pil_rlds_resize(frame: np.ndarray, size: int, jpeg: bool = True) -> np.ndarray:
    """JPEG at quality 95 with 4:2:0 subsampling, decode, PIL Lanczos to ``size``."""
    img = Image.fromarray(frame)
    if jpeg:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95, subsampling="4:2:0")
        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), resample=Image.Resampling.LANCZOS)
    return np.asarray(img)


def to_bchw(img: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))[None].float()


def smooth_image(size: int, seed: int = 0) -> np.ndarray:
    """A photo-like uint8 image (smooth gradients plus noise; JPEG changes it a little)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    base = np.stack([120 + 100 * np.sin(3 * xx), 90 + 80 * yy, 200 - 150 * xx * yy], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# TF crop grid
# ----------------------------------------------------------------------------------------------
# Both sides compute the sample positions in float32, in different orders of operations: they
# agree to about 1e-6 pixel, which between neighbours up to 255 apart moves a sample by up to
# ~3e-4 (the CI machine's CPU rounded them otherwise than this one). 1e-5 pixel at the steepest
# step bounds it; a grid off by any convention (half a pixel, H against H - 1) is off by units.
SAMPLE_ATOL = 1e-5 * 255


def test_center_crop_samples_tf_grid_on_a_small_image():
    img = (np.arange(8 * 8 * 3).reshape(8, 8, 3) * 7 % 256).astype(np.float32)
    expected = tf_crop_reference(img, official_center_box(), 8, 8)
    got = center_crop(to_bchw(img))[0].permute(1, 2, 0).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=SAMPLE_ATOL)  # values in [0, 255]
    # the same on [0, 1] pixels
    got01 = center_crop(to_bchw(img) / 255)[0].permute(1, 2, 0).double().numpy()
    np.testing.assert_allclose(got01, expected / 255, rtol=0, atol=SAMPLE_ATOL / 255)
    # By hand for a 6x6 ramp along x (pixel = column): sample j sits at x = off*5 + j*side*5/5
    ramp = np.tile(np.arange(6, dtype=np.float32)[None, :, None], (6, 1, 3))
    side = math.sqrt(0.9)
    row = center_crop(to_bchw(ramp))[0, 0, 0].tolist()
    assert row == pytest.approx([(1 - side) / 2 * 5 + j * side for j in range(6)], abs=1e-5)


def test_crop_and_resize_box_size_and_extrapolation():
    img = np.random.default_rng(1).integers(0, 256, (6, 7, 3)).astype(np.float32)
    for box, size in [((0.1, 0.2, 0.7, 0.9), (5, 4)), ((-0.2, 0.0, 0.5, 1.3), (6, 6))]:
        expected = tf_crop_reference(img, box, *size)
        got = crop_and_resize(to_bchw(img), box, size)[0].permute(1, 2, 0).double().numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=SAMPLE_ATOL)
    # the second box reaches outside: those samples are 0
    assert (crop_and_resize(to_bchw(img), (-0.2, 0.0, 0.5, 1.3), (6, 6))[..., 0, :] == 0).all()


def test_float_to_uint8_truncates_as_tf_convert_image_dtype():
    # convert_image_dtype(float -> uint8, saturate): x * 255.5, truncated, clipped
    x = torch.tensor([0.0, 0.0019, 0.5, 0.7, 0.999, 1.0, 1.7, -0.3])
    expected = [0, 0, 127, 178, 255, 255, 255, 0]  # 127.75 -> 127, 178.85 -> 178, 255.24 -> 255
    assert float_to_uint8_tf(x).tolist() == expected


# ----------------------------------------------------------------------------------------------
# RLDS resize (JPEG q95 + Lanczos) vs the torch path
# ----------------------------------------------------------------------------------------------
def _obs(frame: np.ndarray, cameras=("main",)):
    obs = make_obs(1, cameras, None, size=frame.shape[0])
    for k in cameras:
        obs.images[k] = torch.from_numpy(frame)[None].clone()
    return obs


@pytest.mark.parametrize("src", [40, 28])
def test_rlds_pipeline_is_pil_jpeg_then_lanczos(src):
    frame = smooth_image(src)
    p = make_policy("openvla", preset="tiny", image_pipeline="rlds", center_crop=False, seed=0)
    got = p.processor.camera_pixels(torch.from_numpy(frame)[None])[0]
    expected = pil_rlds_resize(frame, 28)  # openvla JPEGs even at the model size
    torch.testing.assert_close(got, to_bchw(expected)[0] / 255, rtol=0, atol=1e-7)
    if src == 28:
        assert not np.array_equal(expected, frame)  # the JPEG round trip changed it


def test_oft_rlds_pipeline_skips_images_at_the_model_size():
    frame = smooth_image(28)
    p = make_policy("openvla_oft", preset="tiny", image_pipeline="rlds", center_crop=False, seed=0)
    got = p.processor.camera_pixels(torch.from_numpy(frame)[None])[0]
    torch.testing.assert_close(got, to_bchw(frame)[0] / 255, rtol=0, atol=0)
    big = smooth_image(48, seed=2)
    got = p.processor.camera_pixels(torch.from_numpy(big)[None])[0]
    torch.testing.assert_close(got, to_bchw(pil_rlds_resize(big, 28))[0] / 255, rtol=0, atol=1e-7)


def test_rlds_pipeline_crops_and_quantises_as_the_official_eval():
    frame = smooth_image(40, seed=3)
    p = make_policy("openvla", preset="tiny", image_pipeline="rlds", center_crop=True, seed=0)
    got = p.processor.camera_pixels(torch.from_numpy(frame)[None])[0].permute(1, 2, 0).numpy()
    resized = pil_rlds_resize(frame, 28).astype(np.float32) / np.float32(255)
    cropped = tf_crop_reference(resized, official_center_box(), 28, 28).astype(np.float32)
    expected = np.floor(np.clip(cropped, 0, 1) * np.float32(255.5)).clip(0, 255) / 255
    # a sample may land a hair from an integer after x * 255.5: allow one level there
    diff = np.abs(got - expected)
    assert diff.max() <= 1 / 255 + 1e-6 and (diff > 1e-6).mean() < 0.01


def test_torch_pipeline_resizes_then_crops_on_the_device():
    frame = smooth_image(40, seed=4)
    p = make_policy("openvla", preset="tiny", image_pipeline="torch", center_crop=True, seed=0)
    got = p.processor.camera_pixels(torch.from_numpy(frame)[None])
    x = to_bchw(frame) / 255
    resized = torch.nn.functional.interpolate(
        x, size=(28, 28), mode="bicubic", antialias=True, align_corners=False
    ).clamp(0, 1)
    expected = tf_crop_reference(resized[0].permute(1, 2, 0).numpy(), official_center_box(), 28, 28)
    np.testing.assert_allclose(got[0].permute(1, 2, 0).numpy(), expected, rtol=0, atol=1e-6)


def test_image_pipeline_defaults_and_bad_value():
    assert make_policy("openvla", preset="tiny").config.image_pipeline == "torch"
    assert make_policy("openvla", preset="tiny").config.center_crop is False
    assert make_policy("openvla_oft", preset="tiny").config.center_crop is True
    with pytest.raises(ValueError, match=r"image_pipeline must be one of"):
        make_policy("openvla", preset="tiny", image_pipeline="lanczos")
    with pytest.raises(ValueError, match=r"center_crop must be true, false or auto"):
        make_policy("openvla", preset="tiny", center_crop="yes")


# ----------------------------------------------------------------------------------------------
# Normalisation values from preprocessor_config.json
# ----------------------------------------------------------------------------------------------
DINO_M, DINO_S = [0.484375, 0.455078125, 0.40625], [0.228515625, 0.2236328125, 0.224609375]
SIG_M, SIG_S = [0.498046875, 0.5, 0.501953125], [0.5, 0.49609375, 0.50390625]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("openvla_pre")
    make_policy("openvla", preset="tiny", norm_stats=bounds_stats(7), seed=0).save_pretrained(path)
    return path


def _with_preprocessor(saved, tmp_path, data):
    for f in saved.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(data))
    return tmp_path


def test_checkpoint_normalisation_values_are_used(saved, tmp_path):
    data = json.loads((saved / "preprocessor_config.json").read_text())
    data["means"], data["stds"] = [[0.1] * 3, [0.2] * 3], [[0.3] * 3, [0.4] * 3]
    data["tvf_normalize_params"] = [
        {"mean": DINO_M, "std": DINO_S, "inplace": False},
        {"mean": SIG_M, "std": SIG_S, "inplace": False},
    ]
    path = _with_preprocessor(saved, tmp_path, data)
    p = make_policy("openvla", checkpoint=str(path), image_pipeline="torch", center_crop=False)
    frame = smooth_image(28)  # at the model size: the torch path leaves it as is
    px = p.processor.pixel_values(_obs(frame))[0]
    x = frame.astype(np.float64) / 255
    for c in range(3):
        np.testing.assert_allclose(px[c].numpy(), (x[..., c] - DINO_M[c]) / DINO_S[c], atol=1e-5)
        np.testing.assert_allclose(px[3 + c].numpy(), (x[..., c] - SIG_M[c]) / SIG_S[c], atol=1e-5)
    assert p.config.image_mean == (tuple(DINO_M), tuple(SIG_M))


def test_means_stds_without_tvf_params_and_explicit_override(saved, tmp_path):
    data = json.loads((saved / "preprocessor_config.json").read_text())
    data.pop("tvf_normalize_params", None)
    data["means"], data["stds"] = [DINO_M, SIG_M], [DINO_S, SIG_S]
    path = _with_preprocessor(saved, tmp_path, data)
    assert make_policy("openvla", checkpoint=str(path)).config.image_std == (
        tuple(DINO_S),
        tuple(SIG_S),
    )
    mine = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    p = make_policy("openvla", checkpoint=str(path), image_mean=mine, image_std=mine)
    assert p.config.image_mean == mine
    # without a checkpoint: the backbones' exact values
    tiny = make_policy("openvla", preset="tiny").config
    assert tiny.image_mean == ((0.485, 0.456, 0.406), (0.5, 0.5, 0.5))


def test_bad_preprocessor_config_names_the_keys(saved, tmp_path):
    data = {"means": [[0.5, 0.5, 0.5]], "stds": [[0.5, 0.5, 0.5]]}  # one backbone, not two
    path = _with_preprocessor(saved, tmp_path, data)
    with pytest.raises(ValueError, match="set image_mean and image_std"):
        make_policy("openvla", checkpoint=str(path))
    with pytest.raises(ValueError, match="set both image_mean and image_std"):
        make_policy("openvla", preset="tiny", image_mean=((0.5, 0.5, 0.5),) * 2)

"""Episode recording round trip: what is written is what :func:`read_episode` gives back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlinf_vla.real_robot.recording import EpisodeWriter, intervention_bits, read_episode
from rlinf_vla.real_robot.safety import INTERVENTIONS, Intervention


def _write(folder, video: str, steps: int = 6):
    rng = np.random.default_rng(0)
    w = EpisodeWriter(
        folder, ["main", "wrist"], video=video, fps=10.0, meta={"instruction": "stack"}
    )
    rows = []
    t0 = w._t0
    for t in range(steps):
        # Smooth images (videos are lossy on noise): a gradient that moves with t.
        yy, xx = np.mgrid[0:32, 0:48]
        img = np.stack(
            [(xx * 5 + t * 10) % 256, (yy * 7) % 256, np.full_like(xx, 40 * t % 256)], -1
        ).astype(np.uint8)
        row = dict(
            timestamp=t0 + 0.1 * t,
            images={"main": img, "wrist": img[::-1].copy()},
            state=rng.normal(size=8).astype(np.float32),
            joint_positions=rng.normal(size=7),
            ee_pos=rng.normal(size=3),
            ee_rotvec=rng.normal(size=3),
            gripper_width=0.04,
            policy_action=np.full(7, np.nan) if t == 2 else rng.normal(size=7),
            action=rng.normal(size=7),
            hold=t == 2,
            interventions=[Intervention(t, t0 + 0.1 * t, "watchdog", "late")] if t == 2 else [],
        )
        w.add(**row)
        rows.append(row)
    return w.close(interventions={"watchdog": 1}), rows


@pytest.mark.parametrize("video", ["png", "mp4"])
def test_round_trip(tmp_path, video):
    folder, rows = _write(tmp_path / "ep", video)
    ep = read_episode(folder)
    assert (
        len(ep) == 6
        and ep.meta["instruction"] == "stack"
        and ep.meta["interventions"] == {"watchdog": 1}
    )
    np.testing.assert_allclose(ep.steps["timestamp"], np.arange(6) * 0.1, atol=1e-9)
    for key in ("state", "joint_positions", "ee_pos", "ee_rotvec", "action"):
        np.testing.assert_allclose(ep.steps[key], np.stack([r[key] for r in rows]), rtol=1e-6)
    assert (
        np.isnan(ep.steps["policy_action"][2]).all()
        and not np.isnan(ep.steps["policy_action"][3]).any()
    )
    assert ep.steps["hold"].tolist() == [False, False, True, False, False, False]
    assert ep.steps["interventions"][2] == 1 << INTERVENTIONS.index("watchdog")
    assert ep.steps["interventions"].sum() == ep.steps["interventions"][2]
    assert ep.interventions == [
        {"step": 2, "time": pytest.approx(0.2), "kind": "watchdog", "detail": "late"}
    ]
    for cam in ("main", "wrist"):
        want = np.stack([r["images"][cam] for r in rows])
        assert ep.images[cam].shape == want.shape and ep.images[cam].dtype == np.uint8
        if video == "png":
            np.testing.assert_array_equal(ep.images[cam], want)
        else:
            assert np.abs(ep.images[cam].astype(int) - want).mean() < 4.0  # H.264, quality 9
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format_version"] == 1 and meta["intervention_kinds"] == list(INTERVENTIONS)


def test_bits_and_refusals(tmp_path):
    assert intervention_bits(["estop", "gripper_debounce", "estop"]) == 1 | (1 << 7)
    with pytest.raises(ValueError, match="mp4"):
        EpisodeWriter(tmp_path / "x", ["main"], video="avi")
    EpisodeWriter(tmp_path / "y", ["main"]).close()
    with pytest.raises(FileExistsError):  # never overwrite an episode
        EpisodeWriter(tmp_path / "y", ["main"])

"""Shared fixtures: one tiny OpenVLA-OFT policy (two cameras, 8-d state, chunks of 8) per run."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")


@pytest.fixture(scope="session")
def tiny_policy():
    from rlinf_vla.policies import make_policy

    return make_policy("openvla_oft", preset="tiny", seed=0).eval()


def good_obs(size: int = 32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "images": {
            "main": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "wrist": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        },
        "state": rng.uniform(-1, 1, 8).astype(np.float32),
        "instruction": "pick up the red cube",
    }

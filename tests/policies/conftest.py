"""Shared helpers of the policy tests: observations and normalisation statistics."""

from __future__ import annotations

import torch

from rlinf_vla.types import Observation

INSTRUCTIONS = ["pick up the red cube", "open the top drawer", "push the plate to the left"]


def make_obs(
    batch: int = 2,
    cameras: tuple[str, ...] = ("main",),
    state_dim: int | None = None,
    size: int = 32,
    seed: int = 0,
) -> Observation:
    g = torch.Generator().manual_seed(seed)
    images = {
        k: torch.randint(0, 256, (batch, size, size, 3), generator=g, dtype=torch.uint8)
        for k in cameras
    }
    state = None if state_dim is None else torch.rand(batch, state_dim, generator=g) * 2 - 1
    instruction = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)]
    return Observation(images=images, state=state, instruction=instruction)


def bounds_stats(action_dim: int = 7, proprio_dim: int | None = None) -> dict:
    """``dataset_statistics.json`` of one dataset: actions in ``[-2, 3]`` except the gripper
    (last dim, mask False, left in ``[-1, 1]``)."""
    action = {
        "q01": [-2.0] * action_dim,
        "q99": [3.0] * action_dim,
        "mask": [True] * (action_dim - 1) + [False],
    }
    out = {"action": action}
    if proprio_dim is not None:
        out["proprio"] = {"q01": [-1.0] * proprio_dim, "q99": [1.0] * proprio_dim}
    return {"toy_dataset": out}

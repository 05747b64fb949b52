"""The random state of a worker process, for checkpoints: torch's CPU generator and, when the
worker computes on a GPU, that GPU's generator (sampling on a GPU draws from it)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state(device: torch.device) -> dict[str, Any]:
    """``{"cpu": ..., "cuda": ...}`` (``cuda`` only when ``device`` is a GPU this process has
    used)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda" and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any] | torch.Tensor, device: torch.device) -> None:
    """Restore :func:`get_rng_state`'s value (or a bare CPU state tensor, as older checkpoints
    hold). A checkpoint saved on CPU restores only the CPU generator."""
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)

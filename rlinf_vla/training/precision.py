"""Mixed precision of the policy's forward passes: the ``algo.autocast`` (and ``sft.autocast``)
setting as a context manager, used alike by the rollout, the update and the benchmarks."""

from __future__ import annotations

from typing import Any

import torch


def autocast(device: torch.device, mode: str) -> Any:
    """The autocast context of ``algo.autocast`` on ``device`` (a no-op when off)."""
    enabled = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)

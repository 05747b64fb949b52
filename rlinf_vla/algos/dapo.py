"""DAPO's own parts (Yu et al., 2025); the preset is ``rlinf_vla/configs/algo/dapo.yaml``.

    DAPO = GRPO advantages
         + clip-higher (ε_low = 0.2, ε_high = 0.28)            -> ppo_policy_loss(clip_high=...)
         + token-level aggregation                             -> agg="token-mean"
         + dynamic sampling (drop groups with equal scores)    -> dynamic_sampling
         + overlong reward shaping for text                    -> overlong_penalty

Dynamic sampling here only selects; refilling the batch by sampling more groups until it is
full is the trainer's loop.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling(
    scores: Tensor, group_size: int, atol: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Keeps the groups whose scores are not all equal (all right or all wrong groups have zero
    GRPO advantage and only dilute the batch).

    Args:
        scores: ``[N]``, consecutive groups of ``group_size``.
        group_size: G; N must be a multiple of it.
        atol: scores within ``atol`` of each other count as equal.

    Returns:
        ``keep [N]`` bool (a whole group is kept or dropped) and metrics (0-d detached tensors):
        ``dropped_group_fraction``, ``kept_groups``.
    """
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"scores {tuple(scores.shape)} do not split into groups of {group_size}")
    groups = scores.detach().view(-1, group_size)
    spread = groups.max(dim=1).values - groups.min(dim=1).values
    keep_group = spread > atol
    keep = keep_group.repeat_interleave(group_size)
    metrics = {
        "dropped_group_fraction": (~keep_group).float().mean(),
        "kept_groups": keep_group.sum().float(),
    }
    return keep, metrics


def overlong_penalty(
    lengths: Tensor, *, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment (eq. 13), added to the verifier reward of each response.

        R(|y|) = 0                                  |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               = -1                                 |y| > L_max

    times ``penalty_factor``: a linear ramp from 0 to -1 over the last ``buffer_length`` tokens.

    Args:
        lengths: ``[N]`` response lengths |y| in tokens.
        max_length: L_max, the generation limit.
        buffer_length: L_cache, 0 < L_cache <= L_max.

    Returns:
        ``[N]`` float penalties in ``[-penalty_factor, 0]``.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"need 0 < buffer_length <= max_length, got {buffer_length}, {max_length}")
    expected = max_length - buffer_length
    lengths = lengths.to(torch.float32)
    ramp = (expected - lengths) / buffer_length
    penalty = torch.where(lengths <= expected, torch.zeros_like(ramp), ramp)
    penalty = torch.where(lengths > max_length, torch.full_like(ramp, -1.0), penalty)
    return penalty * penalty_factor

"""Statistics over the valid entries of a tensor (``mask`` true), shared by advantages and losses.

Every function takes ``x`` and ``mask`` of the same shape (any shape); ``mask=None`` means all
entries are valid. An empty mask gives a mean of 0, never a NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over the valid entries. Shapes: ``x [*S]``, ``mask [*S]`` -> 0-d."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Unbiased (Bessel-corrected, as ``torch.var``) variance of ``x`` over the valid entries.

    Shapes: ``x [*S]``, ``mask [*S]`` -> 0-d (0 with fewer than two valid entries).
    """
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1.0)
    return ((x - mean) ** 2 * m).sum() / (n - 1).clamp(min=1.0)


def whiten(x: Tensor, mask: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` with mean and unbiased std over the valid entries.

    Masked-out entries of the result are 0. Shapes: ``x [*S]``, ``mask [*S]`` -> ``[*S]``.
    """
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    mean = masked_mean(x, m)
    return (x - mean) / (masked_var(x, m).sqrt() + eps) * m

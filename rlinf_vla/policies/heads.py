"""Heads and distributions shared by the policy families.

- :class:`ValueHead`: the PPO critic MLP (RLinf's ``ValueHead``).
- :class:`CriticEncoder`: features of the critic's own from the cameras and the robot state
  (the convolutional encoder of ManiSkill's pixel PPO baseline).
- :func:`restricted_logits` / :func:`categorical_logprob_entropy`: the categorical distribution
  over action tokens (temperature, top-k, restricted to the action ids).
- :func:`gaussian_logprob` / :func:`gaussian_entropy`: element-wise normal densities.
- :func:`clipped_gaussian_logprob`: the log-likelihood of a normal sample clipped to a range.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "CriticEncoder",
    "ValueHead",
    "categorical_logprob_entropy",
    "clipped_gaussian_logprob",
    "gaussian_entropy",
    "gaussian_logprob",
    "restricted_logits",
]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


class ValueHead(nn.Module):
    """``input_dim -> hidden_sizes -> output_dim`` MLP, the critic of PPO.

    Hidden layers use Kaiming-normal (fan-out) weights and zero biases; the last layer is
    ``N(0, 0.02)`` so the initial values are close to zero (as RLinf's ``ValueHead``).

    Shapes: ``x [..., input_dim] -> [..., output_dim]``.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_sizes: tuple[int, ...] = (512, 128),
        output_dim: int = 1,
        activation: str = "gelu",
        bias_last: bool = True,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; known: {sorted(_ACTIVATIONS)}")
        layers: list[nn.Module] = []
        dim = input_dim
        for h in hidden_sizes:
            linear = nn.Linear(dim, h)
            nn.init.kaiming_normal_(linear.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(linear.bias)
            layers += [linear, _ACTIVATIONS[activation]()]
            dim = h
        last = nn.Linear(dim, output_dim, bias=bias_last)
        nn.init.normal_(last.weight, std=0.02)
        if bias_last:
            nn.init.zeros_(last.bias)
        layers.append(last)
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x)


class CriticEncoder(nn.Module):
    """The critic's own features from the observation, so that the value is learned without
    moving the features the actions are read from.

    Per camera stack, three convolutions (32 filters of 8 x 8 at stride 4, 64 of 4 x 4 at
    stride 2, 64 of 3 x 3 at stride 1, ReLU after each; the "Nature CNN" that ManiSkill's
    pixel PPO baseline encodes its cameras with), pooled to 4 x 4 (exactly the 4 x 4 output
    of a 64-pixel image, so nothing is pooled there) and projected to ``width``; the robot
    state through one linear layer to ``width``; both with ReLU, concatenated.

    Shapes: ``images float32 [B, 3 * n_cameras, H, W]`` in ``[0, 1]`` (``H, W >= 36``),
    ``state [B, state_dim]`` (or ``None`` with ``state_dim=0``) -> ``[B, out_dim]``.
    """

    def __init__(self, n_cameras: int, state_dim: int = 0, width: int = 256) -> None:
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(3 * n_cameras, 32, kernel_size=8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, kernel_size=3, stride=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, width),
            nn.ReLU(),
        )
        self.state = nn.Sequential(nn.Linear(state_dim, width), nn.ReLU()) if state_dim else None
        self.out_dim = width * (2 if state_dim else 1)

    def forward(self, images: Tensor, state: Tensor | None = None) -> Tensor:
        if min(images.shape[-2:]) < 36:
            raise ValueError(
                f"the critic's encoder needs images of at least 36 x 36 pixels, got "
                f"{tuple(images.shape[-2:])}"
            )
        features = self.cnn(images)
        if self.state is None:
            return features
        if state is None:
            raise ValueError("the critic's encoder was built for a robot state; got none")
        return torch.cat([features, self.state(state)], dim=-1)


def restricted_logits(
    logits: Tensor, first_id: int, n_ids: int, temperature: float = 1.0, top_k: int = 0
) -> Tensor:
    """The sampling logits over the ``n_ids`` action ids ``[first_id, first_id + n_ids)``.

    Shapes: ``logits [..., V] -> [..., n_ids]`` in float32: divided by ``temperature``, and with
    ``top_k > 0`` every entry below the k-th largest set to ``-inf`` (all other vocabulary ids
    have probability 0, as RLinf's ``VLALogitsProcessor``).
    """
    x = logits[..., first_id : first_id + n_ids].float() / temperature
    if 0 < top_k < n_ids:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x


def categorical_logprob_entropy(logits: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probability of ``index`` and entropy of ``softmax(logits)`` (``-inf`` logits allowed).

    Shapes: ``logits [..., N]``, ``index [...]`` (long) -> ``([...], [...])``.
    """
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
    return chosen, entropy


def gaussian_logprob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Element-wise ``log N(x; mean, std^2) = -log std - log(2 pi)/2 - ((x - mean)/std)^2/2``."""
    return -torch.log(std) - 0.5 * math.log(2 * math.pi) - 0.5 * ((x - mean) / std) ** 2


def clipped_gaussian_logprob(
    x: Tensor, mean: Tensor, std: Tensor, low: float = -1.0, high: float = 1.0
) -> Tensor:
    """Element-wise log-likelihood of the action executed for the normal sample ``x``, which is
    ``clamp(x, low, high)``: the normal density inside the range, and at a bound the probability
    mass clipped onto it, ``log P(X >= high) = log Phi((mean - high) / std)`` (``low``:
    ``log Phi((low - mean) / std)``). Samples beyond a bound all execute the same action; with
    this likelihood the policy gradient sees that (its signal moves the mass at the bound), where
    the density of the unclipped sample gives it none and lets the mean wander past the bound
    (clipped action policy gradient, Fujita and Maeda 2018)."""
    inside = gaussian_logprob(x, mean, std)
    above = torch.special.log_ndtr((mean - high) / std)
    below = torch.special.log_ndtr((low - mean) / std)
    return torch.where(x >= high, above, torch.where(x <= low, below, inside))


def gaussian_entropy(std: Tensor) -> Tensor:
    """Element-wise differential entropy ``log(2 pi e std^2) / 2`` of a normal."""
    return 0.5 * math.log(2 * math.pi * math.e) + torch.log(std)

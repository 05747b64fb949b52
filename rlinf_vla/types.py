"""The data types that cross package borders (see docs/architecture.md).

Only ``torch`` is imported here, so every subpackage may depend on this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Observation:
    """A batch of observations, the same type for every env and policy.

    Attributes:
        images: camera name (``"main"``, ``"wrist"``, ...) -> ``uint8 [B, H, W, 3]``.
        state: proprioception ``float32 [B, D]``, or ``None`` when the env has none.
        instruction: one natural-language instruction per env, ``len == B``.
    """

    images: dict[str, torch.Tensor]
    state: torch.Tensor | None
    instruction: list[str]

    @property
    def batch_size(self) -> int:
        return len(self.instruction)

    def select(self, index: torch.Tensor | list[int] | slice) -> Observation:
        """The observations of a subset of envs (``index`` over the batch dimension)."""
        if isinstance(index, slice):
            instruction = self.instruction[index]
        else:
            idx = torch.as_tensor(index).tolist()
            instruction = [self.instruction[i] for i in idx]
        return Observation(
            images={k: v[index] for k, v in self.images.items()},
            state=None if self.state is None else self.state[index],
            instruction=instruction,
        )


def cat_obs(parts: list[Observation]) -> Observation:
    """Concatenate observations along the batch dimension."""
    return Observation(
        images={k: torch.cat([p.images[k] for p in parts]) for k in parts[0].images},
        state=None if parts[0].state is None else torch.cat([p.state for p in parts]),
        instruction=[s for p in parts for s in p.instruction],
    )


@dataclass
class ChunkResult:
    """What ``env.chunk_step(actions [B, K, A])`` returns.

    Attributes:
        obs: observation after the chunk (after the auto-reset for envs that ended).
        reward: ``float32 [B, K]`` reward of each executed step.
        terminated: ``bool [B, K]`` the episode ended in a terminal state at that step.
        truncated: ``bool [B, K]`` the episode hit its time limit at that step.
        success: ``bool [B]`` the task was solved at some step of the chunk.
        final_obs: observation just before the auto-reset, for envs that ended inside the
            chunk (``None`` when no env ended); used to bootstrap values at truncation.
        info: extra per-env tensors (``[B]`` or ``[B, K]``), e.g. ``"invalid"``.
    """

    obs: Observation
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    success: torch.Tensor
    final_obs: Observation | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActOutput:
    """What ``policy.act(obs)`` returns.

    Attributes:
        actions: ``float32 [B, K, A]`` in env units (unnormalised).
        logprob: log-probabilities at the configured granularity: ``[B, K, A]`` per token,
            ``[B, K]`` per action, ``[B]`` per chunk.
        value: ``float32 [B]`` value estimate, or ``None`` without a value head.
        replay: everything needed to recompute ``logprob`` later (tokens, noise, ...).
    """

    actions: torch.Tensor
    logprob: torch.Tensor
    value: torch.Tensor | None
    replay: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class EvalOutput:
    """What ``policy.evaluate(obs, replay)`` returns; shapes as in :class:`ActOutput`."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    value: torch.Tensor | None

"""Every conversion between reward, log-prob and value granularities, in one place.

An embodied rollout of ``T`` chunk steps over ``B`` envs, chunks of ``K`` actions of ``A``
dimensions, is stored time-major:

    rewards, terminated, truncated   [T, B, K]     one per executed env step
    logprob                          [T, B, K, A]  per token   (one token per action dim)
                                     [T, B, K]     per action  (sum over A)
                                     [T, B]        per chunk   (sum over K and A)
    entropy                          as logprob
    values                           [T+1, B]      per chunk   (V of the chunk's first state)
                                     [T+1, B, K]   per action  (one value per step of the chunk)

Rewards enter the advantage estimator at one of three levels:

    "action"   per env step: [T*K, B], time-major over env steps (``flatten_chunks``)
    "chunk"    per chunk:    [T, B], rewards summed, episode ends OR-ed (``chunk_rewards``)
    "episode"  per episode:  [B] scores (``episode_scores``), for GRPO / RLOO

and the resulting advantages are broadcast to the log-prob shape with
``broadcast_to_logprob`` and to the value shape with ``to_value_level``. Log-probs and
entropies move from token to coarser levels with ``reduce_to_level`` (a chunk's actions and an
action's dims are sampled independently, so log-probs and entropies add up).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Level = Literal["token", "action", "chunk"]
RewardLevel = Literal["episode", "chunk", "action"]

# Trailing dims of a per-token tensor [..., K, A] that each level sums over.
_SUMMED_DIMS: dict[str, tuple[int, ...]] = {"token": (), "action": (-1,), "chunk": (-2, -1)}
_REWARD_LEVELS = ("episode", "chunk", "action")


def reduce_to_level(x: Tensor, level: Level) -> Tensor:
    """Per-token log-probs or entropies at a coarser level, by summing.

    Shapes: ``x [..., K, A]`` -> ``token``: ``[..., K, A]``; ``action``: ``[..., K]``;
    ``chunk``: ``[...]``.
    """
    if level not in _SUMMED_DIMS:
        raise ValueError(f"unknown level {level!r}; known: {', '.join(sorted(_SUMMED_DIMS))}")
    dims = _SUMMED_DIMS[level]
    return x.sum(dim=dims) if dims else x


def flatten_chunks(x: Tensor) -> Tensor:
    """Chunk steps to env steps, time-major: ``[T, B, K, ...] -> [T*K, B, ...]``.

    Env step ``t*K + k`` is action ``k`` of chunk ``t``.
    """
    T, B, K = x.shape[:3]
    return x.transpose(1, 2).reshape(T * K, B, *x.shape[3:])


def unflatten_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """Inverse of :func:`flatten_chunks`: ``[T*K, B, ...] -> [T, B, K, ...]`` with K=chunk_size."""
    TK, B = x.shape[:2]
    if TK % chunk_size:
        raise ValueError(f"{TK} env steps do not split into chunks of {chunk_size}")
    return x.reshape(TK // chunk_size, chunk_size, B, *x.shape[2:]).transpose(1, 2)


def chunk_rewards(
    rewards: Tensor, terminated: Tensor, truncated: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-step rewards and episode ends to one per chunk.

    The chunk's reward is the (undiscounted) sum of its steps' rewards; the chunk terminated if
    any step did, and was truncated if any step was and none terminated.

    Shapes: ``[T, B, K]`` each -> ``[T, B]`` each.
    """
    term = terminated.bool().any(dim=-1)
    trunc = truncated.bool().any(dim=-1) & ~term
    return rewards.sum(dim=-1), term, trunc


def values_for_gae(values: Tensor, reward_level: RewardLevel) -> Tensor:
    """Rollout values to the ``values [T'+1, B]`` that ``gae`` takes at ``reward_level``.

    - chunk values ``[T+1, B]``, ``chunk`` rewards: unchanged.
    - action values ``[T+1, B, K]``, ``chunk`` rewards: the value of each chunk's first step,
      ``[T+1, B]``.
    - action values ``[T+1, B, K]``, ``action`` rewards: the ``T*K`` in-chunk values of the
      first ``T`` chunks then the first value of the bootstrap chunk, ``[T*K+1, B]``.
    - chunk values with ``action`` rewards are refused: V of the states inside a chunk is unknown.
    """
    if reward_level == "chunk":
        return values if values.dim() == 2 else values[..., 0]
    if reward_level == "action":
        if values.dim() != 3:
            raise ValueError(
                "action-level rewards need action-level values [T+1, B, K], got shape "
                f"{tuple(values.shape)}; use chunk-level rewards with per-chunk values"
            )
        return torch.cat([flatten_chunks(values[:-1]), values[-1:, :, 0]], dim=0)
    raise ValueError(f"gae takes 'chunk' or 'action' rewards, got {reward_level!r}")


def repeat_over_chunk(x: Tensor, chunk_size: int) -> Tensor:
    """A per-chunk quantity at every env step of its chunk: ``[T, B, ...] -> [T*K, B, ...]``.

    E.g. ``final_values [T, B]`` (V of the final observation of an env that ended inside chunk
    t) for action-level ``gae``, which reads it only at the step where the episode ended.
    """
    T, B = x.shape[:2]
    expanded = x.unsqueeze(2).expand(T, B, chunk_size, *x.shape[2:])
    return flatten_chunks(expanded)


def expand_like(x: Tensor, target: Tensor) -> Tensor:
    """``x`` broadcast over ``target``'s trailing dims: ``x.shape`` must be a prefix of
    ``target.shape``. E.g. ``advantages [B]`` -> ``[B, L]`` for a text batch.

    Shapes: ``x [*P]``, ``target [*P, *R]`` -> ``[*P, *R]`` (a view, no copy).
    """
    p = x.dim()
    if tuple(target.shape[:p]) != tuple(x.shape):
        raise ValueError(
            f"shape {tuple(x.shape)} is not a prefix of {tuple(target.shape)}, cannot broadcast"
        )
    return x.reshape(*x.shape, *([1] * (target.dim() - p))).expand(target.shape)


def broadcast_to_logprob(x: Tensor, logprob: Tensor, *, reward_level: RewardLevel) -> Tensor:
    """Advantages (or returns, masks) at ``reward_level`` to the shape of the rollout log-probs.

    Args:
        x: ``[B]`` (``episode``), ``[T, B]`` (``chunk``) or ``[T*K, B]`` (``action``).
        logprob: ``[T, B]`` per chunk, ``[T, B, K]`` per action, ``[T, B, K, A]`` per token.

    Returns:
        ``x`` with ``logprob``'s shape: an episode's value at every step, a chunk's at every
        action and token of it, an action's at every token of it.

    Per-action values cannot be given to a per-chunk log-prob (one ratio would need several
    advantages); that combination raises ``ValueError``.
    """
    if reward_level not in _REWARD_LEVELS:
        raise ValueError(f"unknown reward level {reward_level!r}; known: {_REWARD_LEVELS}")
    T, B = logprob.shape[:2]
    if reward_level == "episode":
        x = x.unsqueeze(0).expand(T, B)
    elif reward_level == "action":
        if logprob.dim() < 3:
            raise ValueError(
                "per-action advantages need per-action or per-token log-probs, got log-probs of "
                f"shape {tuple(logprob.shape)} (per chunk)"
            )
        x = unflatten_chunks(x, logprob.shape[2])
    return expand_like(x, logprob)


def to_value_level(x: Tensor, *, reward_level: RewardLevel, values: Tensor) -> Tensor:
    """Returns (or advantages) at ``reward_level`` to the shape of the rollout values.

    - ``chunk`` ``[T, B]`` to chunk values ``[T, B]``: unchanged.
    - ``action`` ``[T*K, B]`` to action values ``[T, B, K]``: unflattened.
    - ``action`` ``[T*K, B]`` to chunk values ``[T, B]``: the return from each chunk's first
      step, which is the target of V at the chunk's first state.
    - ``chunk`` to action values ``[T, B, K]`` is refused (no target for the in-chunk values).

    Args:
        x: ``[T, B]`` or ``[T*K, B]``.
        values: ``[T, B]`` or ``[T, B, K]`` (without the bootstrap step).
    """
    if reward_level == "chunk":
        if values.dim() != 2:
            raise ValueError(
                "chunk-level returns [T, B] are targets of each chunk's first value only: "
                "pass values[..., 0], or use action-level rewards for per-action values"
            )
        return x
    if reward_level == "action":
        K = values.shape[2] if values.dim() == 3 else x.shape[0] // values.shape[0]
        per_action = unflatten_chunks(x, K)
        return per_action if values.dim() == 3 else per_action[..., 0]
    raise ValueError(f"value targets come from 'chunk' or 'action' rewards, got {reward_level!r}")


def episode_scores(rewards: Tensor, dones: Tensor, gamma: float = 1.0) -> Tensor:
    """The return of each env's first episode: ``sum_t gamma^t r_t`` over its steps up to and
    including its first done (all ``T`` steps if it never ended). The GRPO / RLOO score of an
    embodied rollout; ``gamma < 1`` scores the same success higher the sooner it comes.

    Shapes: ``rewards [T, B]``, ``dones [T, B]`` bool -> ``[B]``.
    """
    T = rewards.shape[0]
    discount = gamma ** torch.arange(T, dtype=rewards.dtype, device=rewards.device)
    valid = valid_until_first_done(dones).to(rewards.dtype)
    return (rewards * valid * discount[:, None]).sum(dim=0)


def episode_weights(mask: Tensor) -> Tensor:
    """Per-step loss weights under which every scored episode weighs the same, whatever its
    length: ``w[t, b] = mean_length / length_b`` on the valid steps of env ``b``'s episode
    (``length_b`` of them), 0 elsewhere. The weights average 1 over the valid steps, so a mean
    over steps keeps its scale and becomes the mean over episodes of each episode's own mean.

    Shapes: ``mask [T, B]`` bool (e.g. :func:`valid_until_first_done`) -> ``[T, B]`` float.
    """
    m = mask.float()
    lengths = m.sum(dim=0)  # [B]
    episodes = (lengths > 0).sum().clamp(min=1)
    mean_length = m.sum() / episodes
    return m * (mean_length / lengths.clamp(min=1.0))[None, :]


def valid_until_first_done(dones: Tensor) -> Tensor:
    """Mask of the steps of each env's first episode: true up to and including the first done.

    Shapes: ``dones [T, B]`` bool -> ``[T, B]`` bool. Steps after it belong to episodes that
    GRPO does not score, and are masked out of the loss.
    """
    d = dones.bool().int()
    dones_before = torch.cumsum(d, dim=0) - d  # number of dones strictly before step t
    return dones_before == 0

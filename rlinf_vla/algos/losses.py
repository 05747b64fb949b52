"""Losses, registered by name in :data:`LOSSES`; aggregation modes in :data:`AGGREGATIONS`; KL
estimators in :data:`KL_ESTIMATORS`.

Every loss takes keyword tensors of one shape, ``[N, ...]``: ``[B, L]`` tokens of a text batch,
``[N, K, A]`` tokens, ``[N, K]`` actions or ``[N]`` chunks of an embodied batch (see
``granularity``). Dim 0 is the sample ("sequence") dimension, the trailing dims are its tokens;
``mask`` marks the valid entries. Broadcasting advantages to that shape is the caller's job
(``granularity.broadcast_to_logprob``), never done here.

Each loss returns ``(loss, metrics)``: ``loss`` a differentiable 0-d tensor, to be minimised;
``metrics`` a ``dict[str, Tensor]`` of 0-d *detached* tensors (no device sync; call
``metrics_to_floats`` when logging). Metrics are means over the valid entries, whatever the
aggregation mode of the loss.

A trainer composes them, e.g. PPO:

    loss = pg_loss + vf_coef * v_loss + ent_coef * ent_loss (+ kl_coef * kl_loss)

Each loss declares at registration which of these terms it is (``policy``, ``value``,
``entropy`` or ``kl``). A preset's ``policy_loss`` names a ``policy`` loss; both trainers call
it with one keyword interface, that of :func:`ppo_policy_loss`: ``logprob``, ``old_logprob``,
``advantages``, ``mask``, ``clip_low``, ``clip_high``, ``dual_clip``, ``agg``, ``denominator``
and ``weight``, and read the metrics :data:`POLICY_METRICS` from what it returns::

    @LOSSES.register("ppo", term="policy")
    def ppo_policy_loss(*, logprob, old_logprob, advantages, mask, clip_low, ...): ...

    LOSSES.policy("ppo")    # the entry; a loss of another term is refused
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

from rlinf_vla.algos.masked import masked_mean, masked_var
from rlinf_vla.algos.registry import Registry, UnknownNameError

Metrics = dict[str, Tensor]

LossTerm = Literal["policy", "value", "entropy", "kl"]

#: The metrics every policy loss returns besides its loss (the trainers report them, and
#: ``approx_kl`` decides ``algo.target_kl``): see :func:`ppo_policy_loss`.
POLICY_METRICS = ("clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Loss:
    """A registered loss: its function and the term of the total loss it is.

    Attributes:
        fn: the function, ``fn(**tensors) -> (loss, metrics)``.
        term: ``policy`` (what a preset's ``policy_loss`` may name), ``value``, ``entropy``
            or ``kl``.
    """

    fn: Callable[..., tuple[Tensor, Metrics]]
    term: LossTerm

    def __post_init__(self) -> None:
        terms = ("policy", "value", "entropy", "kl")
        if self.term not in terms:
            raise ValueError(f"loss term {self.term!r} is not one of {', '.join(terms)}")

    def __call__(self, **kwargs: Any) -> tuple[Tensor, Metrics]:
        return self.fn(**kwargs)


class Losses(Registry[Loss]):
    """The registry of losses, each registered with the term it is."""

    def register(self, name: str, *, term: LossTerm) -> Callable[[F], F]:
        """Decorator: ``@LOSSES.register("name", term=...)`` registers the function as a
        :class:`Loss` and leaves it unchanged."""

        def decorator(fn: F) -> F:
            self.add(name, Loss(fn, term))
            return fn

        return decorator

    def policy(self, name: str) -> Loss:
        """The policy loss ``name``; a name that is no registered ``policy`` loss raises a
        ``ValueError`` listing those that are."""
        known = [n for n in self.names() if self._entries[n].term == "policy"]
        if name in known:
            return self._entries[name]
        listed = f"(policy losses: {', '.join(known)})"
        if name in self:
            raise ValueError(
                f"policy_loss {name!r} is the {self._entries[name].term} term, not a policy "
                f"loss {listed}"
            )
        raise UnknownNameError(f"policy_loss {name!r} is not a registered loss {listed}")


LOSSES = Losses("loss")
AGGREGATIONS: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("loss aggregation")
KL_ESTIMATORS: Registry[Callable[[Tensor], Tensor]] = Registry("KL estimator")


def _require_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(
            f"loss inputs must share one shape, got {shapes}; broadcast advantages and masks "
            "with rlinf_vla.algos.granularity.broadcast_to_logprob"
        )


def metrics_to_floats(metrics: Metrics) -> dict[str, float]:
    """``{name: 0-d tensor}`` -> ``{name: float}`` (one device sync per metric)."""
    return {name: float(value) for name, value in metrics.items()}


# ---------------------------------------------------------------------------------------------
# Aggregation: loss [N, ...] and mask [N, ...] -> 0-d. Dim 0 indexes sequences, the rest tokens.
# ---------------------------------------------------------------------------------------------


def _per_sequence(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Masked token sum and valid-token count per sequence, both ``[N]``."""
    m = mask.to(loss.dtype)
    n = loss.shape[0]
    return (loss * m).reshape(n, -1).sum(dim=1), m.reshape(n, -1).sum(dim=1)


# Each aggregation returns ``(numerator, count)``: the loss is ``numerator / count``. Split so
# that gradient accumulation can divide the numerators of its micro-batches (and ranks) by the
# count of the whole minibatch (``aggregate(..., denominator=)``, ``aggregation_count``).


@AGGREGATIONS.register("token-mean")
def token_mean(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean over all valid tokens of the batch: Σ_i Σ_t m_it l_it / Σ_i Σ_t m_it (DAPO).

    Every token weighs the same, so long sequences weigh more. Shapes: ``[N, ...]`` ->
    ``(numerator, count)``, both 0-d.
    """
    m = mask.to(loss.dtype)
    return (loss * m).sum(), m.sum()


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over the valid tokens of each sequence, mean over the sequences with a valid token
    (Dr. GRPO, with a constant length normaliser left to the learning rate).

    Shapes: ``[N, ...]`` -> ``(numerator, count)``, both 0-d.
    """
    seq_sum, seq_count = _per_sequence(loss, mask)
    return seq_sum.sum(), (seq_count > 0).sum().to(loss.dtype)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean over the valid tokens of each sequence, then mean over the sequences with a valid
    token (the original GRPO). Every sequence weighs the same.

    Shapes: ``[N, ...]`` -> ``(numerator, count)``, both 0-d.
    """
    seq_sum, seq_count = _per_sequence(loss, mask)
    seq_mean = seq_sum / seq_count.clamp(min=1.0)
    return seq_mean.sum(), (seq_count > 0).sum().to(loss.dtype)


def aggregate(
    loss: Tensor, mask: Tensor, mode: str = "token-mean", denominator: Tensor | float | None = None
) -> Tensor:
    """Reduces a per-token loss ``[N, ...]`` to a 0-d tensor with the registered ``mode``.

    ``denominator``: divide by this instead of the batch's own count (valid tokens for
    ``token-mean``, sequences with a valid token otherwise): the count of a whole minibatch
    of which ``loss`` is one micro-batch, so that the micro-batches' losses add up to the
    minibatch's (:func:`aggregation_count`). For a 1-D loss ``[N]`` (one entry per sample)
    all modes equal the masked mean.
    """
    _require_same_shape(loss=loss, mask=mask)
    numerator, count = AGGREGATIONS[mode](loss, mask)
    if denominator is None:
        return numerator / count.clamp(min=1)
    return numerator / denominator


def aggregation_count(mask: Tensor, mode: str = "token-mean") -> float:
    """What ``mode`` divides by for a batch with ``mask`` ``[N, ...]``: its valid entries
    (``token-mean``) or its sequences with a valid entry. Summed over the micro-batches (and
    ranks) of a minibatch, it is the ``denominator`` of :func:`aggregate` for each of them."""
    return float(AGGREGATIONS[mode](mask.float(), mask)[1])


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------


@LOSSES.register("ppo", term="policy")
def ppo_policy_loss(
    *,
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    max_log_ratio: float = 20.0,
    denominator: Tensor | float | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Clipped surrogate of PPO (Schulman et al., 2017), with DAPO's clip-higher and dual clip.

        r_t     = exp(log π_θ(a_t) - log π_old(a_t))
        L_t     = max(-A_t r_t, -A_t clip(r_t, 1 - ε_low, 1 + ε_high))
        L_t     = min(L_t, c |A_t|)    where A_t < 0      (dual clip, Ye et al., 2020)
        loss    = aggregate(L, mask, agg)

    Minimising L is maximising the clipped objective. The dual clip bounds the loss of a
    negative-advantage token whose ratio has grown large, where plain PPO's max() would let
    ``|A| r`` grow without bound.

    Args:
        logprob: ``[N, ...]`` log π_θ of the taken actions/tokens, with gradient.
        old_logprob: ``[N, ...]`` log π_old at rollout time.
        advantages: ``[N, ...]`` A, already broadcast to ``logprob``'s shape.
        mask: ``[N, ...]`` valid entries.
        clip_low: ε_low, the ratio is clipped below at ``1 - clip_low``.
        clip_high: ε_high, clipped above at ``1 + clip_high``; ``None`` means ``clip_low``.
            DAPO's clip-higher: ``clip_high > clip_low`` (0.28 vs 0.2).
        dual_clip: c > 1, or ``None`` for no dual clip.
        agg: aggregation mode, a name in :data:`AGGREGATIONS`.
        max_log_ratio: ``log r`` is clamped to ±this before ``exp`` so that one stale token
            cannot overflow the loss (beyond it the clip makes the gradient 0 anyway, except
            for negative advantages, which ``dual_clip`` covers).
        denominator: the aggregation's count of the whole minibatch when this batch is one
            of its micro-batches (see :func:`aggregate`); ``None``: this batch's own.
        weight: ``[N, ...]`` non-negative weight of each entry's ``L_t`` before the
            aggregation (e.g. ``granularity.episode_weights``); ``None``: 1. The metrics
            other than ``policy_loss`` stay unweighted means.

    Returns:
        ``loss`` 0-d and metrics: ``policy_loss``, ``clip_fraction`` (share of valid tokens where
        the clipped term is the larger one, i.e. whose gradient is cut), ``dual_clip_fraction``,
        ``approx_kl`` (k3 estimate of KL(π_old || π_θ): ``(r - 1) - log r``), ``ratio_mean``,
        ``ratio_min``, ``ratio_max``.
    """
    _require_same_shape(logprob=logprob, old_logprob=old_logprob, advantages=advantages, mask=mask)
    eps_low = clip_low
    eps_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")

    log_ratio = (logprob - old_logprob).clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(log_ratio)
    pg_losses_unclipped = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_losses = torch.maximum(pg_losses_unclipped, pg_losses_clipped)

    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip  # = c |A| where A < 0
        dual_clipped = (advantages < 0) & (pg_losses > dual_bound)
        pg_losses = torch.where(dual_clipped, dual_bound, pg_losses)

    if weight is not None:
        _require_same_shape(logprob=logprob, weight=weight)
    weighted = pg_losses if weight is None else pg_losses * weight
    loss = aggregate(weighted, mask, agg, denominator)

    with torch.no_grad():
        # min / max over valid tokens without boolean indexing (which would sync the device)
        valid = mask.bool()
        any_valid = valid.any()
        one, inf = ratio.new_tensor(1.0), ratio.new_tensor(float("inf"))
        ratio_min = torch.where(any_valid, torch.where(valid, ratio, inf).amin(), one)
        ratio_max = torch.where(any_valid, torch.where(valid, ratio, -inf).amax(), one)
        metrics = {
            "policy_loss": loss.detach(),
            "clip_fraction": masked_mean((pg_losses_clipped > pg_losses_unclipped).float(), mask),
            "dual_clip_fraction": masked_mean(dual_clipped.float(), mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------


def _squared(error: Tensor, delta: float | None) -> Tensor:
    """``0.5 e²``, or the Huber loss with threshold ``delta`` (quadratic inside, linear beyond)."""
    if delta is None:
        return 0.5 * error**2
    abs_error = error.abs()
    return torch.where(abs_error <= delta, 0.5 * error**2, delta * (abs_error - 0.5 * delta))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor | None = None) -> Tensor:
    """How much of the returns' variance the values account for: 1 - Var(G - V) / Var(G) over
    the valid entries (1: a perfect critic; 0: no better than the returns' mean; below 0:
    worse), NaN when Var(G) = 0. Shapes: ``values``, ``returns``, ``mask`` ``[*S]`` -> 0-d."""
    var_returns = masked_var(returns, mask)
    explained = 1.0 - masked_var(returns - values, mask) / var_returns
    return torch.where(var_returns > 0, explained, torch.full_like(explained, float("nan")))


@LOSSES.register("value", term="value")
def value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = None,
    huber_delta: float | None = None,
    agg: str = "token-mean",
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, Metrics]:
    """Critic loss with optional value clipping (as in OpenAI baselines' PPO2) and Huber option.

        V_clip = V_old + clip(V - V_old, -ε_v, ε_v)
        L_t    = max(f(V - G), f(V_clip - G))     with clipping, else f(V - G)
        f(e)   = 0.5 e²,   or Huber_δ(e) = 0.5 e² if |e| <= δ else δ (|e| - 0.5 δ)

    Args:
        values: ``[N, ...]`` V_θ, with gradient (``[N]`` per chunk or ``[N, K]`` per action).
        old_values: ``[N, ...]`` V at rollout time.
        returns: ``[N, ...]`` targets G (e.g. from ``gae``).
        mask: ``[N, ...]`` valid entries.
        clip: ε_v, or ``None`` for no clipping.
        huber_delta: δ, or ``None`` for the squared error.
        agg: aggregation mode, a name in :data:`AGGREGATIONS`.
        denominator: the whole minibatch's count for a micro-batch (:func:`aggregate`).

    Returns:
        ``loss`` 0-d and metrics: ``value_loss``, ``value_clip_fraction`` (share of entries where
        the clipped loss is the larger one), ``explained_variance`` (1 - Var(G - V_old) / Var(G),
        NaN when Var(G) = 0), ``value_mean``, ``return_mean``.
    """
    _require_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    losses_unclipped = _squared(values - returns, huber_delta)
    value_clipped = torch.zeros_like(mask, dtype=torch.bool)
    losses = losses_unclipped
    if clip is not None:
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        losses_clipped = _squared(clipped_values - returns, huber_delta)
        losses = torch.maximum(losses_unclipped, losses_clipped)
        value_clipped = losses_clipped > losses_unclipped
    loss = aggregate(losses, mask, agg, denominator)

    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_fraction": masked_mean(value_clipped.float(), mask),
            "explained_variance": explained_variance(old_values, returns, mask),
            "value_mean": masked_mean(values, mask),
            "return_mean": masked_mean(returns, mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------
# Entropy bonus
# ---------------------------------------------------------------------------------------------


@LOSSES.register("entropy", term="entropy")
def entropy_loss(
    *,
    entropy: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, Metrics]:
    """Entropy bonus as a loss: ``-aggregate(H, mask, agg)``; add ``ent_coef * loss`` to the
    total, so minimising it raises the entropy.

    Args:
        entropy: ``[N, ...]`` H(π_θ(·|s)) per token / action / chunk, with gradient.
        mask: ``[N, ...]`` valid entries.
        denominator: the whole minibatch's count for a micro-batch (:func:`aggregate`).

    Returns:
        ``loss`` 0-d and metrics: ``entropy`` (the masked mean of H).
    """
    _require_same_shape(entropy=entropy, mask=mask)
    loss = -aggregate(entropy, mask, agg, denominator)
    return loss, {"entropy": masked_mean(entropy.detach(), mask)}


# ---------------------------------------------------------------------------------------------
# KL to a reference policy
# ---------------------------------------------------------------------------------------------
# Schulman, "Approximating KL divergence" (2020). Samples come from π_θ; with
# log_ratio = log π_θ(a) - log π_ref(a) and ρ = π_ref(a) / π_θ(a) = exp(-log_ratio), each
# estimates KL(π_θ || π_ref):


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    """``k1 = log π_θ - log π_ref``: unbiased, high variance, can be negative.

    Shapes: ``log_ratio [*S] -> [*S]``.
    """
    return log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: Tensor) -> Tensor:
    """``k2 = ½ (log π_θ - log π_ref)²``: biased, low variance, >= 0.

    Shapes: ``log_ratio [*S] -> [*S]``.
    """
    return 0.5 * log_ratio**2


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    """``k3 = (ρ - 1) - log ρ``, ρ = π_ref / π_θ: unbiased, low variance, >= 0.

    Shapes: ``log_ratio [*S] -> [*S]``.
    """
    return torch.expm1(-log_ratio) + log_ratio


def kl_divergence(logprob: Tensor, ref_logprob: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from log-probs of samples of π_θ.

    Shapes: ``logprob``, ``ref_logprob`` ``[N, ...]``, the same; returns ``[N, ...]``.
    ``estimator`` is a name in :data:`KL_ESTIMATORS` (``k1``, ``k2``, ``k3``).
    """
    _require_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    return KL_ESTIMATORS[estimator](logprob - ref_logprob)


@LOSSES.register("kl", term="kl")
def kl_loss(
    *,
    logprob: Tensor,
    ref_logprob: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    agg: str = "token-mean",
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, Metrics]:
    """KL penalty to a frozen reference policy: ``aggregate(kl_divergence(...), mask, agg)``.

    Args:
        logprob: ``[N, ...]`` log π_θ, with gradient.
        ref_logprob: ``[N, ...]`` log π_ref of the same tokens.
        mask: ``[N, ...]`` valid entries.
        estimator: ``k1``, ``k2`` or ``k3``.
        denominator: the whole minibatch's count for a micro-batch (:func:`aggregate`).

    Returns:
        ``loss`` 0-d and metrics: ``kl`` (the masked mean of the estimate).
    """
    _require_same_shape(logprob=logprob, ref_logprob=ref_logprob, mask=mask)
    kl = kl_divergence(logprob, ref_logprob, estimator)
    loss = aggregate(kl, mask, agg, denominator)
    return loss, {"kl": masked_mean(kl.detach(), mask)}

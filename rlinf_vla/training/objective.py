"""The loss both trainers minimise: the policy term (the preset's ``policy_loss``, ``ppo``'s
clipped surrogate unless it names another), and as the algorithm says a value term, an entropy
bonus and a KL penalty, each divided by its minibatch-wide count.

    loss = policy + value_coef * value + entropy_coef * (-entropy) + kl_coef * kl

Every tensor is ``[N, ...]`` with its ``mask``; the value term may have its own shape (one
value per embodied sample, ``[N]``, against per-action log-probs ``[N, K, A]``) and so its own
mask and count (and the entropy too). See :mod:`rlinf_vla.training.learner` for why the counts are global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlinf_vla.algos.losses import LOSSES, POLICY_METRICS, entropy_loss, kl_loss, value_loss

#: the metrics :func:`objective` reports
OBJECTIVE_METRICS = (
    "policy_loss",
    *POLICY_METRICS,
    "value_loss",
    "value_clip_fraction",
    "entropy",
    "kl",
)


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings (from the algorithm's preset and the ``algo`` section).

    ``policy_loss`` names the policy term, a ``policy`` loss in ``LOSSES``. ``agg`` aggregates
    the policy, entropy and KL terms; the value term is a mean over its valid entries. A
    coefficient of 0 leaves its term out.
    """

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    value_coef: float = 0.0
    value_clip: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    @classmethod
    def of(cls, algo: Any) -> LossSettings:
        """The settings of an ``algo`` section (either trainer's): the preset's policy loss,
        clip and aggregation, the trainer's coefficients where it has them (a value term only
        with a critic, a KL term only where the KL is not folded into the reward)."""

        def setting(key: str, default: Any) -> Any:
            return getattr(algo, key, default)

        return cls(
            policy_loss=algo.policy_loss,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
            agg=algo.agg,
            value_coef=setting("value_coef", 0.0) if algo.use_critic else 0.0,
            value_clip=setting("value_clip", None),
            entropy_coef=setting("entropy_coef", 0.0),
            kl_coef=0.0 if algo.kl_in_reward else setting("kl_coef", 0.0),
            kl_estimator=setting("kl_estimator", "k3"),
        )


@dataclass(frozen=True)
class Counts:
    """The minibatch-wide counts (over every micro-batch and rank) the terms divide by:
    ``policy`` as ``agg`` counts the log-prob mask (also the KL's), ``value`` the valid value
    entries, ``entropy`` as ``agg`` counts the entropy mask (``None``: ``policy``); ``tokens``
    the valid log-prob entries, by which the per-token metrics weigh (``None``: ``policy``,
    which is that count for ``token-mean``)."""

    policy: float
    value: float = 0.0
    entropy: float | None = None
    tokens: float | None = None


def objective(
    s: LossSettings,
    counts: Counts,
    *,
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor | None = None,
    values: Tensor | None = None,
    old_values: Tensor | None = None,
    returns: Tensor | None = None,
    value_mask: Tensor | None = None,
    entropy_mask: Tensor | None = None,
    ref_logprob: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the minibatch loss, and its share of the metrics;
    ``weight`` (``logprob``'s shape, ``None``: 1) weighs the policy term's entries.

    The policy term is ``LOSSES.policy(s.policy_loss)``, called with ``logprob``,
    ``old_logprob``, ``advantages``, ``mask``, the clip settings, ``agg``, the minibatch's
    ``denominator`` and ``weight``; it must return the metrics ``POLICY_METRICS``.

    Returns:
        ``loss`` 0-d (the micro-batches' losses add up to the minibatch's) and metrics whose
        sums over the micro-batches are the minibatch's values: the loss terms
        (``policy_loss``, ``value_loss``, ``kl``) and masked means weighted by the
        micro-batch's share of the valid tokens (``clip_fraction``, ``approx_kl``, ``entropy``, ...).
    """
    from rlinf_vla.algos.losses import aggregation_count

    # The metrics are masked means over tokens: each micro-batch weighs by its share of them.
    tokens = counts.policy if counts.tokens is None else counts.tokens
    share = aggregation_count(mask) / max(tokens, 1e-12)
    loss, metrics = _policy_term(
        s,
        counts,
        share,
        logprob=logprob,
        old_logprob=old_logprob,
        advantages=advantages,
        mask=mask,
        weight=weight,
    )
    if s.value_coef and values is not None:
        vmask = mask if value_mask is None else value_mask
        vl, vm = value_loss(
            values=values,
            old_values=old_values,
            returns=returns,
            mask=vmask,
            clip=s.value_clip,
            denominator=counts.value,
        )
        loss = loss + s.value_coef * vl
        vshare = aggregation_count(vmask) / max(counts.value, 1e-12)
        metrics["value_loss"] = float(vl.detach())
        metrics["value_clip_fraction"] = float(vm["value_clip_fraction"]) * vshare
    if entropy is not None:
        emask = mask if entropy_mask is None else entropy_mask
        ecount = counts.policy if counts.entropy is None else counts.entropy
        el, em = entropy_loss(entropy=entropy, mask=emask, agg=s.agg, denominator=ecount)
        if s.entropy_coef:
            loss = loss + s.entropy_coef * el
        # its own mask: one entropy per sample or per action, as many for every sample
        eshare = (
            share if entropy_mask is None else aggregation_count(emask, s.agg) / max(ecount, 1e-12)
        )
        metrics["entropy"] = float(em["entropy"]) * eshare
    if s.kl_coef and ref_logprob is not None:
        kl, km = kl_loss(
            logprob=logprob,
            ref_logprob=ref_logprob,
            mask=mask,
            estimator=s.kl_estimator,
            agg=s.agg,
            denominator=counts.policy,
        )
        loss = loss + s.kl_coef * kl
        metrics["kl"] = float(km["kl"]) * share
    return loss, metrics


def _policy_term(
    s: LossSettings, counts: Counts, share: float, **inputs: Tensor | None
) -> tuple[Tensor, dict[str, float]]:
    """The preset's policy loss on ``inputs`` (``logprob``, ``old_logprob``, ``advantages``,
    ``mask``, ``weight``) and its metrics, each weighed by the micro-batch's ``share`` of the
    minibatch's tokens."""
    loss, m = LOSSES.policy(s.policy_loss)(
        **inputs,
        clip_low=s.clip_low,
        clip_high=s.clip_high,
        dual_clip=s.dual_clip,
        agg=s.agg,
        denominator=counts.policy,
    )
    missing = [key for key in POLICY_METRICS if key not in m]
    if missing:
        raise ValueError(
            f"policy loss {s.policy_loss!r} returned no {missing} metric "
            f"(a policy loss returns {', '.join(POLICY_METRICS)})"
        )
    return loss, {"policy_loss": float(loss.detach())} | {
        key: float(m[key]) * share for key in POLICY_METRICS
    }


def merge_ranks(
    per_rank: list[dict[str, float]],
    summed: tuple[str, ...] = (),
    maxed: tuple[str, ...] = (),
) -> dict[str, float]:
    """The actor ranks' ``train/`` metrics as one: the :func:`objective` metrics (each rank
    reports its share of the minibatch values) and the ``summed`` keys add up, a rank without
    the key adding 0; the ``maxed`` keys take the largest; the rest are averaged over the
    ranks that report them."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        values = [m[key] for m in per_rank if key in m]
        if key in summed or key.removeprefix("train/") in OBJECTIVE_METRICS:
            out[key] = sum(values)
        elif key in maxed:
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out

"""RL algorithms as pure tensor functions, registered by name (docs/algorithms.md).

Imports only ``torch`` and the standard library. Used by the embodied trainer (``pipelines``)
and the math-reasoning trainer (``reasoning``) alike:

    advantages, returns = compute_advantages("gae", rewards=..., values=..., terminated=...,
                                             truncated=..., gamma=0.99, lam=0.95)
    loss, metrics = policy_loss("ppo", logprob=..., old_logprob=..., advantages=..., mask=...,
                                clip_low=0.2, clip_high=0.28)

Registries: ``ADVANTAGES`` (gae, grpo, reinforce_pp, rloo; each with its declared kind),
``LOSSES`` (ppo, value, entropy, kl; each with the term it is), ``AGGREGATIONS`` (token-mean,
seq-mean-token-sum, seq-mean-token-mean), ``KL_ESTIMATORS`` (k1, k2, k3) and ``ALGORITHMS``
(presets: ppo, grpo, dapo, reinforce_pp, rloo, dagger). An unknown name raises
``UnknownNameError`` (a ``KeyError`` and a ``ValueError``) listing the known ones.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlinf_vla.algos import granularity
from rlinf_vla.algos.advantages import ADVANTAGES, gae, grpo, reinforce_pp, rloo
from rlinf_vla.algos.dapo import dynamic_sampling, overlong_penalty
from rlinf_vla.algos.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOSSES,
    Metrics,
    aggregate,
    entropy_loss,
    kl_divergence,
    kl_loss,
    metrics_to_floats,
    ppo_policy_loss,
    value_loss,
)
from rlinf_vla.algos.masked import masked_mean, masked_var, whiten
from rlinf_vla.algos.presets import ALGORITHMS, AlgorithmPreset
from rlinf_vla.algos.registry import Registry, UnknownNameError


def compute_advantages(name: str, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """``ADVANTAGES[name](**kwargs)``: ``(advantages, returns)``, shapes as the estimator says."""
    return ADVANTAGES[name](**kwargs)


def compute_loss(name: str, **kwargs: Any) -> tuple[Tensor, Metrics]:
    """``LOSSES[name](**kwargs)``: ``(loss 0-d, metrics)``, shapes as the loss says."""
    return LOSSES[name](**kwargs)


def policy_loss(name: str = "ppo", **kwargs: Any) -> tuple[Tensor, Metrics]:
    """The policy term, ``LOSSES.policy(name)(**kwargs)`` (``ppo``: clipped surrogate, see
    ``ppo_policy_loss``); a loss of another term is refused."""
    return LOSSES.policy(name)(**kwargs)


__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "ALGORITHMS",
    "KL_ESTIMATORS",
    "LOSSES",
    "AlgorithmPreset",
    "Metrics",
    "Registry",
    "UnknownNameError",
    "aggregate",
    "compute_advantages",
    "compute_loss",
    "dynamic_sampling",
    "entropy_loss",
    "gae",
    "granularity",
    "grpo",
    "kl_divergence",
    "kl_loss",
    "masked_mean",
    "masked_var",
    "metrics_to_floats",
    "overlong_penalty",
    "policy_loss",
    "ppo_policy_loss",
    "reinforce_pp",
    "rloo",
    "value_loss",
    "whiten",
]

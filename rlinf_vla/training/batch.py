"""The update's batch: a rollout's trajectories turned into flat samples with advantages.

Rewards, dones and values are used per chunk (one decision of the policy): the chunk's
reward is the sum of its steps' rewards, it terminated (truncated) if any of its steps did.
Advantages come from ``rlinf_vla.algos`` (GAE, bootstrapping truncated episodes from the value
of their final observation) and are broadcast to the policy's log-prob granularity by the
updater (:mod:`rlinf_vla.training.updater`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.algos.presets import estimate, estimator_kind
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.types import Observation, cat_obs


@dataclass
class Batch:
    """A flat batch of ``N`` samples (env chunk steps) for the update."""

    obs: Observation
    replay: dict[str, Tensor]
    old_logprob: Tensor  # [N, ...]
    old_value: Tensor  # [N]
    advantages: Tensor  # [N]
    returns: Tensor  # [N]
    mask: Tensor  # bool [N]: the sample enters the loss
    features: Tensor | None = None  # [N, ...] frozen features sent by the rollout workers
    weight: Tensor | None = None  # [N] the policy term's weight per sample (None: 1)

    def __len__(self) -> int:
        return self.old_value.shape[0]

    def select(self, idx: Tensor) -> Batch:
        return Batch(
            obs=self.obs.select(idx),
            replay={k: v[idx] for k, v in self.replay.items()},
            old_logprob=self.old_logprob[idx],
            old_value=self.old_value[idx],
            advantages=self.advantages[idx],
            returns=self.returns[idx],
            mask=self.mask[idx],
            features=None if self.features is None else self.features[idx],
            weight=None if self.weight is None else self.weight[idx],
        )


def chunk_level(traj: Any) -> dict[str, Tensor]:
    """Per-step ``[T, b, K]`` rewards and dones of a trajectory reduced to chunks ``[T, b]``
    (``granularity.chunk_rewards``)."""
    from rlinf_vla.algos.granularity import chunk_rewards

    rewards, terminated, truncated = chunk_rewards(traj.reward, traj.terminated, traj.truncated)
    return {"rewards": rewards, "terminated": terminated, "truncated": truncated}


def trajectory_advantages(traj: Any, algo: AlgoConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Advantages, returns and loss mask ``[T, b]`` of one trajectory, by the declared kind of
    the algorithm's estimator (:func:`~rlinf_vla.algos.presets.estimator_kind`; see
    :class:`~rlinf_vla.training.algo_config.AlgoConfig`)."""
    from rlinf_vla.algos import dynamic_sampling, granularity

    chunks = chunk_level(traj)
    T = traj.num_steps
    everything = torch.ones_like(chunks["rewards"], dtype=torch.bool)
    kind = estimator_kind(algo.advantage)
    if kind == "critic":  # e.g. GAE over chunk steps
        adv, ret = estimate(
            algo,
            values=traj.value,
            final_values=traj.final_value if algo.bootstrap_truncated else None,
            gamma=algo.gamma,
            **(chunks | {"rewards": chunks["rewards"] * algo.reward_scale}),
        )
        return adv, ret, everything
    dones = chunks["terminated"] | chunks["truncated"]
    if kind == "return":  # discounted chunk returns, not across episode boundaries
        adv, ret = estimate(
            algo,
            rewards=chunks["rewards"],
            mask=None,
            dones=dones,
            gamma=algo.gamma,
            kl=None,
            kl_coef=0.0,
        )
        return adv, ret, everything
    # Group estimators: each env's first episode is scored; its chunk steps share the advantage.
    scores = granularity.episode_scores(chunks["rewards"], dones, gamma=algo.gamma)
    adv, _ = estimate(algo, scores=scores, group_size=algo.group_size)
    mask = granularity.valid_until_first_done(dones)
    if algo.dynamic_sampling:  # groups whose episodes all scored the same teach nothing
        keep, _ = dynamic_sampling(scores, algo.group_size)
        mask = mask & keep[None, :]
    return adv.expand(T, -1), scores.expand(T, -1), mask


def build_batch(trajectories: list[Any], algo: AlgoConfig) -> Batch:
    """Advantages per trajectory, then everything flattened to ``N = sum(T * b)`` samples;
    with ``algo.episode_weight="equal"`` (group algorithms) the weights under which each
    trajectory's scored episodes weigh the same (``granularity.episode_weights``)."""
    from rlinf_vla.algos.granularity import episode_weights

    weighted = estimator_kind(algo.advantage) == "group" and algo.episode_weight == "equal"
    obs, replay, logprob, value, adv, ret, mask, weight = [], [], [], [], [], [], [], []
    for traj in trajectories:
        a, r, m = trajectory_advantages(traj, algo)
        if weighted:
            weight.append(episode_weights(m).flatten(0, 1))
        T = traj.num_steps
        obs.extend(traj.obs)
        replay.append({k: v.flatten(0, 1) for k, v in traj.replay.items()})
        logprob.append(traj.logprob.flatten(0, 1))
        value.append(traj.value[:T].flatten(0, 1))
        adv.append(a.flatten(0, 1))
        ret.append(r.flatten(0, 1))
        mask.append(m.flatten(0, 1))
    shipped = all(traj.features is not None for traj in trajectories)
    return Batch(
        obs=cat_obs(obs),
        replay={k: torch.cat([r[k] for r in replay]) for k in replay[0]},
        old_logprob=torch.cat(logprob),
        old_value=torch.cat(value),
        advantages=torch.cat(adv),
        returns=torch.cat(ret),
        mask=torch.cat(mask),
        features=torch.cat([t.features.flatten(0, 1) for t in trajectories]) if shipped else None,
        weight=torch.cat(weight) if weighted else None,
    )

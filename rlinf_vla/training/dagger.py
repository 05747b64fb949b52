"""DAgger's data: the states the policy visits, labelled by the env's scripted expert, gathered
over the run (``algo=dagger``; Ross, Gordon & Bagnell, 2011).

Each iteration the policy acts (the rollout of ``rlinf-vla train``, unchanged) and the env
workers label every step's state with the expert's action (``chunk_step(..., expert=True)``).
A sample is a chunk step: the observation the policy chose its chunk from, and as its target
the expert's labels of the chunk's ``K`` steps, the states the policy's own actions led to (the
target chunk of ``rlinf-vla sft``, a frame and the next ``K`` actions, with the expert's actions
in place of the demonstration's). The samples join the :class:`Aggregate`, and the actor fits
the policy to everything in it with the family's supervised loss (``Policy.loss``).

The rollout is the policy's alone (DAgger's ``beta_i = 0`` after a first iteration on expert
data): start from a behaviour-cloned checkpoint (``rlinf-vla sft``), which plays the part of
that first iteration.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlinf_vla.types import Observation, cat_obs

if TYPE_CHECKING:
    from rlinf_vla.training.supervised import SupervisedUpdater


def expert_samples(trajectories: list[Any]) -> tuple[Observation, Tensor, dict[str, float]]:
    """Every chunk step of ``trajectories`` as a sample: its observation and the expert's labels
    ``float32 [N, K, A]`` of the chunk. Steps whose episode crashed in the chunk
    (``invalid``) are left out.

    Returns:
        The observations, the target chunks, and ``action_error``: the mean absolute
        difference, per action entry, between the chunks the policy sent and the expert's
        labels (env units) over the kept samples.
    """

    obs, targets, sent = [], [], []
    for traj in trajectories:
        if traj.expert is None:
            raise ValueError(
                f"the trajectory of env stage {traj.source} carries no expert labels (the env "
                "workers label them with algo=dagger)"
            )
        keep = ~traj.invalid  # [T, b]
        for t, step_obs in enumerate(traj.obs):
            rows = torch.nonzero(keep[t]).flatten()
            if len(rows) == len(keep[t]):
                obs.append(step_obs)
            elif len(rows):
                obs.append(step_obs.select(rows))
            targets.append(traj.expert[t, rows])
            sent.append(traj.actions[t, rows])
    target = torch.cat(targets).float()
    error = float((torch.cat(sent).float() - target).abs().mean()) if len(target) else 0.0
    return cat_obs(obs), target, {"action_error": error}


class Aggregate:
    """The samples gathered so far: observations and target chunks, in memory.

    Args:
        capacity: keep the newest ``capacity`` samples (``None``: all of them).
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.obs: Observation | None = None
        self.actions: Tensor | None = None
        self.seen = 0  # samples ever added, the dropped ones too

    def __len__(self) -> int:
        return 0 if self.actions is None else len(self.actions)

    def add(self, obs: Observation, actions: Tensor) -> None:
        """Append samples (``obs`` and ``actions [n, K, A]``), dropping the oldest beyond
        ``capacity``."""
        if obs.batch_size != len(actions):
            raise ValueError(f"{obs.batch_size} observations for {len(actions)} target chunks")
        self.seen += len(actions)
        if self.actions is None:
            self.obs, self.actions = obs, actions
        else:
            assert self.obs is not None
            self.obs, self.actions = cat_obs([self.obs, obs]), torch.cat([self.actions, actions])
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest samples beyond ``capacity``."""
        if self.capacity is not None and len(self) > self.capacity:
            drop = len(self) - self.capacity
            assert self.obs is not None and self.actions is not None
            self.obs, self.actions = self.obs.select(slice(drop, None)), self.actions[drop:]

    def sample(self, size: int, generator: torch.Generator) -> tuple[Observation, Tensor]:
        """``size`` samples drawn uniformly (with replacement) with ``generator``."""
        if self.actions is None or self.obs is None:
            raise ValueError("the aggregate is empty")
        rows = torch.randint(len(self), (size,), generator=generator)
        return self.obs.select(rows), self.actions[rows]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue (a resumed run aggregates on top of it)."""
        obs = self.obs
        return {
            "seen": self.seen,
            "actions": self.actions,
            "images": None if obs is None else obs.images,
            "state": None if obs is None else obs.state,
            "instruction": None if obs is None else obs.instruction,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])
        self.actions = state["actions"]
        self.obs = None
        if self.actions is not None:
            self.obs = Observation(state["images"], state["state"], list(state["instruction"]))
        self._trim()  # a resume may bound it more tightly


class DaggerUpdater:
    """DAgger's update: each rollout's expert-labelled samples join the :class:`Aggregate`,
    then ``update_epochs x ceil(new samples / minibatch_size)`` supervised steps on minibatches
    drawn from all of it. Every rank takes as many steps (from the ranks' mean count), since
    their gradients are averaged step by step."""

    def __init__(self, supervised: SupervisedUpdater, capacity: int | None) -> None:
        self.supervised = supervised
        self.aggregate = Aggregate(capacity)

    def update(
        self, trajectories: list[Any], iteration: int, total_iterations: int
    ) -> dict[str, float]:
        sup = self.supervised
        a, learner = sup.algo, sup.learner
        lr = learner.set_lr(iteration, total_iterations)
        obs, targets, errors = expert_samples(trajectories)
        self.aggregate.add(obs, targets)
        new = learner.global_sum(float(len(targets))) / learner.global_sum(1.0)
        steps = a.update_epochs * math.ceil(new / a.minibatch_size)
        sums: dict[str, float] = {}
        skipped = 0
        for _ in range(steps):
            metrics = sup.step(*self.aggregate.sample(a.minibatch_size, sup.generator))
            skipped += int(metrics["train/skipped_updates"])
            for k in ("train/loss", "train/grad_norm"):
                sums[k] = sums.get(k, 0.0) + metrics[k]
        return {
            **{k: v / max(steps, 1) for k, v in sums.items()},
            "train/skipped_updates": float(skipped),
            "train/update_steps": float(steps),
            "train/nan_streak": float(learner.nan_streak),
            "train/lr": lr,
            "train/samples": float(len(targets)),
            "dagger/aggregate_samples": float(len(self.aggregate)),
            "dagger/action_error": errors["action_error"],
        }

    def state_dict(self) -> dict[str, Any]:
        """The actor checkpoint's entries of DAgger (the aggregate)."""
        return {"dagger_aggregate": self.aggregate.state_dict()}

    def load_state_dict(self, state: dict[str, Any], path: str) -> None:
        """Restore :meth:`state_dict`'s entries from the actor checkpoint ``state`` of
        ``path``."""
        if "dagger_aggregate" not in state:
            from rlinf_vla.policies import CheckpointMismatchError

            raise CheckpointMismatchError(
                f"{path} is not a dagger run's checkpoint (it holds no aggregate of "
                f"expert-labelled states): resume it with its own algo, or start dagger "
                f"from its weights with policy.checkpoint={path}/policy"
            )
        self.aggregate.load_state_dict(state["dagger_aggregate"])

"""Behaviour cloning's step: the policy family's own supervised loss (``Policy.loss``) on
observations and target action chunks, for ``rlinf-vla sft`` (demonstrations) and
``algo=dagger`` (expert-labelled states, :mod:`rlinf_vla.training.dagger`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.learner import Learner
from rlinf_vla.training.precision import autocast
from rlinf_vla.types import Observation


class SupervisedUpdater:
    """Optimizer steps of ``policy``'s supervised loss with ``learner``: minibatches of
    ``algo.minibatch_size`` samples per rank, accumulated over micro-batches of
    ``algo.micro_batch_size``, gradients averaged over the ranks; ``generator`` draws the
    minibatches."""

    def __init__(
        self,
        policy: Any,
        learner: Learner,
        algo: AlgoConfig,
        device: torch.device,
        generator: torch.Generator,
    ) -> None:
        self.policy, self.learner, self.algo = policy, learner, algo
        self.device, self.generator = device, generator

    def sft_step(self, data: Any, step: int, total_steps: int) -> dict[str, float]:
        """Step ``step`` of ``total_steps`` (the learning-rate schedule) on a minibatch drawn
        from ``data`` (:class:`~rlinf_vla.pipelines.demos.Demonstrations`, or anything with
        its ``sample(size, generator)``)."""
        lr = self.learner.set_lr(step, total_steps)
        metrics = self.step(*data.sample(self.algo.minibatch_size, self.generator))
        return {**metrics, "train/lr": lr}

    def step(self, obs: Observation, actions: Tensor) -> dict[str, float]:
        """One optimizer step on this rank's minibatch (``obs``, target chunks ``actions``)."""
        a = self.algo
        self.learner.zero_grad()
        loss_sum = 0.0
        # the mean over every rank's minibatch: the learner sums the ranks' gradients
        total = a.minibatch_size * self.learner.global_sum(1.0)
        for start in range(0, a.minibatch_size, a.micro_batch_size):
            rows = slice(start, start + a.micro_batch_size)
            share = len(actions[rows]) / total
            with autocast(self.device, a.autocast):
                loss = self.policy.loss(obs.select(rows), actions[rows].to(self.device))
            self.learner.backward(loss.float() * share)
            loss_sum += float(loss.detach()) * len(actions[rows]) / a.minibatch_size
        grad_norm = self.learner.step(loss_finite=math.isfinite(loss_sum))
        return {
            "train/loss": loss_sum,
            "train/grad_norm": grad_norm,
            "train/skipped_updates": float(not math.isfinite(grad_norm)),
            "train/nan_streak": float(self.learner.nan_streak),
        }

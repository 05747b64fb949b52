"""The policy updater of ``rlinf-vla train``: the algorithm's epochs over a rollout's batch.

Per iteration, :meth:`PolicyUpdater.update` shuffles the batch (:mod:`rlinf_vla.training.batch`)
``update_epochs`` times into minibatches of ``minibatch_size`` samples; each minibatch is one
optimizer step of the :class:`~rlinf_vla.training.learner.Learner`, its gradient accumulated
over micro-batches of ``micro_batch_size`` with the minibatch's global counts as denominators,
so the step does not depend on the micro-batch size or the number of ranks. The loss is the
preset's (:func:`~rlinf_vla.training.objective.objective`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.algos.presets import estimator_kind
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.batch import Batch
from rlinf_vla.training.learner import Learner, Schedule
from rlinf_vla.training.objective import Counts, LossSettings, objective
from rlinf_vla.training.precision import autocast


def is_log_std(name: str) -> bool:
    """A state-independent log-std parameter (``log_std``, under any module prefix)."""
    return name.rsplit(".", 1)[-1] == "log_std"


def is_critic(name: str) -> bool:
    """A parameter of the critic: its value head, or the encoder of its own features."""
    return "value_head" in name or "value_encoder" in name


def build_learner(policy: torch.nn.Module, algo: AlgoConfig) -> Learner:
    """The learner of an embodied policy: the critic (value head, and its own encoder when it
    has one) at ``value_lr`` (it alone learns during the critic warm-up), a log-std at
    ``log_std_lr`` when given, the rest at ``lr``."""
    return Learner(
        policy,
        algo.lr,
        second_group=(is_critic, algo.value_lr),
        extra_groups=[(is_log_std, algo.log_std_lr)] if algo.log_std_lr is not None else [],
        weight_decay=algo.weight_decay,
        max_grad_norm=algo.max_grad_norm,
        schedule=Schedule(algo.warmup_iterations, algo.lr_schedule, algo.critic_warmup_iterations),
    )


@dataclass
class _Tally:
    """What an update's minibatches add up to."""

    sums: dict[str, float] = field(default_factory=dict)  # the losses' metrics
    steps: int = 0  # optimizer steps: minibatches with a sample in the loss
    skipped: int = 0  # steps dropped for a non-finite gradient
    zero: int = 0  # minibatches without signal (every advantage 0)
    grad_norm: float = 0.0
    kl_stopped: bool = False


class PolicyUpdater:
    """Updates ``policy`` with ``learner`` on rollout batches, by the settings of ``algo``.

    Args:
        policy: the trained policy (``evaluate`` gives the log-probs, entropies and values).
        learner: its optimizer and data parallelism (with FSDP, :meth:`Learner.use_fsdp`
            was called).
        device: where the policy computes.
        generator: draws the minibatches (its state is part of a checkpoint).
        reference: the frozen starting policy of the KL penalty (``algo.kl_coef > 0``).
    """

    def __init__(
        self,
        policy: Any,
        learner: Learner,
        algo: AlgoConfig,
        device: torch.device,
        generator: torch.Generator,
        reference: Any = None,
    ) -> None:
        self.policy, self.learner, self.algo = policy, learner, algo
        self.device, self.generator, self.reference = device, generator, reference

    def update(self, batch: Batch, iteration: int, total_iterations: int) -> dict[str, float]:
        """The epochs over ``batch`` at iteration ``iteration`` of ``total_iterations`` (the
        learning-rate schedule); returns the ``train/`` metrics."""
        from rlinf_vla.algos import whiten
        from rlinf_vla.algos.losses import explained_variance

        a = self.algo
        if estimator_kind(a.advantage) == "critic" and a.normalize_advantages and len(batch) > 1:
            batch.advantages = whiten(batch.advantages)
        lr = self.learner.set_lr(iteration, total_iterations)
        features = self.frozen_features(batch) if a.cache_frozen_features else None
        settings = LossSettings.of(a)
        tally = _Tally()
        for _ in range(a.update_epochs):
            order = torch.randperm(len(batch), generator=self.generator)
            for start in range(0, len(batch), a.minibatch_size):
                self._minibatch(
                    batch, order[start : start + a.minibatch_size], features, settings, tally
                )
                if tally.kl_stopped:
                    break
            if tally.kl_stopped:
                break
        steps = max(tally.steps, 1)
        # the losses' metrics: a mean over the minibatches that held a valid sample
        result = {f"train/{k}": v / steps for k, v in tally.sums.items()}
        if a.critic_epochs and settings.value_coef:
            result.update(self._fit_critic(batch, settings))
        result["train/grad_norm"] = tally.grad_norm / steps
        result["train/skipped_updates"] = float(tally.skipped)
        result["train/skipped_zero_advantage"] = float(tally.zero)
        result["train/update_steps"] = float(tally.steps)
        if a.target_kl is not None:
            result["train/kl_stopped"] = float(tally.kl_stopped)
        result["train/nan_streak"] = float(self.learner.nan_streak)
        result["train/lr"] = lr
        result["train/advantage_mean"] = float(batch.advantages.mean())
        result["train/return_mean"] = float(batch.returns.mean())
        if estimator_kind(a.advantage) == "critic":
            # over the whole rollout, with the values it was played with
            ev = float(explained_variance(batch.old_value, batch.returns, batch.mask))
            if ev == ev:  # not NaN: the returns vary over two or more valid samples
                result["train/explained_variance"] = ev
        result["train/samples"] = float(batch.mask.sum())
        result["train/frozen_features"] = float(features is not None)
        return result

    def _minibatch(
        self,
        batch: Batch,
        mb_idx: Tensor,
        features: Tensor | None,
        settings: LossSettings,
        tally: _Tally,
    ) -> None:
        """One optimizer step on the samples ``mb_idx`` of ``batch``, or none: no rank has a
        sample in the loss, or (a policy term alone) no rank has a non-zero advantage, or the
        minibatch's KL passes ``1.5 x algo.target_kl`` (``tally.kl_stopped``: the update ends)."""
        a, learner = self.algo, self.learner
        # Every term divides by its count over the whole minibatch on every rank, so the
        # micro-batches' (and ranks') gradients add up to the minibatch's, whatever
        # algo.micro_batch_size is (rlinf_vla.training.learner).
        valid = learner.global_sum(float(batch.mask[mb_idx].sum()))
        if not valid:  # no rank has a sample in the loss (DAPO's dropped groups):
            return  # no update, on every rank alike (valid is the global count)
        # a policy term alone: its gradient is 0 where every advantage is
        if a.skip_zero_advantage and not (
            settings.value_coef or settings.entropy_coef or settings.kl_coef
        ):
            live = batch.mask[mb_idx] & (batch.advantages[mb_idx] != 0)
            if not learner.global_sum(float(live.sum())):
                tally.zero += 1  # no signal on any rank: no step (and no momentum)
                return
        learner.zero_grad()
        minibatch: dict[str, float] = {}  # this rank's shares of the minibatch's values
        for m_start in range(0, len(mb_idx), a.micro_batch_size):
            idx = mb_idx[m_start : m_start + a.micro_batch_size]
            mb = batch.select(idx)
            if not mb.mask.any() and not learner.fsdp_world:
                continue  # adds 0 (FSDP's collectives need every rank in every pass)
            loss, metrics = self._micro_loss(mb, idx, features, settings, valid)
            learner.backward(loss)
            for k, v in metrics.items():
                minibatch[k] = minibatch.get(k, 0.0) + v
        # the same sum, so the same decision, on every rank
        kl = None if a.target_kl is None else learner.global_sum(minibatch.get("approx_kl", 0.0))
        if kl is not None and kl > 1.5 * a.target_kl:
            learner.zero_grad()
            tally.kl_stopped = True
            return
        for k, v in minibatch.items():
            tally.sums[k] = tally.sums.get(k, 0.0) + v
        grad_norm = learner.step()
        tally.skipped += not math.isfinite(grad_norm)
        tally.grad_norm += grad_norm
        tally.steps += 1

    def _fit_critic(self, batch: Batch, settings: LossSettings) -> dict[str, float]:
        """``algo.critic_epochs`` passes over ``batch`` that fit the critic alone (its value
        loss, the other groups' rates 0); returns their mean value loss and step count."""
        from rlinf_vla.algos.granularity import expand_like
        from rlinf_vla.algos.losses import value_loss

        a, learner = self.algo, self.learner
        total, steps = 0.0, 0
        with learner.critic_only():
            for _ in range(a.critic_epochs):
                order = torch.randperm(len(batch), generator=self.generator)
                for start in range(0, len(batch), a.minibatch_size):
                    mb_idx = order[start : start + a.minibatch_size]
                    valid = learner.global_sum(float(batch.mask[mb_idx].sum()))
                    if not valid:
                        continue
                    learner.zero_grad()
                    loss_sum = 0.0
                    for m_start in range(0, len(mb_idx), a.micro_batch_size):
                        mb = batch.select(mb_idx[m_start : m_start + a.micro_batch_size])
                        if not mb.mask.any():
                            continue
                        replay = {k: v.to(self.device) for k, v in mb.replay.items()}
                        with autocast(self.device, a.autocast):
                            values = self.policy.critic_values(mb.obs, replay).float()
                        dev = values.device
                        vl, _ = value_loss(
                            values=values,
                            old_values=mb.old_value.to(dev),
                            returns=mb.returns.to(dev),
                            mask=expand_like(mb.mask.to(dev), values),
                            clip=settings.value_clip,
                            denominator=valid * values[0].numel(),
                        )
                        learner.backward(settings.value_coef * vl)
                        loss_sum += float(vl.detach())
                    learner.step()
                    total += loss_sum
                    steps += 1
        return {
            "train/critic_value_loss": total / max(steps, 1),
            "train/critic_update_steps": float(steps),
        }

    def _micro_loss(
        self,
        mb: Batch,
        idx: Tensor,
        features: Tensor | None,
        settings: LossSettings,
        valid: float,
    ) -> tuple[Tensor, dict[str, float]]:
        """One micro-batch's share of its minibatch's loss; ``valid``: the minibatch's valid
        samples over every rank. Each sample has the same number of log-prob (entropy, value)
        entries, so a term's count is ``valid`` times its entries per sample (``token-mean``)
        or ``valid`` (the sequence modes)."""
        from rlinf_vla.algos.granularity import expand_like

        replay = {k: v.to(self.device) for k, v in mb.replay.items()}
        out = self._evaluate(self.policy, mb, replay, None if features is None else features[idx])
        logprob, entropy = out.logprob.float(), out.entropy.float()
        values = None if out.value is None else out.value.float()
        dev = logprob.device
        ref_logprob = None
        if self.reference is not None:  # built exactly when kl_coef > 0
            with torch.no_grad():  # the frozen part is the same in both
                ref = self._evaluate(
                    self.reference, mb, replay, None if features is None else features[idx]
                )
            ref_logprob = ref.logprob.float()
        sample_mask = mb.mask.to(dev)

        def count(x: Tensor, agg: str) -> float:
            return valid * (x[0].numel() if agg == "token-mean" else 1)

        counts = Counts(
            policy=count(logprob, settings.agg),
            value=0.0 if values is None else count(values, "token-mean"),
            entropy=count(entropy, settings.agg),
            tokens=count(logprob, "token-mean"),
        )
        return objective(
            settings,
            counts,
            logprob=logprob,
            old_logprob=mb.old_logprob.to(dev),
            advantages=expand_like(mb.advantages.to(dev), logprob),
            mask=expand_like(sample_mask, logprob),
            entropy=entropy,
            entropy_mask=expand_like(sample_mask, entropy),
            values=values,
            old_values=None if values is None else mb.old_value.to(dev),
            returns=None if values is None else mb.returns.to(dev),
            value_mask=None if values is None else expand_like(sample_mask, values),
            ref_logprob=ref_logprob,
            weight=None if mb.weight is None else expand_like(mb.weight.to(dev), logprob),
        )

    def _evaluate(
        self, policy: Any, mb: Batch, replay: dict[str, Tensor], features: Tensor | None
    ) -> Any:
        """``policy``'s log-probs of the replayed actions (from the frozen ``features`` when
        given)."""
        with autocast(self.device, self.algo.autocast):
            if features is None:
                return policy.evaluate(mb.obs, replay)
            return policy.evaluate_features(features, replay)

    def frozen_features(self, batch: Batch) -> Tensor | None:
        """The policy's frozen features of every sample of ``batch`` (``[N, ...]``: those the
        rollout workers sent, else computed micro-batch by micro-batch), or ``None`` when it
        cannot split off its read-out."""
        if self.learner.fsdp_world:  # the sharded policy gathers its weights for ``evaluate``
            return None
        if batch.features is not None and self.policy.trains_readout_only():
            return batch.features.to(self.device)  # computed by the rollout workers
        parts = []
        step = self.algo.micro_batch_size
        for start in range(0, len(batch), step):
            mb = batch.select(torch.arange(start, min(start + step, len(batch))))
            replay = {k: v.to(self.device) for k, v in mb.replay.items()}
            with autocast(self.device, self.algo.autocast):
                part = self.policy.frozen_features(mb.obs, replay)
            if part is None:
                return None
            parts.append(part)
        return torch.cat(parts)

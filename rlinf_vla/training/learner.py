"""The learner both trainers update their models with (``train``/``sft`` and ``math-grpo``).

It owns the optimizer, the learning-rate schedule, gradient accumulation with global
normalisers, data parallelism (an all-reduce over the actor ranks, or FSDP2), the skip of
non-finite updates, and the optimizer's part of a checkpoint. An actor worker turns its
trajectories into micro-batches and calls, per optimizer step::

    learner.zero_grad()
    for micro in micro_batches:
        loss = loss_fn(micro, denominator=count_of_the_whole_minibatch)   # a sum / global count
        learner.backward(loss)
    grad_norm = learner.step()                 # all-reduce (sum), clip, step or skip

**Global normalisers.** Each micro-batch's loss is its numerator divided by the count of the
*whole* minibatch over *every* rank (``rlinf_vla.algos.aggregation_count``, summed with
:meth:`Learner.global_sum`): valid tokens for ``token-mean``, sequences for the sequence
modes. Gradients are then *summed* over micro-batches and ranks, so the update is the
gradient of the minibatch's loss whatever ``micro_batch_size`` or the number of ranks is, and
however the valid samples fall into micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule, per optimizer step or per iteration (the caller's unit).

    Attributes:
        warmup: linear warm-up from ``1/warmup`` of the rate to the full rate over this many
            steps (``0``: none).
        decay: ``constant``, or ``linear`` to 0 at ``total`` steps (after the warm-up).
        critic_warmup: for the first N steps only the second parameter group (the value
            head) learns; the policy's rate is 0.
    """

    warmup: int = 0
    decay: Literal["constant", "linear"] = "constant"
    critic_warmup: int = 0

    def scale(self, step: int, total: int) -> float:
        """The factor on the base learning rate at ``step`` (0-based) of ``total``."""
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay == "linear":
            return max(0.0, 1.0 - step / max(1, total))
        return 1.0


class Learner:
    """AdamW over a module's trainable parameters, optionally with a second group (the value
    head) and further groups of the policy (e.g. the log-std) at their own learning rates.

    Args:
        module: the trained model (its ``requires_grad`` parameters are optimised).
        lr: the base learning rate of the main group.
        second_group: ``(predicate on the parameter name, lr)``: those parameters form a second
            group with their own rate (``None``: one group). It learns during the critic
            warm-up.
        extra_groups: more ``(predicate, lr)`` groups of the policy, after the second one (a
            parameter goes to the first group whose predicate takes it; the main group takes the
            rest). They follow the main group's schedule: rate 0 during the critic warm-up.
        betas, weight_decay: AdamW settings.
        max_grad_norm: the gradients' global norm is clipped to this (``0`` or ``inf``: off).
        schedule: the learning-rate schedule.
    """

    def __init__(
        self,
        module: nn.Module,
        lr: float,
        *,
        second_group: tuple[Callable[[str], bool], float] | None = None,
        extra_groups: Sequence[tuple[Callable[[str], bool], float]] = (),
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        schedule: Schedule | None = None,
    ) -> None:
        self.module = module
        self.lr, self.second_group = lr, second_group
        self.extra_groups = tuple(extra_groups)
        # (base rate, learns during the critic warm-up) of each built group, in order
        self._group_rates: list[tuple[float, bool]] = []
        self.betas, self.weight_decay = tuple(betas), weight_decay
        self.max_grad_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        self.schedule = schedule or Schedule()
        self.dp: Any = None  # a collective over the actor ranks (summed gradients)
        self.fsdp_world = 0  # > 0: FSDP2 averages the gradients over this many ranks
        self.nan_streak = 0  # optimizer steps skipped in a row (non-finite gradient)
        self.optimizer = self.build_optimizer()

    # ----------------------------------------------------------------- setup
    def build_optimizer(self) -> torch.optim.Optimizer:
        """A fresh AdamW over the module's current parameters (again after FSDP sharding)."""
        specs = [(self.second_group, True)] if self.second_group is not None else []
        specs += [(g, False) for g in self.extra_groups]
        members: list[list[nn.Parameter]] = [[] for _ in specs]
        main: list[nn.Parameter] = []
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            i = next((i for i, ((take, _), _) in enumerate(specs) if take(name)), None)
            (main if i is None else members[i]).append(p)
        groups = [{"params": main, "lr": self.lr, "base_lr": self.lr}]
        self._group_rates = [(self.lr, False)]
        for ((_, lr), critic), params in zip(specs, members, strict=True):
            if params:
                groups.append({"params": params, "lr": lr, "base_lr": lr})
                self._group_rates.append((lr, critic))
        self.optimizer = torch.optim.AdamW(groups, betas=self.betas, weight_decay=self.weight_decay)
        return self.optimizer

    def join_data_parallel(self, collective: Any) -> None:
        """Sum gradients (and counts) over the ranks of ``collective`` (``None``: one rank)."""
        self.dp = collective

    def use_fsdp(self, world_size: int, collective: Any = None) -> None:
        """The module was sharded with FSDP2 over ``world_size`` ranks: FSDP reduce-scatters
        the gradients as a mean, so :meth:`backward` scales the loss by the world size to
        keep their sum; ``collective`` still sums the counts. Rebuilds the optimizer."""
        self.fsdp_world = world_size
        self.dp = collective
        self.build_optimizer()

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # ----------------------------------------------------------------- schedule
    def set_lr(self, step: int, total: int = 0) -> float:
        """Set each group's rate for ``step`` of ``total`` (read by the linear decay only);
        returns the main group's."""
        scale = self.schedule.scale(step, total)
        main = 0.0 if step < self.schedule.critic_warmup else scale
        for group, (_, critic) in zip(self.optimizer.param_groups, self._group_rates, strict=True):
            group["lr"] = group["base_lr"] * (scale if critic else main)
        return self.optimizer.param_groups[0]["lr"]

    @contextlib.contextmanager
    def critic_only(self) -> Iterator[None]:
        """Steps inside move the critic's group alone: every other group's rate is 0 (AdamW
        moves a parameter by its rate times its step and its decay), and back after."""
        rates = [g["lr"] for g in self.optimizer.param_groups]
        for group, (_, critic) in zip(self.optimizer.param_groups, self._group_rates, strict=True):
            if not critic:
                group["lr"] = 0.0
        try:
            yield
        finally:
            for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = rate

    # ----------------------------------------------------------------- accumulation
    def global_sum(self, value: float) -> float:
        """``value`` summed over the data-parallel ranks (a count: the loss's denominator)."""
        if self.dp is None and not self.fsdp_world:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        if self.dp is not None:
            self.dp.all_reduce(t)
        else:  # FSDP: the actor group's default process group
            import torch.distributed as dist

            t = t.to(self.parameters[0].device)  # NCCL reduces device tensors only
            dist.all_reduce(t)
        return float(t[0])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradient of ``loss``, a micro-batch's numerator divided by the
        global count of its minibatch."""
        (loss * self.fsdp_world if self.fsdp_world else loss).backward()

    def step(self, loss_finite: bool | None = None) -> float:
        """Sum the gradients over the ranks, clip them and step; a non-finite gradient, or a
        non-finite loss on any rank (``loss_finite`` false), is dropped instead (counted in
        :attr:`nan_streak`). Returns the norm before clipping (``nan`` when dropped for the
        loss). ``loss_finite=None`` (every rank alike): the loss is not checked, and no
        collective is spent on it."""
        params = self.parameters
        if self.dp is not None and not self.fsdp_world:
            _all_reduce_gradients(self.dp, params)
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        # every rank takes the same decision: a loss that is not finite anywhere drops the step
        bad_loss = loss_finite is not None and self.global_sum(0.0 if loss_finite else 1.0) > 0
        value = float("nan") if bad_loss else float(norm)
        if math.isfinite(value):
            self.optimizer.step()
            self.nan_streak = 0
        else:
            self.zero_grad()
            self.nan_streak += 1
        return value

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self, optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The optimizer state (``optimizer_state``: one gathered elsewhere, e.g. FSDP's full
        state) and the skip streak."""
        return {
            "optimizer": self.optimizer.state_dict()
            if optimizer_state is None
            else optimizer_state,
            "nan_streak": self.nan_streak,
        }

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None:
        """Restore :meth:`state_dict`'s state. The rates and the weight decay stay those of this
        run's config (a resume may change them)."""
        if load_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.reset_hyperparameters()
        self.nan_streak = state.get("nan_streak", 0)

    def reset_hyperparameters(self) -> None:
        """The configured base rates and weight decay on every group (after loading an
        optimizer state, which carries the ones it was saved with)."""
        for group, (lr, _) in zip(self.optimizer.param_groups, self._group_rates, strict=True):
            group["base_lr"] = group["lr"] = lr
            group["weight_decay"] = self.weight_decay


def _all_reduce_gradients(dp: Any, params: list[nn.Parameter]) -> None:
    """Sum the gradients of ``params`` over the ranks of ``dp`` in one flat all-reduce (a
    parameter without a gradient counts as zeros). A parameter no rank has a gradient for
    keeps none, so that AdamW leaves it alone (no weight decay, no momentum step) as on one
    rank."""
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
        + [torch.tensor([float(p.grad is not None) for p in params], dtype=params[0].dtype)]
    )
    dp.all_reduce(flat)
    had_grad = flat[-len(params) :] > 0
    offset = 0
    for p, has in zip(params, had_grad.tolist(), strict=True):
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone() if has else None
        offset += p.numel()


class HasLearner:
    """For a worker that updates its model with a :class:`Learner` (``self.learner``)."""

    learner: Learner

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    @property
    def nan_streak(self) -> int:
        """Optimizer steps skipped in a row (non-finite loss or gradient)."""
        return self.learner.nan_streak

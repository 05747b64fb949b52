"""The shared ``Learner``: gradient accumulation over micro-batches and data-parallel ranks
gives the gradient (and the AdamW step) of the whole minibatch's loss written out by hand; the
learning-rate schedule, the value head's own rate, the skip of non-finite updates and the
optimizer's checkpoint against hand values.

Several ranks run either as threads of this process that share a test-local collective (its
``all_reduce`` really sums the tensors every simulated rank contributes), or as real processes
with a gloo process group."""

from __future__ import annotations

import copy
import functools
import io
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlinf_vla.algos.losses import aggregate, aggregation_count
from rlinf_vla.training.learner import Learner, Schedule
from rlinf_vla.training.objective import Counts, LossSettings, objective

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LR, BETAS, WD = 1e-2, (0.9, 0.999), 0.01
D, V = 5, 3  # input features; classes (the model's last output is a value)
N, L = 6, 4  # samples ("sequences") of the minibatch, tokens per sample
# Rows 2 and 3 hold no valid token: split over 2 ranks, micro-batches [2] (size 1) and [2]
# (size 2 on rank 0) are empty; over 3 ranks, rank 1 ([2, 3]) has no valid sample at all.
MASK = torch.tensor(
    [
        [1, 1, 1, 0],
        [1, 0, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [1, 1, 1, 1],
        [0, 1, 1, 0],
    ],
    dtype=torch.bool,
)
SETTINGS = dict(
    clip_low=0.2, clip_high=0.28, dual_clip=3.0, value_coef=0.5, value_clip=0.2,
    entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3",
)  # fmt: skip


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, L, D, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (N, L), generator=g)
    with torch.no_grad():
        logprob0, _, value0 = _forward(_model(), x, target)
    return {
        "x": x,
        "target": target,
        # stale log-probs: ratios away from 1, some clipped, some dual-clipped
        "old_logprob": logprob0 + 0.7 * torch.randn(N, L, generator=g, dtype=torch.float64),
        "ref_logprob": logprob0 + 0.3 * torch.randn(N, L, generator=g, dtype=torch.float64),
        "advantages": 2.0 * torch.randn(N, L, generator=g, dtype=torch.float64),
        "old_values": value0 + 0.3 * torch.randn(N, generator=g, dtype=torch.float64),
        "returns": torch.randn(N, generator=g, dtype=torch.float64),
    }


def _model() -> nn.Linear:
    g = torch.Generator().manual_seed(1)
    model = nn.Linear(D, V + 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(V + 1, D, generator=g))
        model.bias.copy_(torch.randn(V + 1, generator=g))
    return model


def _forward(model: nn.Module, x: torch.Tensor, target: torch.Tensor):
    """Per-token log-probs and entropies ``[n, L]`` and one value per sample ``[n]``."""
    out = model(x)
    logp = torch.log_softmax(out[..., :V], dim=-1)
    logprob = logp.gather(-1, target[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return logprob, entropy, out[:, 0, V]


DATA = _data()


# ------------------------------------------------------------------ the losses, by hand
def _hand_agg(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The whole minibatch's aggregate, written out row by row."""
    if mode == "token-mean":
        return loss[mask].sum() / mask.sum()
    terms = []
    for row, m in zip(loss, mask, strict=True):
        if m.any():
            terms.append(row[m].sum() / (m.sum() if mode == "seq-mean-token-mean" else 1))
    return torch.stack(terms).sum() / len(terms)


def _hand_loss(model: nn.Module, mode: str, path: str) -> torch.Tensor:
    d = DATA
    logprob, entropy, values = _forward(model, d["x"], d["target"])
    if path == "aggregate":  # a masked cross-entropy
        return _hand_agg(-logprob, MASK, mode)
    s = SETTINGS
    adv, ratio = d["advantages"], torch.exp(logprob - d["old_logprob"])
    clipped = ratio.clamp(1 - s["clip_low"], 1 + s["clip_high"])
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    pg = torch.where(adv < 0, torch.minimum(pg, -s["dual_clip"] * adv), pg)
    vmask = MASK.any(dim=1)
    old_v, ret = d["old_values"], d["returns"]
    v_clip = old_v + (values - old_v).clamp(-s["value_clip"], s["value_clip"])
    v_loss = torch.maximum(0.5 * (values - ret) ** 2, 0.5 * (v_clip - ret) ** 2)
    log_ratio = logprob - d["ref_logprob"]
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    return (
        _hand_agg(pg, MASK, mode)
        + s["value_coef"] * v_loss[vmask].mean()
        - s["entropy_coef"] * _hand_agg(entropy, MASK, mode)
        + s["kl_coef"] * _hand_agg(k3, MASK, mode)
    )


def _reference_step(mode: str, path: str, max_grad_norm: float = math.inf):
    """The hand loss's gradient by autograd, and one plain AdamW step on it."""
    model = _model()
    loss = _hand_loss(model, mode, path)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    scale = min(1.0, max_grad_norm / float(norm))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g * scale
    opt.step()
    return [g.clone() for g in grads], float(norm), [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------ simulated ranks
class ThreadCollective:
    """``world`` ranks as threads: ``rank(r).all_reduce(t)`` waits for every rank's tensor and
    writes their sum into each (summed in rank order, so every rank gets the same bits)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def rank(self, r: int) -> _RankHandle:
        return _RankHandle(self, r)


class _RankHandle:
    def __init__(self, collective: ThreadCollective, rank: int) -> None:
        self.c, self.r = collective, rank

    def all_reduce(self, tensor: torch.Tensor) -> None:
        c = self.c
        c.calls[self.r] += 1
        c.slots[self.r] = tensor.detach().clone()
        c.barrier.wait()
        total = c.slots[0].clone()
        for other in c.slots[1:]:
            total += other
        c.barrier.wait()  # every rank has read the slots before any writes the next ones
        tensor.copy_(total)


class GlooCollective:
    """The collective of a real rank: sums over the default (gloo) process group."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)


def _run_ranks(world: int, fn):
    """``fn(rank, collective)`` on every rank at once; their results in rank order."""
    if world == 1:
        return [fn(0, None)]
    collective = ThreadCollective(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(fn, r, collective.rank(r)) for r in range(world)]
        results = [f.result() for f in futures]
    assert collective.calls == [collective.calls[0]] * world and collective.calls[0] > 0
    return results


def _rank_update(rank, collective, *, world, mode, path, micro, max_grad_norm=0.0):
    """One optimizer step of ``rank``'s share of the minibatch (contiguous rows) through the
    Learner, ``micro`` rows per micro-batch (``None``: all of them)."""
    model = _model()
    learner = Learner(model, LR, betas=BETAS, weight_decay=WD, max_grad_norm=max_grad_norm)
    if collective is not None:
        learner.join_data_parallel(collective)
    rows = torch.arange(N).tensor_split(world)[rank]
    mask = MASK[rows]
    count = learner.global_sum(aggregation_count(mask, mode))
    counts = Counts(policy=count, value=learner.global_sum(float(mask.any(dim=1).sum())))
    learner.zero_grad()
    step = micro or max(len(rows), 1)
    for start in range(0, len(rows), step):
        idx = rows[start : start + step]
        d = {k: v[idx] for k, v in DATA.items()}
        logprob, entropy, values = _forward(model, d["x"], d["target"])
        m = MASK[idx]
        if path == "aggregate":
            loss = aggregate(-logprob, m, mode, denominator=count)
        else:
            loss, _ = objective(
                LossSettings(agg=mode, **SETTINGS), counts, logprob=logprob,
                old_logprob=d["old_logprob"], advantages=d["advantages"], mask=m,
                entropy=entropy, values=values, old_values=d["old_values"],
                returns=d["returns"], value_mask=m.any(dim=1), ref_logprob=d["ref_logprob"],
            )  # fmt: skip
        learner.backward(loss)  # an empty micro-batch too: it must add exactly 0
    norm = learner.step()
    return {
        "count": count,
        "norm": norm,
        "grads": [p.grad.clone() for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _hand_count(mode: str) -> float:
    return float(MASK.sum()) if mode == "token-mean" else float(MASK.any(dim=1).sum())


@pytest.mark.parametrize("path", ["aggregate", "objective"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_accumulation_over_micro_batches_and_ranks_is_the_minibatch_gradient(mode, world, path):
    grads, _, params = _reference_step(mode, path)
    for micro in (1, 2, None):
        results = _run_ranks(
            world,
            lambda r, c, micro=micro: _rank_update(
                r, c, world=world, mode=mode, path=path, micro=micro
            ),
        )
        for rank, res in enumerate(results):
            where = f"{mode}, {path}, {world} ranks, micro-batch {micro}, rank {rank}"
            assert res["count"] == _hand_count(mode), where
            for got, want in zip(res["grads"], grads, strict=True):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}"
                )
            for got, want in zip(res["params"], params, strict=True):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}"
                )


@pytest.mark.parametrize("mode", MODES)
def test_metrics_summed_over_micro_batches_are_the_minibatch_values(mode):
    """``objective``'s metrics are the micro-batch's shares: summed over the micro-batches they
    give the minibatch's values whatever the micro-batch size (the loss terms, and the masked
    means over the valid tokens of the clip fraction, approx. KL and entropy)."""
    model, d = _model(), DATA
    with torch.no_grad():
        logprob, entropy, _ = _forward(model, d["x"], d["target"])
        ratio = torch.exp(logprob - d["old_logprob"])
        adv = d["advantages"]
        clipped = -adv * ratio.clamp(0.8, 1.28) > -adv * ratio
        log_ratio = logprob - d["old_logprob"]
        expected = {
            "clip_fraction": float(clipped[MASK].double().mean()),
            "approx_kl": float(((ratio - 1) - log_ratio)[MASK].mean()),
            "entropy": float(entropy[MASK].mean()),
            "ratio_mean": float(ratio[MASK].mean()),
        }
    count = _hand_count(mode)
    for micro in (1, 2, N):
        sums: dict[str, float] = {}
        for start in range(0, N, micro):
            idx = torch.arange(start, min(start + micro, N))
            lp, ent, _ = _forward(model, d["x"][idx], d["target"][idx])
            _, metrics = objective(
                LossSettings(agg=mode, clip_low=0.2, clip_high=0.28),
                Counts(policy=count, tokens=float(MASK.sum())),
                logprob=lp, old_logprob=d["old_logprob"][idx], advantages=adv[idx],
                mask=MASK[idx], entropy=ent,
            )  # fmt: skip
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        for key, value in expected.items():
            assert sums[key] == pytest.approx(value, rel=1e-6), (mode, micro, key)  # float32


@pytest.mark.parametrize("world", [1, 2])
def test_clipping_applies_to_the_gradient_summed_over_the_ranks(world):
    max_norm = 0.05
    grads, norm, params = _reference_step("token-mean", "objective", max_grad_norm=max_norm)
    assert norm > 4 * max_norm  # the clip bites
    results = _run_ranks(
        world,
        functools.partial(
            _rank_update,
            world=world,
            mode="token-mean",
            path="objective",
            micro=1,
            max_grad_norm=max_norm,
        ),
    )
    for res in results:
        assert res["norm"] == pytest.approx(norm, rel=1e-10)  # the norm before clipping
        for got, want in zip(res["grads"], grads, strict=True):
            torch.testing.assert_close(got, want * (max_norm / norm), rtol=1e-6, atol=1e-12)
        for got, want in zip(res["params"], params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ real ranks (gloo)
def _gloo_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = _rank_update(
            rank, GlooCollective(), world=world, mode="seq-mean-token-mean", path="objective",
            micro=1,
        )  # fmt: skip
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_real_gloo_ranks_step_like_one_process_on_the_whole_minibatch(tmp_path):
    world = 2
    # first, so that the forked ranks inherit the modules an optimizer imports (torch._dynamo,
    # seconds): a spawned rank would import torch and those anew
    grads, _, params = _reference_step("seq-mean-token-mean", "objective")
    mp.start_processes(
        _gloo_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
        join=True, start_method="fork",
    )  # fmt: skip
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["count"] == _hand_count("seq-mean-token-mean")
        for got, want in zip(res["grads"], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for got, want in zip(res["params"], params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ data parallel: no gradient
class _PolicyAndValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.policy = nn.Linear(3, 2).double()
        self.value_head = nn.Linear(3, 1).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))


X = torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _steps_without_value_gradient(rank, collective, *, world, valid_steps):
    """``len(valid_steps)`` optimizer steps of a loss that never reaches the value head (GRPO);
    at a step marked False the minibatch holds no valid sample, so every micro-batch is left
    out (as the actor does) and no parameter gets a gradient."""
    model = _PolicyAndValue()
    learner = Learner(model, LR, weight_decay=0.1, max_grad_norm=0.0)
    if collective is not None:
        learner.join_data_parallel(collective)
    rows = torch.arange(len(X)).tensor_split(world)[rank]
    for valid in valid_steps:
        learner.zero_grad()
        if valid:
            learner.backward(model.policy(X[rows]).pow(2).sum() / len(X))
        learner.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "valid_steps", [(True,), (True, False)], ids=["unused-value-head", "empty-minibatch"]
)
def test_parameters_without_a_gradient_on_every_rank_step_as_on_one_rank(valid_steps):
    """On one rank AdamW leaves a parameter without a gradient alone (no weight decay, no
    momentum step). Several ranks must update the model exactly as one rank would."""
    (one,) = _run_ranks(
        1, lambda r, c: _steps_without_value_gradient(r, c, world=1, valid_steps=valid_steps)
    )
    fresh = _PolicyAndValue()
    for name, p in fresh.value_head.named_parameters():
        assert torch.equal(one[f"value_head.{name}"], p), name  # one rank: untouched
    results = _run_ranks(
        2, lambda r, c: _steps_without_value_gradient(r, c, world=2, valid_steps=valid_steps)
    )
    for rank, res in enumerate(results):
        for name, p in one.items():
            torch.testing.assert_close(
                res[name], p, rtol=1e-10, atol=1e-12, msg=lambda m, w=(rank, name): f"{w}: {m}"
            )


# ------------------------------------------------------------------ learning-rate schedule
def _two_group_learner(schedule: Schedule, lr=1e-3, lr2=1e-2) -> Learner:
    return Learner(
        _PolicyAndValue(), lr, second_group=(lambda n: n.startswith("value_head"), lr2),
        schedule=schedule,
    )  # fmt: skip


def _rates(learner: Learner) -> list[float]:
    return [g["lr"] for g in learner.optimizer.param_groups]


def test_linear_warmup_then_constant():
    learner = _two_group_learner(Schedule(warmup=4))
    expected = {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0, 4: 1.0, 50: 1.0, 99: 1.0}
    for step, scale in expected.items():
        main = learner.set_lr(step, 100)
        assert main == pytest.approx(1e-3 * scale, rel=1e-12), step
        assert _rates(learner) == pytest.approx([1e-3 * scale, 1e-2 * scale], rel=1e-12), step


def test_linear_decay_to_zero_at_total():
    learner = _two_group_learner(Schedule(decay="linear"))
    for step, scale in {0: 1.0, 1: 0.9, 5: 0.5, 9: 0.1, 10: 0.0, 12: 0.0}.items():
        learner.set_lr(step, 10)
        assert _rates(learner) == pytest.approx([1e-3 * scale, 1e-2 * scale], abs=1e-15), step


def test_warmup_then_linear_decay():
    learner = _two_group_learner(Schedule(warmup=2, decay="linear"))
    # warm-up (step + 1) / 2, then 1 - step / total
    for step, scale in {0: 0.5, 1: 1.0, 2: 0.8, 5: 0.5, 10: 0.0}.items():
        learner.set_lr(step, 10)
        assert _rates(learner) == pytest.approx([1e-3 * scale, 1e-2 * scale], abs=1e-15), step


def test_constant_schedule():
    learner = _two_group_learner(Schedule())
    for step in (0, 3, 10, 1000):
        assert learner.set_lr(step, 10) == 1e-3
        assert _rates(learner) == [1e-3, 1e-2]


def test_critic_warmup_trains_only_the_value_head():
    learner = _two_group_learner(Schedule(critic_warmup=3))
    model = learner.module
    for step in range(5):
        assert learner.set_lr(step, 10) == (0.0 if step < 3 else 1e-3), step
        assert _rates(learner) == [0.0 if step < 3 else 1e-3, 1e-2], step
    # a step during the critic warm-up changes the value head alone
    learner.set_lr(0, 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner.zero_grad()
    learner.backward((model.policy(X).sum() + model.value_head(X).sum()) ** 2)
    learner.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == name.startswith("value_head"), name


def test_critic_warmup_with_warmup():
    learner = _two_group_learner(Schedule(warmup=4, critic_warmup=2))
    for step, (main, second) in {0: (0.0, 0.25), 1: (0.0, 0.5), 2: (0.75, 0.75)}.items():
        learner.set_lr(step, 10)
        assert _rates(learner) == pytest.approx([1e-3 * main, 1e-2 * second], abs=1e-15)


# ------------------------------------------------------------------ the value head's own rate
def test_second_group_has_its_own_learning_rate():
    model = _PolicyAndValue()
    model.frozen = nn.Linear(3, 1).double().requires_grad_(False)
    frozen = model.frozen.weight.detach().clone()
    lr, lr2 = 1e-3, 3e-2
    learner = Learner(
        model, lr, second_group=(lambda n: n.startswith("value_head"), lr2), max_grad_norm=0.0
    )
    groups = learner.optimizer.param_groups
    assert len(groups) == 2
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in model.policy.parameters()}
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in model.value_head.parameters()}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner.zero_grad()
    h = model.policy(X)
    learner.backward((h**2).sum() + (model.value_head(X) * h.sum(1, keepdim=True)).sum())
    learner.step()
    # first AdamW step, no weight decay: each entry moves by lr * g / (|g| + eps) ~ lr * sign(g)
    for name, p in model.named_parameters():
        if name.startswith("frozen"):
            continue
        assert p.grad.abs().min() > 1e-3, name  # no entry near 0: the sign is clear
        rate = lr2 if name.startswith("value_head") else lr
        torch.testing.assert_close(
            p.detach() - before[name], -rate * p.grad.sign(), rtol=1e-4, atol=0.0
        )
    assert torch.equal(model.frozen.weight, frozen)


# ------------------------------------------------------------------ non-finite updates
def test_a_non_finite_loss_with_finite_gradients_is_skipped_and_counted():
    # a loss that masks or clamps its NaN (normalised targets of NaN statistics) can leave
    # finite gradients: the loss decides too
    model = _PolicyAndValue()
    learner = Learner(model, LR, betas=BETAS, weight_decay=WD, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    learner.zero_grad()
    learner.backward(model.policy(X).pow(2).sum())
    assert not math.isfinite(learner.step(loss_finite=False))
    assert learner.nan_streak == 1
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_non_finite_gradient_is_skipped_and_counted():
    model = _PolicyAndValue()
    learner = Learner(model, LR, betas=BETAS, weight_decay=WD, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]

    for i, bad in enumerate([float("nan"), float("inf"), float("nan")], start=1):
        learner.zero_grad()
        learner.backward(model.policy(X).sum() * bad + model.value_head(X).sum())
        norm = learner.step()
        assert not math.isfinite(norm)
        assert learner.nan_streak == i
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, b)
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())

    # a finite step resets the streak and is the first step of a fresh AdamW (the skipped
    # ones left no optimizer state behind)
    reference = _PolicyAndValue()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    (reference.policy(X).pow(2).sum() + reference.value_head(X).sum()).backward()
    learner.zero_grad()
    learner.backward(model.policy(X).pow(2).sum() + model.value_head(X).sum())
    norm = learner.step()
    assert math.isfinite(norm) and learner.nan_streak == 0
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank():
    def update(rank, collective):
        model = _PolicyAndValue()
        learner = Learner(model, LR, max_grad_norm=1.0)
        learner.join_data_parallel(collective)
        learner.zero_grad()
        bad = float("nan") if rank == 0 else 1.0
        learner.backward(model.policy(X).sum() * bad)
        learner.step()
        return learner.nan_streak, [p.detach().clone() for p in model.parameters()]

    fresh = [p.detach() for p in _PolicyAndValue().parameters()]
    for streak, params in _run_ranks(2, update):
        assert streak == 1
        for p, q in zip(params, fresh, strict=True):
            assert torch.equal(p, q)


# ------------------------------------------------------------------ checkpoints
def test_state_dict_round_trip_keeps_adam_state_and_resets_the_configured_rates():
    pred = (lambda n: n.startswith("value_head"), 1e-2)
    model = _PolicyAndValue()
    saved = Learner(model, 1e-3, second_group=pred, weight_decay=0.01, schedule=Schedule(warmup=5))
    for step in range(3):  # rates of the warm-up in the groups when saved
        saved.set_lr(step, 10)
        saved.zero_grad()
        saved.backward((model.policy(X) ** 2).sum() + model.value_head(X).pow(3).sum())
        saved.step()
    saved.nan_streak = 2
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    torch_state = copy.deepcopy(saved.optimizer.state_dict())

    # resume with other rates and weight decay
    resumed_model = copy.deepcopy(model)
    resumed = Learner(
        resumed_model, 5e-4, second_group=(pred[0], 2e-3), weight_decay=0.05, max_grad_norm=0.0
    )
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert resumed.nan_streak == 2
    groups = resumed.optimizer.param_groups
    assert [g["lr"] for g in groups] == [5e-4, 2e-3]
    assert [g.get("base_lr") for g in groups] == [5e-4, 2e-3]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.05]
    assert resumed.set_lr(9, 10) == 5e-4  # the schedule starts from the configured rates
    # the Adam moments and step counts of every parameter came back
    state = resumed.optimizer.state_dict()["state"]
    assert state.keys() == torch_state["state"].keys() and len(state) == 4
    for k, entry in torch_state["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(state[k][name]), torch.as_tensor(entry[name]))
    assert float(torch_state["state"][0]["step"]) == 3

    # the next step is that of a plain AdamW resumed from the same state at the new rates
    reference_model = copy.deepcopy(model)
    reference = torch.optim.AdamW(
        [
            {"params": list(reference_model.policy.parameters()), "lr": 5e-4},
            {"params": list(reference_model.value_head.parameters()), "lr": 2e-3},
        ],
        weight_decay=0.05,
    )
    reference.load_state_dict(torch_state)
    for group, lr in zip(reference.param_groups, (5e-4, 2e-3), strict=True):
        group["lr"], group["weight_decay"] = lr, 0.05
    for m in (resumed_model, reference_model):
        for p in m.parameters():
            p.grad = None
        ((m.policy(X) ** 2).sum() + m.value_head(X).pow(3).sum()).backward()
    resumed.step()
    reference.step()
    for p, q in zip(resumed_model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_load_without_the_optimizer_keeps_a_fresh_one():
    model = _PolicyAndValue()
    saved = Learner(model, 1e-3)
    saved.zero_grad()
    saved.backward(model.policy(X).sum())
    saved.step()
    saved.nan_streak = 1
    fresh = Learner(copy.deepcopy(model), 2e-3, weight_decay=0.2)
    fresh.load_state_dict(saved.state_dict(), load_optimizer=False)
    assert fresh.optimizer.state_dict()["state"] == {}
    assert fresh.nan_streak == 1
    assert fresh.optimizer.param_groups[0]["lr"] == 2e-3
    assert fresh.optimizer.param_groups[0]["weight_decay"] == 0.2


def test_extra_group_follows_the_policy_schedule():
    """An extra group (e.g. the log-std) has its own rate and, like the main group, rate 0
    during the critic warm-up; a resume restores the configured rates of all three."""
    model = _PolicyAndValue()
    learner = Learner(
        model, 1e-3, second_group=(lambda n: n.startswith("value_head"), 1e-2),
        extra_groups=[(lambda n: n == "policy.bias", 5e-2)],
        schedule=Schedule(warmup=2, critic_warmup=1),
    )  # fmt: skip
    groups = learner.optimizer.param_groups
    assert [len(g["params"]) for g in groups][1:] == [len(list(model.value_head.parameters())), 1]
    assert groups[2]["params"] == [model.policy.bias]
    learner.set_lr(0, 10)
    assert _rates(learner) == pytest.approx([0.0, 0.5e-2, 0.0], abs=1e-15)
    learner.set_lr(1, 10)
    assert _rates(learner) == pytest.approx([1e-3, 1e-2, 5e-2], abs=1e-15)
    state = learner.state_dict()
    learner.load_state_dict(state)
    assert _rates(learner) == pytest.approx([1e-3, 1e-2, 5e-2], abs=1e-15)

"""Losses: PPO clip at the boundaries, the gradient at ratio 1, value clipping, KL estimators and
aggregation on ragged masks, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlinf_vla.algos import (
    aggregate,
    entropy_loss,
    kl_divergence,
    kl_loss,
    metrics_to_floats,
    policy_loss,
    ppo_policy_loss,
    value_loss,
)


def one_token_ppo(ratio: float, advantage: float, **kwargs):
    """PPO loss and d loss / d logprob for one token whose ratio is ``ratio``."""
    logprob = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, metrics = ppo_policy_loss(
        logprob=logprob,
        old_logprob=torch.zeros(1, dtype=torch.float64),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        mask=torch.ones(1, dtype=torch.bool),
        **kwargs,
    )
    loss.backward()
    return loss.item(), logprob.grad.item(), metrics_to_floats(metrics)


# ε = 0.2. L = max(-A r, -A clip(r, .8, 1.2)); d L / d log r = -A r where the unclipped term is
# the larger one, else 0.
#   ratio  A    loss                        grad      clipped
@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped"),
    [
        (1.0, 1.0, -1.0, -1.0, 0.0),  # at 1, never clipped
        (1.1, 1.0, -1.1, -1.1, 0.0),  # inside the range
        (1.5, 1.0, -1.2, 0.0, 1.0),  # above, A > 0: clipped at 1.2, no gradient
        (0.5, 1.0, -0.5, -0.5, 0.0),  # below, A > 0: pessimistic unclipped term kept
        (1.1, -1.0, 1.1, 1.1, 0.0),  # inside, A < 0
        (1.5, -1.0, 1.5, 1.5, 0.0),  # above, A < 0: unclipped term kept (no dual clip)
        (0.5, -1.0, 0.8, 0.0, 1.0),  # below, A < 0: clipped at 0.8, no gradient
        (0.5, -2.0, 1.6, 0.0, 1.0),  # |A| scales the loss
        (1.0, 0.0, 0.0, 0.0, 0.0),  # zero advantage
    ],
)
def test_ppo_clip_boundaries(ratio, advantage, loss, grad, clipped):
    got_loss, got_grad, metrics = one_token_ppo(ratio, advantage, clip_low=0.2)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)
    assert metrics["clip_fraction"] == clipped
    assert metrics["ratio_mean"] == pytest.approx(ratio)


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped"),
    [
        (1.25, 1.0, -1.25, -1.25, 0.0),  # inside 1 + .28 (clipped under symmetric .2)
        (1.3, 1.0, -1.28, 0.0, 1.0),  # above 1 + .28
        (0.75, -1.0, 0.8, 0.0, 1.0),  # below 1 - .2
        (0.85, -1.0, 0.85, 0.85, 0.0),  # inside
    ],
)
def test_ppo_clip_higher(ratio, advantage, loss, grad, clipped):
    got_loss, got_grad, metrics = one_token_ppo(ratio, advantage, clip_low=0.2, clip_high=0.28)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)
    assert metrics["clip_fraction"] == clipped


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "dual"),
    [
        (5.0, -1.0, 3.0, 0.0, 1.0),  # A < 0, |A| r = 5 > c|A| = 3: capped at 3, no gradient
        (5.0, -2.0, 6.0, 0.0, 1.0),  # cap scales with |A|
        (2.0, -1.0, 2.0, 2.0, 0.0),  # below the cap: plain PPO
        (5.0, 1.0, -1.2, 0.0, 0.0),  # A > 0: dual clip does not apply
        (0.5, -1.0, 0.8, 0.0, 0.0),  # A < 0 below the range: ordinary clip
    ],
)
def test_ppo_dual_clip(ratio, advantage, loss, grad, dual):
    got_loss, got_grad, metrics = one_token_ppo(ratio, advantage, clip_low=0.2, dual_clip=3.0)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)
    assert metrics["dual_clip_fraction"] == dual


def test_ppo_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        one_token_ppo(1.0, 1.0, dual_clip=0.9)


@pytest.mark.parametrize("kwargs", [{}, {"clip_high": 0.28}, {"dual_clip": 3.0}])
def test_ppo_gradient_at_ratio_one_is_minus_advantage_times_grad_logprob(kwargs):
    # A small softmax policy over 5 actions, 6 samples: logprob_i = log_softmax(W x_i)[a_i].
    torch.manual_seed(0)
    W = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 3, dtype=torch.float64)
    a = torch.tensor([0, 1, 2, 3, 4, 0])
    A = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.1, 0.0], dtype=torch.float64)

    def logprob():
        return torch.log_softmax(x @ W.T, dim=-1)[torch.arange(6), a]

    lp = logprob()
    loss, _ = policy_loss(
        "ppo",
        logprob=lp,
        old_logprob=lp.detach(),
        advantages=A,
        mask=torch.ones(6, dtype=torch.bool),
        **kwargs,
    )
    (grad_loss,) = torch.autograd.grad(loss, W)
    # Expected: -1/N Σ_i A_i ∇ log π(a_i|x_i)   (the vanilla policy gradient)
    (grad_pg,) = torch.autograd.grad(-(A * logprob()).sum() / 6, W)
    torch.testing.assert_close(grad_loss, grad_pg)


def test_ppo_metrics_are_masked_and_detached():
    # Tokens with ratios [e^.1, 1, 5(masked)]: approx_kl = mean of (r - 1 - log r) over the 2
    # valid tokens = (e^.1 - 1 - .1 + 0) / 2 = .0025854
    logprob = torch.tensor([[0.1, 0.0, math.log(5.0)]], requires_grad=True)
    loss, metrics = ppo_policy_loss(
        logprob=logprob,
        old_logprob=torch.zeros(1, 3),
        advantages=torch.ones(1, 3),
        mask=torch.tensor([[True, True, False]]),
    )
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    m = metrics_to_floats(metrics)
    assert m["approx_kl"] == pytest.approx((math.exp(0.1) - 1.1) / 2, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-6)
    assert m["ratio_min"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0
    assert loss.item() == pytest.approx(-(math.exp(0.1) + 1.0) / 2, rel=1e-6)


def test_ppo_rejects_unbroadcast_advantages():
    with pytest.raises(ValueError, match="broadcast_to_logprob"):
        ppo_policy_loss(
            logprob=torch.zeros(2, 3),
            old_logprob=torch.zeros(2, 3),
            advantages=torch.zeros(2),
            mask=torch.ones(2, 3),
        )


# ------------------------------------------------------------------------------------------
# Aggregation on ragged masks
# ------------------------------------------------------------------------------------------

LOSS_3x3 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK_3x3 = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 4 valid tokens
        ("seq-mean-token-sum", (6 + 4) / 2),  # 2 sequences with tokens; the empty one skipped
        ("seq-mean-token-mean", (2 + 4) / 2),  # per-sequence means 2 and 4
    ],
)
def test_aggregation_on_ragged_mask(mode, expected):
    assert aggregate(LOSS_3x3, MASK_3x3, mode).item() == pytest.approx(expected)
    # The same batch as [N, K, A] = [3, 3, 1] tokens: trailing dims are all tokens.
    assert aggregate(LOSS_3x3[..., None], MASK_3x3[..., None], mode).item() == pytest.approx(
        expected
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_edge_cases(mode):
    # [N] (one entry per chunk): every mode is the masked mean: (1 + 3) / 2
    per_chunk = torch.tensor([1.0, 2.0, 3.0])
    assert aggregate(per_chunk, torch.tensor([True, False, True]), mode).item() == 2.0
    # An empty mask gives 0, not NaN.
    assert aggregate(LOSS_3x3, torch.zeros(3, 3, dtype=torch.bool), mode).item() == 0.0


def test_aggregation_unknown_mode_lists_known():
    with pytest.raises(KeyError, match="seq-mean-token-mean, seq-mean-token-sum, token-mean"):
        aggregate(LOSS_3x3, MASK_3x3, "seq-mean")


def test_ppo_seq_mean_token_mean_weights_sequences_equally():
    # Ratio 1 everywhere: per-token loss = -A. Seq 0 has 3 tokens with A = 1, seq 1 one token
    # with A = -1 (two masked). token-mean: -(3 - 1)/4 = -.5; seq-mean-token-mean: -(1 - 1)/2 = 0
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    kw = {
        "logprob": torch.zeros(2, 3),
        "old_logprob": torch.zeros(2, 3),
        "advantages": adv,
        "mask": mask,
    }
    assert ppo_policy_loss(**kw, agg="token-mean")[0].item() == pytest.approx(-0.5)
    assert ppo_policy_loss(**kw, agg="seq-mean-token-mean")[0].item() == pytest.approx(0.0)
    assert ppo_policy_loss(**kw, agg="seq-mean-token-sum")[0].item() == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------------
# Value loss
# ------------------------------------------------------------------------------------------


def test_value_loss_clipping_by_hand():
    # V = [1, 2], V_old = [0, 2], G = [3, 0], ε_v = .5
    # entry 0: unclipped .5 (1-3)² = 2; V_clip = 0 + clip(1, -.5, .5) = .5, .5 (.5-3)² = 3.125
    #          -> 3.125, and no gradient through V (the clipped term is the larger one)
    # entry 1: unclipped .5 (2-0)² = 2; V_clip = 2 -> 2; gradient (V - G)/N = 2/2 = 1
    values = torch.tensor([1.0, 2.0], requires_grad=True)
    loss, metrics = value_loss(
        values=values,
        old_values=torch.tensor([0.0, 2.0]),
        returns=torch.tensor([3.0, 0.0]),
        mask=torch.ones(2, dtype=torch.bool),
        clip=0.5,
    )
    assert loss.item() == pytest.approx((3.125 + 2.0) / 2)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([0.0, 1.0]))
    assert metrics["value_clip_fraction"].item() == 0.5

    # Without clipping: (2 + 2) / 2
    loss, _ = value_loss(
        values=values,
        old_values=torch.tensor([0.0, 2.0]),
        returns=torch.tensor([3.0, 0.0]),
        mask=torch.ones(2, dtype=torch.bool),
    )
    assert loss.item() == pytest.approx(2.0)


def test_value_loss_huber_by_hand():
    # δ = 1: Huber(e) = .5 e² if |e| <= 1 else |e| - .5
    # entry 0: e = -2 -> 1.5; clipped e = -2.5 -> 2.0; max 2.0
    # entry 1: e = 2 -> 1.5; entry 2: e = .5 -> .125 (masked out)
    loss, _ = value_loss(
        values=torch.tensor([1.0, 2.0, 0.5]),
        old_values=torch.tensor([0.0, 2.0, 0.5]),
        returns=torch.tensor([3.0, 0.0, 0.0]),
        mask=torch.tensor([True, True, False]),
        clip=0.5,
        huber_delta=1.0,
    )
    assert loss.item() == pytest.approx((2.0 + 1.5) / 2)


def test_value_loss_explained_variance():
    returns = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.ones(3, dtype=torch.bool)
    _, perfect = value_loss(values=returns, old_values=returns, returns=returns, mask=mask)
    _, zero = value_loss(values=returns, old_values=torch.zeros(3), returns=returns, mask=mask)
    # Var(G - V_old): perfect 0 -> 1; V_old = 0: Var(G)/Var(G) -> 0
    assert perfect["explained_variance"].item() == pytest.approx(1.0)
    assert zero["explained_variance"].item() == pytest.approx(0.0)
    _, const = value_loss(values=returns, old_values=returns, returns=torch.ones(3), mask=mask)
    assert math.isnan(const["explained_variance"].item())


# ------------------------------------------------------------------------------------------
# Entropy and KL
# ------------------------------------------------------------------------------------------


def test_entropy_bonus_is_negative_mean_entropy():
    entropy = torch.tensor([[1.0, 3.0], [5.0, 7.0]], requires_grad=True)
    loss, metrics = entropy_loss(entropy=entropy, mask=torch.tensor([[1, 1], [1, 0]]).bool())
    assert loss.item() == pytest.approx(-3.0)  # -(1 + 3 + 5) / 3
    assert metrics["entropy"].item() == pytest.approx(3.0)
    loss.backward()  # minimising the loss raises every valid entropy
    torch.testing.assert_close(entropy.grad, torch.tensor([[-1 / 3, -1 / 3], [-1 / 3, 0.0]]))


def test_kl_estimators_by_hand():
    # π_θ(a) = .5, π_ref(a) = .25: log r = log 2, ρ = π_ref / π_θ = .5
    #   k1 = log 2 = .693147, k2 = .5 (log 2)² = .240227, k3 = (.5 - 1) - log .5 = .193147
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    assert kl_divergence(lp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_divergence(lp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_divergence(lp, ref, "k3").item() == pytest.approx(-0.5 + ln2)
    loss, metrics = kl_loss(logprob=lp, ref_logprob=ref, mask=torch.ones(1), estimator="k3")
    assert loss.item() == pytest.approx(-0.5 + ln2)
    assert metrics["kl"].item() == pytest.approx(-0.5 + ln2)


def test_kl_estimators_k1_k3_are_unbiased():
    # Exact KL(p || q) of two 3-way categoricals vs the mean estimate over samples of p.
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist(), strict=True))
    gen = torch.Generator().manual_seed(0)
    a = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    for name in ("k1", "k3"):
        est = kl_divergence(p.log()[a], q.log()[a], name).mean().item()
        assert est == pytest.approx(exact, abs=0.01), name


def test_ppo_metrics_with_empty_mask():
    logprob = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = ppo_policy_loss(
        logprob=logprob,
        old_logprob=torch.zeros(2, 3),
        advantages=torch.ones(2, 3),
        mask=torch.zeros(2, 3, dtype=torch.bool),
    )
    assert loss.item() == 0.0
    m = metrics_to_floats(metrics)
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_fraction"] == 0.0

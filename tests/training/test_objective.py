"""``objective``'s terms against numbers worked out by hand on 2-4 element examples: the PPO
clip (asymmetric), the dual clip, value clipping, the entropy bonus and the KL estimators,
each divided by the minibatch-wide count of ``Counts``."""

import math

import pytest
import torch

from rlinf_vla.training.objective import Counts, LossSettings, objective


def _leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _zeros_policy(n: int) -> dict:
    """A policy term that is 0 with no gradient: zero advantages."""
    z = torch.zeros(n, dtype=torch.float64)
    return {
        "old_logprob": z.clone(),
        "advantages": z.clone(),
        "mask": torch.ones(n, dtype=torch.bool),
    }


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_clip_high_low_and_dual_clip(dual_clip):
    # log-ratios: r = e^2, 0.5, 1.5, 0.9
    old = torch.zeros(4, dtype=torch.float64)
    logprob = _leaf([2.0, math.log(0.5), math.log(1.5), math.log(0.9)])
    adv = torch.tensor([-1.0, -1.0, 2.0, 1.0], dtype=torch.float64)
    s = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    loss, _ = objective(
        s, Counts(policy=4), logprob=logprob, old_logprob=old, advantages=adv,
        mask=torch.ones(4, dtype=torch.bool),
    )  # fmt: skip
    e2 = math.exp(2.0)
    # e0: A<0, r=e^2 -> max(e^2, 1.28) = e^2, dual-clipped to 3 |A| = 3 (constant)
    # e1: A<0, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped below, constant)
    # e2: A>0, r=1.5 -> max(-3, -2 * 1.28) = -2.56 (clipped above, constant)
    # e3: A>0, r=0.9 -> -0.9, inside the clip: d/dlogprob = -A r = -0.9
    first = 3.0 if dual_clip else e2
    expected = (first + 0.8 - 2.56 - 0.9) / 4
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    loss.backward()
    grad0 = 0.0 if dual_clip else e2 / 4  # -A r / 4
    torch.testing.assert_close(
        logprob.grad, torch.tensor([grad0, 0.0, 0.0, -0.9 / 4], dtype=torch.float64)
    )


def test_policy_loss_divides_by_the_global_count_and_ignores_masked_entries():
    old = torch.zeros(3, dtype=torch.float64)
    logprob = _leaf([math.log(1.1), math.log(1.05), 5.0])
    adv = torch.tensor([1.0, -2.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    loss, _ = objective(
        LossSettings(), Counts(policy=8), logprob=logprob, old_logprob=old, advantages=adv,
        mask=mask,
    )  # fmt: skip
    assert float(loss.detach()) == pytest.approx((-1.1 + 2 * 1.05) / 8, rel=1e-12)


def test_value_loss_with_clipping():
    values = _leaf([1.0, 2.0, 0.0, 50.0])
    old = torch.tensor([0.5, 2.5, 0.1, 0.0], dtype=torch.float64)
    returns = torch.tensor([2.0, 1.0, 0.3, 0.0], dtype=torch.float64)
    vmask = torch.tensor([True, True, True, False])
    s = LossSettings(value_coef=0.5, value_clip=0.2)
    loss, _ = objective(
        s, Counts(policy=2, value=3), logprob=_leaf([0.0, 0.0]), **_zeros_policy(2),
        values=values, old_values=old, returns=returns, value_mask=vmask,
    )  # fmt: skip
    # e0: 0.5 (1-2)^2 = 0.5 vs clipped V = 0.7: 0.5 (0.7-2)^2 = 0.845 -> 0.845, no gradient
    # e1: 0.5 (2-1)^2 = 0.5 vs clipped V = 2.3: 0.5 (1.3)^2 = 0.845 -> 0.845, no gradient
    # e2: inside the clip: 0.5 (0-0.3)^2 = 0.045, gradient V - G = -0.3
    expected = 0.5 * (0.845 + 0.845 + 0.045) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(
        values.grad, torch.tensor([0.0, 0.0, 0.5 * -0.3 / 3, 0.0], dtype=torch.float64)
    )

    # without clipping: the plain squared error
    values2 = _leaf([1.0, 2.0, 0.0, 50.0])
    loss2, _ = objective(
        LossSettings(value_coef=0.5), Counts(policy=2, value=6), logprob=_leaf([0.0, 0.0]),
        **_zeros_policy(2), values=values2, old_values=old, returns=returns, value_mask=vmask,
    )  # fmt: skip
    assert float(loss2.detach()) == pytest.approx(0.5 * (0.5 + 0.5 + 0.045) / 6, rel=1e-12)


@pytest.mark.parametrize(
    ("agg", "expected_mean"),
    [
        ("token-mean", (1.0 + 3.0 + 2.0) / 3),
        ("seq-mean-token-mean", ((1.0 + 3.0) / 2 + 2.0) / 2),
        ("seq-mean-token-sum", ((1.0 + 3.0) + 2.0) / 2),
    ],
)
def test_entropy_bonus(agg, expected_mean):
    entropy = _leaf([[1.0, 3.0], [2.0, 40.0]])
    mask = torch.tensor([[True, True], [True, False]])
    zeros = torch.zeros(2, 2, dtype=torch.float64)
    count = 3 if agg == "token-mean" else 2
    loss, metrics = objective(
        LossSettings(agg=agg, entropy_coef=0.01), Counts(policy=count, tokens=3),
        logprob=_leaf([[0.0, 0.0], [0.0, 0.0]]), old_logprob=zeros, advantages=zeros,
        mask=mask, entropy=entropy,
    )  # fmt: skip
    assert float(loss.detach()) == pytest.approx(-0.01 * expected_mean, rel=1e-12)
    assert metrics["entropy"] == pytest.approx(2.0, rel=1e-12)  # masked mean of H
    loss.backward()
    per_token = {
        "token-mean": [[1 / 3, 1 / 3], [1 / 3, 0.0]],
        "seq-mean-token-mean": [[1 / 4, 1 / 4], [1 / 2, 0.0]],
        "seq-mean-token-sum": [[1 / 2, 1 / 2], [1 / 2, 0.0]],
    }[agg]
    torch.testing.assert_close(entropy.grad, -0.01 * torch.tensor(per_token, dtype=torch.float64))


def test_entropy_coef_zero_adds_nothing():
    entropy = _leaf([1.0, 2.0])
    loss, _ = objective(
        LossSettings(), Counts(policy=2), logprob=_leaf([0.0, 0.0]), **_zeros_policy(2),
        entropy=entropy,
    )  # fmt: skip
    assert float(loss.detach()) == 0.0


@pytest.mark.parametrize(
    ("estimator", "per_entry", "derivative"),
    [
        # log_ratio d = logprob - ref = [0.5, -1.0]
        ("k1", [0.5, -1.0], [1.0, 1.0]),
        ("k2", [0.5 * 0.25, 0.5 * 1.0], [0.5, -1.0]),
        # k3 = e^-d - 1 + d, d/dd = 1 - e^-d
        (
            "k3",
            [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0],
            [1 - math.exp(-0.5), 1 - math.exp(1.0)],
        ),
    ],
)
def test_kl_term(estimator, per_entry, derivative):
    logprob = _leaf([-1.0, -2.0, 0.0])
    ref = torch.tensor([-1.5, -1.0, -30.0], dtype=torch.float64)
    s = LossSettings(kl_coef=0.1, kl_estimator=estimator)
    z = torch.zeros(3, dtype=torch.float64)
    loss, metrics = objective(
        s, Counts(policy=2), logprob=logprob, old_logprob=logprob.detach().clone(),
        advantages=z, mask=torch.tensor([True, True, False]), ref_logprob=ref,
    )  # fmt: skip
    assert float(loss.detach()) == pytest.approx(0.1 * sum(per_entry) / 2, rel=1e-12)
    assert metrics["kl"] == pytest.approx(sum(per_entry) / 2, rel=1e-12)
    loss.backward()
    expected = torch.tensor([0.1 * d / 2 for d in derivative] + [0.0], dtype=torch.float64)
    torch.testing.assert_close(logprob.grad, expected)


def test_all_terms_add_up():
    """policy + value_coef * value - entropy_coef * entropy + kl_coef * kl, by hand."""
    logprob = _leaf([math.log(1.5), math.log(0.5)])
    old = torch.zeros(2, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    ref = torch.tensor([0.0, 0.0], dtype=torch.float64)
    s = LossSettings(value_coef=0.5, entropy_coef=0.01, kl_coef=0.1, kl_estimator="k2")
    loss, _ = objective(
        s, Counts(policy=2, value=2), logprob=logprob, old_logprob=old, advantages=adv,
        mask=torch.ones(2, dtype=torch.bool), entropy=_leaf([1.0, 2.0]),
        values=_leaf([1.0, 0.0]), old_values=torch.zeros(2, dtype=torch.float64),
        returns=torch.tensor([0.0, 2.0], dtype=torch.float64), ref_logprob=ref,
    )  # fmt: skip
    policy = (max(-1.5, -1.2) + max(-0.5, -0.8)) / 2  # (-1.2 - 0.5) / 2
    value = (0.5 * 1.0 + 0.5 * 4.0) / 2
    entropy = (1.0 + 2.0) / 2
    kl = (0.5 * math.log(1.5) ** 2 + 0.5 * math.log(0.5) ** 2) / 2
    expected = policy + 0.5 * value - 0.01 * entropy + 0.1 * kl
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)


def test_merge_ranks_adds_the_shares_and_averages_the_rest():
    from rlinf_vla.training.objective import merge_ranks

    per_rank = [
        {"train/policy_loss": 0.25, "train/lr": 1e-3, "train/nan_streak": 0.0, "train/n": 3.0},
        {"train/lr": 1e-3, "train/nan_streak": 2.0, "train/n": 5.0},  # no sample in the loss
    ]
    out = merge_ranks(per_rank, summed=("train/n",), maxed=("train/nan_streak",))
    assert out == {
        "train/policy_loss": 0.25,  # a share of the minibatch's loss: 0.25 + nothing
        "train/lr": 1e-3,
        "train/nan_streak": 2.0,
        "train/n": 8.0,
    }

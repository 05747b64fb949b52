"""Advantage estimators against plain-Python loops and numbers worked out by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlinf_vla.algos import compute_advantages, gae, grpo, reinforce_pp, rloo


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


# ------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------


def gae_reference(rewards, values, terminated, truncated, final_values, gamma, lam):
    """GAE as the forward sum A_t = Σ_l (γλ)^l δ_{t+l} over the rest of the episode, one env at
    a time, on Python lists (the opposite direction to the code's backward recursion)."""
    T, B = len(rewards), len(rewards[0])
    adv = [[0.0] * B for _ in range(T)]
    for b in range(B):
        deltas, ends = [], []
        for t in range(T):
            if terminated[t][b]:
                next_value, end = 0.0, True
            elif truncated[t][b]:
                next_value = final_values[t][b] if final_values is not None else 0.0
                end = True
            else:
                next_value, end = values[t + 1][b], False
            deltas.append(rewards[t][b] + gamma * next_value - values[t][b])
            ends.append(end)
        for t in range(T):
            total, weight = 0.0, 1.0
            for u in range(t, T):
                total += weight * deltas[u]
                if ends[u]:
                    break
                weight *= gamma * lam
            adv[t][b] = total
    returns = [[adv[t][b] + values[t][b] for b in range(B)] for t in range(T)]
    return adv, returns


def test_gae_hand_cases():
    # γ = λ = 0.5, so γλ = 0.25. One env per column, T = 3:
    #   rewards = [1, 2, 3], values = [0.5, 1, 2, 4] (values[3] bootstraps the last step).
    # col 0, no episode end:
    #   δ = [1 + .5*1 - .5, 2 + .5*2 - 1, 3 + .5*4 - 2] = [1, 2, 3]
    #   A2 = 3, A1 = 2 + .25*3 = 2.75, A0 = 1 + .25*2.75 = 1.6875
    # col 1, terminated at t=1: δ1 = 2 + 0 - 1 = 1, A1 = 1 (no carry), A0 = 1 + .25*1 = 1.25,
    #   A2 = 3 (t=2 starts a new episode, bootstraps from values[3]).
    # col 2, truncated at t=1 with final value 6: δ1 = 2 + .5*6 - 1 = 4, A1 = 4, A0 = 2, A2 = 3.
    # col 3, terminated and truncated at t=1 (final value 6 ignored): termination wins, as col 1.
    # col 4, truncated at the last step t=2 with final value 8, read instead of values[3] = 4:
    #   δ2 = 3 + .5*8 - 2 = 5, A2 = 5, A1 = 2 + .25*5 = 3.25, A0 = 1 + .25*3.25 = 1.8125.
    B = 5
    rewards = torch.tensor([[1.0] * B, [2.0] * B, [3.0] * B])
    values = torch.tensor([[0.5] * B, [1.0] * B, [2.0] * B, [4.0] * B])
    terminated = torch.zeros(3, B, dtype=torch.bool)
    truncated = torch.zeros(3, B, dtype=torch.bool)
    final_values = torch.zeros(3, B)
    terminated[1, 1] = True
    truncated[1, 2] = True
    final_values[1, 2] = 6.0
    terminated[1, 3] = truncated[1, 3] = True
    final_values[1, 3] = 6.0
    truncated[2, 4] = True
    final_values[2, 4] = 8.0

    adv, ret = gae(
        rewards=rewards,
        values=values,
        terminated=terminated,
        truncated=truncated,
        final_values=final_values,
        gamma=0.5,
        lam=0.5,
    )
    expected = [
        [1.6875, 1.25, 2.0, 1.25, 1.8125],
        [2.75, 1.0, 4.0, 1.0, 3.25],
        [3.0, 3.0, 3.0, 3.0, 5.0],
    ]
    close(adv, expected)
    # returns = A + V(s_t), V = .5, 1, 2 on the three rows
    close(
        ret,
        [
            [2.1875, 1.75, 2.5, 1.75, 2.3125],
            [3.75, 2.0, 5.0, 2.0, 4.25],
            [5.0, 5.0, 5.0, 5.0, 7.0],
        ],
    )


def test_gae_truncation_without_final_values_bootstraps_from_zero():
    # Same as column 2 above without final_values: δ1 = 2 + 0 - 1 = 1 -> as a termination.
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [1.0], [2.0], [4.0]])
    truncated = torch.tensor([[False], [True], [False]])
    adv, _ = gae(
        rewards=rewards,
        values=values,
        terminated=torch.zeros_like(truncated),
        truncated=truncated,
        gamma=0.5,
        lam=0.5,
    )
    close(adv, [[1.25], [1.0], [3.0]])


def test_gae_lambda_one_gives_discounted_return_minus_value():
    # λ = 1, no episode end: A_0 = Σ γ^t r_t + γ^T V_T - V_0 = 1 + .9*1 + .81*1 + .729*10 - 2
    rewards = torch.ones(3, 1)
    values = torch.tensor([[2.0], [0.0], [0.0], [10.0]])
    done = torch.zeros(3, 1, dtype=torch.bool)
    adv, ret = gae(
        rewards=rewards, values=values, terminated=done, truncated=done, gamma=0.9, lam=1.0
    )
    close(adv[0], [1 + 0.9 + 0.81 + 7.29 - 2.0])
    close(ret[0], [1 + 0.9 + 0.81 + 7.29])


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_loop_with_resets_at_different_steps(seed):
    rng = random.Random(seed)
    T, B = 9, 6
    rewards = [[rng.uniform(-1, 1) for _ in range(B)] for _ in range(T)]
    values = [[rng.uniform(-2, 2) for _ in range(B)] for _ in range(T + 1)]
    terminated = [[rng.random() < 0.15 for _ in range(B)] for _ in range(T)]
    truncated = [[rng.random() < 0.15 for _ in range(B)] for _ in range(T)]
    final_values = [[rng.uniform(-2, 2) for _ in range(B)] for _ in range(T)]
    for use_final in (True, False):
        fv = final_values if use_final else None
        exp_adv, exp_ret = gae_reference(rewards, values, terminated, truncated, fv, 0.97, 0.9)
        adv, ret = compute_advantages(
            "gae",
            rewards=torch.tensor(rewards, dtype=torch.float64),
            values=torch.tensor(values, dtype=torch.float64),
            terminated=torch.tensor(terminated),
            truncated=torch.tensor(truncated),
            final_values=None if fv is None else torch.tensor(fv, dtype=torch.float64),
            gamma=0.97,
            lam=0.9,
        )
        close(adv, exp_adv, atol=1e-10)
        close(ret, exp_ret, atol=1e-10)


def test_gae_shape_errors_and_no_grad():
    values = torch.zeros(4, 2, requires_grad=True)
    done = torch.zeros(3, 2, dtype=torch.bool)
    adv, ret = gae(
        rewards=torch.ones(3, 2), values=values, terminated=done, truncated=done, gamma=0.9, lam=0.9
    )
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match="values"):
        gae(
            rewards=torch.ones(3, 2),
            values=torch.zeros(3, 2),
            terminated=done,
            truncated=done,
            gamma=0.9,
            lam=0.9,
        )


# ------------------------------------------------------------------------------------------
# GRPO, RLOO
# ------------------------------------------------------------------------------------------


def test_grpo_by_hand():
    # Group [1, 0, 0, 0]: mean .25, unbiased std sqrt((.75² + 3*.25²)/3) = sqrt(.25) = .5
    #   -> [1.5, -.5, -.5, -.5]
    # Group [1, 1, 0, 0]: mean .5, std sqrt(4*.25/3) = 1/sqrt(3) -> ±.5*sqrt(3) = ±0.866025
    # Group [1, 1, 1, 1]: std 0 -> 0 / eps = 0
    scores = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    adv, ret = grpo(scores=scores, group_size=4)
    h = 0.5 * math.sqrt(3)
    close(adv, [1.5, -0.5, -0.5, -0.5, h, h, -h, -h, 0, 0, 0, 0], atol=1e-5)
    close(ret, scores.tolist())


def test_grpo_without_std_and_math_sequences():
    # Dr. GRPO: only the mean is subtracted. [1,0,0,0] -> [.75, -.25, -.25, -.25]
    adv, _ = compute_advantages(
        "grpo", scores=torch.tensor([1.0, 0, 0, 0]), group_size=4, normalize_std=False
    )
    close(adv, [0.75, -0.25, -0.25, -0.25])
    # Two prompts x 2 samples of verifier scores [2, 0 | 5, 5]: std of [2, 0] is sqrt(2);
    # (2 - 1)/sqrt(2) = .707107; second group all equal -> 0.
    adv, _ = grpo(scores=torch.tensor([2.0, 0.0, 5.0, 5.0]), group_size=2)
    close(adv, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0])


def test_grpo_rejects_partial_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        grpo(scores=torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="at least 2"):
        grpo(scores=torch.zeros(6), group_size=1)


def test_rloo_by_hand():
    # [1, 0, 0, 0]: A_0 = 1 - 0 = 1, A_j = 0 - 1/3
    # [3, 1, 2]:    A = [3 - 1.5, 1 - 2.5, 2 - 2] = [1.5, -1.5, 0]
    adv, _ = rloo(scores=torch.tensor([1.0, 0, 0, 0]), group_size=4)
    close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3])
    adv, ret = rloo(scores=torch.tensor([3.0, 1.0, 2.0]), group_size=3)
    close(adv, [1.5, -1.5, 0.0])
    close(ret, [3.0, 1.0, 2.0])


# ------------------------------------------------------------------------------------------
# REINFORCE++
# ------------------------------------------------------------------------------------------


def test_reinforce_pp_by_hand():
    # Two sequences, time-major [T=3, B=2], γ = 1. Seq 0: score 1 on its last token -> G = 1,1,1.
    # Seq 1: length 2, score 0 -> G = 0, 0 (third token masked).
    # Valid G = [1, 1, 1, 0, 0]: mean .6, unbiased var (3*.16 + 2*.36)/4 = .3
    rewards = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    adv, ret = reinforce_pp(rewards=rewards, mask=mask, gamma=1.0)
    s = math.sqrt(0.3)
    close(ret, [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    close(adv, [[0.4 / s, -0.6 / s], [0.4 / s, -0.6 / s], [0.4 / s, 0.0]], atol=1e-5)


def test_reinforce_pp_discount_dones_and_kl():
    # γ = .5, one env, rewards [1, 2, 4], episode ends at t=0:
    #   G2 = 4, G1 = 2 + .5*4 = 4, G0 = 1 (does not see the next episode).
    _, ret = reinforce_pp(
        rewards=torch.tensor([[1.0], [2.0], [4.0]]),
        dones=torch.tensor([[True], [False], [False]]),
        gamma=0.5,
    )
    close(ret, [[1.0], [4.0], [4.0]])
    # KL folded into the reward: r' = r - .1 * kl = [0 - .1*1, 1 - .1*2]; G = [.7, .8] at γ=1.
    _, ret = reinforce_pp(
        rewards=torch.tensor([[0.0], [1.0]]), kl=torch.tensor([[1.0], [2.0]]), kl_coef=0.1
    )
    close(ret, [[0.7], [0.8]])

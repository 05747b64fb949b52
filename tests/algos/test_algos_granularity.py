"""Conversions between env-step, chunk and episode rewards and token / action / chunk log-probs."""

from __future__ import annotations

import pytest
import torch

from rlinf_vla.algos import gae
from rlinf_vla.algos.granularity import (
    broadcast_to_logprob,
    chunk_rewards,
    episode_scores,
    expand_like,
    flatten_chunks,
    reduce_to_level,
    repeat_over_chunk,
    to_value_level,
    unflatten_chunks,
    valid_until_first_done,
    values_for_gae,
)

T, B, K, A = 2, 3, 4, 5


def coded(*shape: int) -> torch.Tensor:
    """x[t, b, k] = 100 t + 10 b + k: every entry says where it came from."""
    t = torch.arange(shape[0]).view(-1, 1, 1) * 100
    b = torch.arange(shape[1]).view(1, -1, 1) * 10
    k = torch.arange(shape[2]).view(1, 1, -1)
    return (t + b + k).float()


def test_reduce_to_level():
    x = torch.arange(T * B * K * A, dtype=torch.float32).view(T, B, K, A)
    assert reduce_to_level(x, "token") is x
    action = reduce_to_level(x, "action")
    chunk = reduce_to_level(x, "chunk")
    assert action.shape == (T, B, K) and chunk.shape == (T, B)
    assert action[1, 2, 3].item() == sum(x[1, 2, 3, a].item() for a in range(A))
    assert chunk[1, 2].item() == sum(x[1, 2, k, a].item() for k in range(K) for a in range(A))
    with pytest.raises(ValueError, match="known: action, chunk, token"):
        reduce_to_level(x, "sequence")


def test_flatten_chunks_is_time_major_over_env_steps():
    x = coded(T, B, K)
    flat = flatten_chunks(x)
    assert flat.shape == (T * K, B)
    for t in range(T):
        for k in range(K):
            for b in range(B):
                assert flat[t * K + k, b].item() == 100 * t + 10 * b + k
    torch.testing.assert_close(unflatten_chunks(flat, K), x)
    with pytest.raises(ValueError, match="chunks of 3"):
        unflatten_chunks(flat, 3)


def test_chunk_rewards_sum_and_or():
    rewards = torch.tensor([[[1.0, 2.0], [0.5, 0.5]]])  # [T=1, B=2, K=2]
    terminated = torch.tensor([[[False, True], [False, False]]])
    truncated = torch.tensor([[[False, True], [True, False]]])
    r, term, trunc = chunk_rewards(rewards, terminated, truncated)
    torch.testing.assert_close(r, torch.tensor([[3.0, 1.0]]))
    assert term.tolist() == [[True, False]]
    assert trunc.tolist() == [[False, True]]  # env 0 terminated, so not counted as truncated


def test_values_for_gae():
    chunk_values = torch.randn(T + 1, B)
    assert values_for_gae(chunk_values, "chunk") is chunk_values
    action_values = coded(T + 1, B, K)
    torch.testing.assert_close(values_for_gae(action_values, "chunk"), action_values[..., 0])
    v = values_for_gae(action_values, "action")
    assert v.shape == (T * K + 1, B)
    # step t*K + k of env b holds V code 100 t + 10 b + k; the last row is chunk T's first value
    assert v[1 * K + 2, 1].item() == 100 + 10 + 2
    assert v[-1].tolist() == [100 * T + 10 * b for b in range(B)]
    with pytest.raises(ValueError, match="action-level values"):
        values_for_gae(chunk_values, "action")


def test_repeat_over_chunk():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [T=2, B=2]
    assert repeat_over_chunk(x, 3).tolist() == [[1, 2]] * 3 + [[3, 4]] * 3


def test_expand_like():
    adv = torch.tensor([1.0, 2.0])
    out = expand_like(adv, torch.zeros(2, 3))
    assert out.tolist() == [[1, 1, 1], [2, 2, 2]]
    with pytest.raises(ValueError, match="prefix"):
        expand_like(adv, torch.zeros(3, 2))


@pytest.mark.parametrize("logprob_shape", [(T, B), (T, B, K), (T, B, K, A)])
def test_broadcast_chunk_and_episode_level(logprob_shape):
    logprob = torch.zeros(logprob_shape)
    adv = coded(T, B, 1)[..., 0]  # [T, B], 100 t + 10 b
    out = broadcast_to_logprob(adv, logprob, reward_level="chunk")
    assert out.shape == logprob_shape
    assert (out[1, 2] == 120).all()
    scores = torch.tensor([7.0, 8.0, 9.0])  # [B]
    out = broadcast_to_logprob(scores, logprob, reward_level="episode")
    assert out.shape == logprob_shape
    assert (out[:, 1] == 8.0).all()


@pytest.mark.parametrize("logprob_shape", [(T, B, K), (T, B, K, A)])
def test_broadcast_action_level(logprob_shape):
    adv = flatten_chunks(coded(T, B, K))  # [T*K, B]
    out = broadcast_to_logprob(adv, torch.zeros(logprob_shape), reward_level="action")
    assert out.shape == logprob_shape
    assert (out[1, 2, 3] == 123).all()


def test_broadcast_action_level_to_chunk_logprob_is_refused():
    with pytest.raises(ValueError, match="per-action advantages"):
        broadcast_to_logprob(torch.zeros(T * K, B), torch.zeros(T, B), reward_level="action")


def test_to_value_level():
    returns = flatten_chunks(coded(T, B, K))  # [T*K, B]
    per_action = to_value_level(returns, reward_level="action", values=torch.zeros(T, B, K))
    torch.testing.assert_close(per_action, coded(T, B, K))
    per_chunk = to_value_level(returns, reward_level="action", values=torch.zeros(T, B))
    torch.testing.assert_close(per_chunk, coded(T, B, K)[..., 0])
    chunk_returns = torch.randn(T, B)
    with pytest.raises(ValueError, match=r"values\[\.\.\., 0\]"):
        to_value_level(chunk_returns, reward_level="chunk", values=torch.zeros(T, B, K))
    assert to_value_level(chunk_returns, reward_level="chunk", values=torch.zeros(T, B)) is (
        chunk_returns
    )


def test_episode_scores_and_first_episode_mask():
    # env 0: done at t=1 -> score 1 + 2; env 1: never done -> 1 + 1 + 1;
    # env 2: done at t=0 and t=2 -> only the first episode: 5
    rewards = torch.tensor([[1.0, 1.0, 5.0], [2.0, 1.0, 7.0], [4.0, 1.0, 9.0]])
    dones = torch.tensor([[False, False, True], [True, False, False], [False, False, True]])
    assert episode_scores(rewards, dones).tolist() == [3.0, 3.0, 5.0]
    # discounted per step: env 0: 1 + 0.5 * 2; env 1: 1 + 0.5 + 0.25; env 2: 5
    assert episode_scores(rewards, dones, gamma=0.5).tolist() == [2.0, 1.75, 5.0]
    assert valid_until_first_done(dones).tolist() == [
        [True, True, True],
        [True, True, False],
        [False, True, False],
    ]


def test_action_level_and_chunk_level_returns_agree_at_chunk_starts():
    # With γ = λ = 1 and zero values, GAE returns are the undiscounted sums of the rest of the
    # episode. Computed over env steps and read at each chunk's first step, they equal the
    # chunk-level returns (chunks summed), as long as episodes end on a chunk's last step.
    torch.manual_seed(0)
    r = torch.randn(3, 2, 2)  # [T=3, B=2, K=2]
    term = torch.zeros(3, 2, 2, dtype=torch.bool)
    term[1, 0, 1] = True  # env 0 ends at the last step of chunk 1
    trunc = torch.zeros_like(term)
    _, ret_action = gae(
        rewards=flatten_chunks(r),
        values=torch.zeros(7, 2),
        terminated=flatten_chunks(term),
        truncated=flatten_chunks(trunc),
        gamma=1.0,
        lam=1.0,
    )
    rc, tc, uc = chunk_rewards(r, term, trunc)
    _, ret_chunk = gae(
        rewards=rc, values=torch.zeros(4, 2), terminated=tc, truncated=uc, gamma=1.0, lam=1.0
    )
    from_actions = to_value_level(ret_action, reward_level="action", values=torch.zeros(3, 2))
    torch.testing.assert_close(from_actions, ret_chunk)


def test_docs_recipes_fit_together():
    # The recipes of docs/algorithms.md, end to end on shapes.
    from rlinf_vla.algos import ALGORITHMS, compute_advantages, dynamic_sampling, policy_loss

    rewards = torch.rand(T, B, K)
    terminated = torch.zeros(T, B, K, dtype=torch.bool)
    truncated = torch.zeros(T, B, K, dtype=torch.bool)
    terminated[0, 1, 2] = True
    logprob = torch.randn(T, B, K, A, requires_grad=True)
    values = torch.randn(T + 1, B)

    r, term, trunc = chunk_rewards(rewards, terminated, truncated)
    adv, ret = compute_advantages(
        "gae",
        rewards=r,
        values=values_for_gae(values, "chunk"),
        terminated=term,
        truncated=trunc,
        final_values=torch.zeros(T, B),
        gamma=0.99,
        lam=0.95,
    )
    adv_tok = broadcast_to_logprob(adv, logprob, reward_level="chunk")
    assert to_value_level(ret, reward_level="chunk", values=values[:-1]).shape == (T, B)
    mask = torch.ones_like(logprob, dtype=torch.bool)
    loss, _ = policy_loss(
        "ppo", logprob=logprob, old_logprob=logprob.detach(), advantages=adv_tok, mask=mask
    )
    loss.backward()

    # embodied GRPO, groups of 3 envs
    scores = episode_scores(r, term | trunc)
    adv, _ = compute_advantages("grpo", scores=scores, group_size=3)
    adv_tok = broadcast_to_logprob(adv, logprob, reward_level="episode")
    mask = broadcast_to_logprob(valid_until_first_done(term | trunc), logprob, reward_level="chunk")
    assert adv_tok.shape == mask.shape == logprob.shape
    assert not mask[1, 1].any() and mask[0, 1].all()

    # math DAPO, 2 prompts x 2 samples, 5 tokens
    lp = torch.randn(4, 5, requires_grad=True)
    seq_scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    keep, _ = dynamic_sampling(seq_scores, group_size=2)
    adv, _ = compute_advantages("grpo", scores=seq_scores, group_size=2)
    loss, _ = policy_loss(
        "ppo",
        logprob=lp,
        old_logprob=lp.detach(),
        advantages=expand_like(adv, lp),
        mask=torch.ones(4, 5, dtype=torch.bool) & keep[:, None],
        clip_low=ALGORITHMS["dapo"].clip_low,
        clip_high=ALGORITHMS["dapo"].clip_high,
        agg=ALGORITHMS["dapo"].agg,
    )
    loss.backward()
    assert lp.grad[2:].abs().sum() == 0  # the all-solved group is dropped

"""DAPO's pieces: dynamic sampling, overlong shaping and the named preset."""

from __future__ import annotations

import pytest
import torch

from rlinf_vla.algos import ALGORITHMS, AlgorithmPreset, dynamic_sampling, overlong_penalty


def test_dynamic_sampling_drops_groups_with_equal_scores():
    # groups of 3: [1,1,1] all right, [0,1,0] mixed, [0,0,0] all wrong, [5,5,4.6] mixed
    scores = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, 5, 5, 4.6])
    keep, metrics = dynamic_sampling(scores, group_size=3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert metrics["dropped_group_fraction"].item() == 0.5
    assert metrics["kept_groups"].item() == 2
    # with a tolerance of .5, [5, 5, 4.6] counts as equal too
    keep, metrics = dynamic_sampling(scores, group_size=3, atol=0.5)
    assert keep.sum().item() == 3
    assert metrics["dropped_group_fraction"].item() == 0.75


def test_overlong_penalty_by_hand():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|)/4, and -1 beyond 10
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    penalty = overlong_penalty(lengths, max_length=10, buffer_length=4)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    half = overlong_penalty(lengths, max_length=10, buffer_length=4, penalty_factor=0.5)
    assert half.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, max_length=10, buffer_length=0)


def test_dapo_is_a_named_combination():
    dapo = ALGORITHMS["dapo"]
    assert dapo.advantage == "grpo" and dapo.policy_loss == "ppo"
    assert dapo.clip_high > dapo.clip_low
    assert dapo.agg == "token-mean"
    assert dapo.dynamic_sampling and dapo.overlong_buffer is not None
    assert (dapo.clip_low, dapo.clip_high, dapo.dual_clip) == (0.2, 0.28, None)
    assert ALGORITHMS["ppo"].use_critic and ALGORITHMS["ppo"].advantage == "gae"
    assert ALGORITHMS.names() == ["dagger", "dapo", "grpo", "ppo", "reinforce_pp", "rloo"]
    dagger = ALGORITHMS["dagger"]
    assert dagger.imitation and dagger.advantage is None and not dagger.use_critic
    assert dagger.effective_keys() == {"imitation"}


def test_presets_are_validated():
    with pytest.raises(ValueError, match="advantage must name an estimator"):
        AlgorithmPreset()
    with pytest.raises(ValueError, match="advantage must be null with imitation"):
        AlgorithmPreset(advantage="gae", imitation=True, use_critic=True)
    with pytest.raises(KeyError, match="known: gae, grpo, reinforce_pp, rloo"):
        AlgorithmPreset(advantage="ppo")
    with pytest.raises(KeyError, match="loss aggregation"):
        AlgorithmPreset(advantage="grpo", agg="mean")
    with pytest.raises(ValueError, match="dual_clip"):
        AlgorithmPreset(advantage="grpo", dual_clip=1.0)

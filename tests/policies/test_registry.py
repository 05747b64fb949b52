"""The policy registry and ``make_policy``'s argument checking."""

from __future__ import annotations

import pytest

from rlinf_vla.policies import POLICIES, make_policy, policy_config


def test_unknown_policy_lists_known_names():
    with pytest.raises(KeyError) as err:
        make_policy("openvlaa")
    msg = str(err.value)
    assert "did you mean 'openvla'" in msg
    for name in POLICIES:
        assert name in msg


def test_unknown_config_key_is_named():
    with pytest.raises(TypeError, match="chunk_sise"):
        make_policy("openvla", preset="tiny", chunk_sise=2)


def test_invalid_values_fail_before_building():
    with pytest.raises(ValueError, match="preset"):
        policy_config("openvla", preset="huge")
    with pytest.raises(ValueError, match="logprob_granularity"):
        policy_config("openvla", logprob_granularity="episode")
    with pytest.raises(ValueError, match="temperature"):
        policy_config("openvla", temperature=0.0)


def test_cli_style_keys():
    """``policy=openvla policy.preset=tiny policy.chunk_size=2`` reaches the same config."""
    cfg = policy_config("openvla", **{"preset": "tiny", "chunk_size": 2})
    assert cfg.preset == "tiny" and cfg.chunk_size == 2
    assert cfg.text_config["hidden_size"] == 64  # the tiny architecture
    assert policy_config("openvla").preset == "tiny"  # the default: random weights for CPU runs
    full = policy_config("openvla", preset="full")
    assert full.text_config == {"vocab_size": 32064, "pad_token_id": 32000}
    assert full.image_sizes == (224, 224)

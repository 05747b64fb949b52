"""``checkpoint=<org>/<name>``: a Hugging Face model id resolved from the local cache, offline."""

from __future__ import annotations

import pytest

from rlinf_vla.config import ConfigError
from rlinf_vla.policies import make_policy
from rlinf_vla.policies.resolve import policy_config_for


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face hub cache laid out by hand (``models--<org>--<name>/refs/<ref>`` holds the
    commit, ``snapshots/<commit>/`` the files), with a tiny OpenVLA at ``org/tiny-vla``."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-vla"
    commit = "0123456789abcdef0123456789abcdef01234567"
    make_policy("openvla", preset="tiny", seed=0).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return repo / "snapshots" / commit


def test_hub_id_loads_from_the_local_cache(hub_cache):
    policy = make_policy("openvla", checkpoint="org/tiny-vla")
    assert policy.config.checkpoint == str(hub_cache)
    assert policy_config_for("openvla", {"checkpoint": "org/tiny-vla"}).action_dim == 7
    by_commit = make_policy("openvla", checkpoint=f"org/tiny-vla@{hub_cache.name}")
    assert by_commit.config.checkpoint == str(hub_cache)


def test_hub_id_not_in_the_cache_says_how_to_download(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"hf download openvla/openvla-7b"):
        make_policy("openvla", checkpoint="openvla/openvla-7b")
    with pytest.raises(ConfigError, match=r"policy\.checkpoint='openvla/openvla-7b' is neither"):
        policy_config_for("openvla", {"checkpoint": "openvla/openvla-7b"})
    with pytest.raises(ConfigError, match=r"policy\.checkpoint='/no/such/folder' does not exist"):
        policy_config_for("openvla", {"checkpoint": "/no/such/folder"})


def test_a_policy_class_loads_a_hub_id_from_the_cache_as_make_policy_does(hub_cache):
    import torch

    from rlinf_vla.policies.openvla.model import OpenVLAPolicy

    policy = OpenVLAPolicy.from_pretrained("org/tiny-vla")
    assert policy.config.checkpoint == str(hub_cache)
    made = make_policy("openvla", checkpoint="org/tiny-vla")
    for (name, a), (_, b) in zip(
        policy.state_dict().items(), made.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match=r"hf download openvla/openvla-7b"):
        OpenVLAPolicy.from_pretrained("openvla/openvla-7b")


def test_pi0_from_pretrained_takes_a_hub_id_too(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from rlinf_vla.policies.pi0.model import Pi0Policy

    repo = tmp_path / "hub" / "models--org--tiny-pi0"
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    make_policy("pi0", preset="tiny", seed=0).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert Pi0Policy.from_pretrained("org/tiny-pi0").config.checkpoint == str(
        repo / "snapshots" / commit
    )

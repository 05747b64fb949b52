"""A policy without a checkpoint takes the env's sizes (action, state, cameras) where the
command line leaves them; a checkpoint and the command line keep theirs, and a mismatch is
refused before any worker starts, naming the keys."""

from __future__ import annotations

import json

import pytest

from rlinf_vla import cli
from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines import validate

METAWORLD = ["env=metaworld", "policy=openvla_oft", "cluster.devices_per_node=1"]
#: MetaWorld's state (hand xyz + gripper opening), as tests/envs/test_contract.py checks it
#: against the built env's observations.
METAWORLD_STATE = 4


def _train(*overrides: str):
    return validate(cli.compose("train", list(overrides)))


def test_a_fresh_policy_takes_the_envs_action_state_and_cameras() -> None:
    job = _train(*METAWORLD)
    pol = job.policy_config
    assert (pol.action_dim, pol.proprio_dim, pol.image_keys) == (4, METAWORLD_STATE, ("main",))
    # the workers build their policies from the section: it carries the sizes
    assert job.policy["action_dim"] == 4 and job.policy["proprio_dim"] == METAWORLD_STATE
    assert list(job.policy["image_keys"]) == ["main"]
    # MetaWorld's whole 39-D observation as the state
    assert _train(*METAWORLD, "env.state_mode=full").policy_config.proprio_dim == 39


def test_the_adapted_sizes_are_shown_by_cfg_job(capsys) -> None:
    assert cli.main(["train", *METAWORLD, "--cfg", "job"]) == 0
    from omegaconf import OmegaConf

    policy = OmegaConf.create(capsys.readouterr().out).policy
    assert (policy.action_dim, policy.proprio_dim) == (4, METAWORLD_STATE)
    assert list(policy.image_keys) == ["main"]


def test_a_policy_that_pads_its_state_is_not_refused_a_shorter_one() -> None:
    # π0 zero-pads the state to max_state_dim (8 in the tiny preset): MetaWorld's 4 values fit
    # as they are, and its 39-D full observation makes a fresh π0 pad to 39 instead.
    job = _train("env=metaworld", "policy=pi0", "cluster.devices_per_node=1")
    assert job.policy_config.max_state_dim == 8 and "max_state_dim" not in job.policy
    assert (job.policy_config.action_dim, job.policy_config.image_keys) == (4, ("main",))
    full = ["env=metaworld", "env.state_mode=full", "policy=pi0", "cluster.devices_per_node=1"]
    assert _train(*full).policy_config.max_state_dim == 39
    with pytest.raises(ConfigError, match=r"policy\.max_state_dim=8 is smaller than the state "):
        _train(*full, "policy.max_state_dim=8")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "policy.action_dim=7",
            "policy.action_dim=7 does not match the action size of env 'metaworld': 4",
        ),
        (
            "policy.proprio_dim=8",
            "policy.proprio_dim=8 does not match the state size of env 'metaworld': "
            f"{METAWORLD_STATE} (env.state_mode=proprio)",
        ),
        (
            "policy.image_keys=[main,wrist]",
            "policy.image_keys=['main', 'wrist'] asks for camera(s) ['wrist'] that env "
            "'metaworld' does not provide",
        ),
    ],
    ids=["action_dim", "proprio_dim", "image_keys"],
)
def test_a_size_set_by_hand_is_kept_and_a_mismatch_refused_before_start(
    capsys, nothing_starts, override, message
) -> None:
    assert cli.main(["train", *METAWORLD, override]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "1 problem" not in err and "problems" not in err  # the other sizes were adapted


def test_the_state_size_is_checked_whatever_the_action_size(capsys, nothing_starts) -> None:
    # Before, a policy with MetaWorld's action size and cameras passed validation and its
    # workers crashed on the first observation (obs.state has 4 dims, the policy expects 8).
    args = [*METAWORLD, "policy.action_dim=4", "policy.image_keys=[main]", "policy.proprio_dim=8"]
    assert cli.main(["train", *args]) == 2
    assert "policy.proprio_dim=8 does not match the state size" in capsys.readouterr().err


def test_a_checkpoint_keeps_its_own_sizes(tmp_path) -> None:
    from rlinf_vla.policies import make_policy

    sizes = {"action_dim": 4, "proprio_dim": METAWORLD_STATE, "image_keys": ("main",)}
    make_policy("openvla_oft", preset="tiny", **sizes).save_pretrained(tmp_path / "fits")
    job = _train(*METAWORLD, f"policy.checkpoint={tmp_path / 'fits'}")
    assert set(job.policy) >= {"checkpoint"} and not set(sizes) & set(job.policy)
    pol = job.policy_config
    assert (pol.action_dim, pol.proprio_dim, pol.image_keys) == (4, METAWORLD_STATE, ("main",))
    # a LIBERO-sized checkpoint is not resized to the env: every mismatch is named
    make_policy("openvla_oft", preset="tiny").save_pretrained(tmp_path / "libero")
    with pytest.raises(ConfigError) as e:
        _train(*METAWORLD, f"policy.checkpoint={tmp_path / 'libero'}")
    assert "3 problems" in str(e.value)
    assert "policy.action_dim=7 (from the checkpoint) does not match" in str(e.value)
    assert "policy.proprio_dim=8 (from the checkpoint) does not match" in str(e.value)
    assert "policy.image_keys=['main', 'wrist'] (from the checkpoint) asks for" in str(e.value)


def test_no_camera_left_is_the_camera_error() -> None:
    # OpenVLA-OFT reading only the wrist camera: none of the env's, nothing to keep
    with pytest.raises(ConfigError, match=r"camera\(s\) \['wrist'\] that env 'toy'"):
        _train("env=toy", "policy=openvla_oft", "policy.image_keys=[wrist]")


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.ray
def test_openvla_oft_trains_on_metaworld_without_sizes_on_the_command_line(tmp_path) -> None:
    pytest.importorskip("metaworld", reason="MetaWorld is not installed")
    small = [
        "env.num_envs=2",
        "env.fast_render=true",
        "env.image_size=64",
        "env.max_episode_steps=8",
        "policy.chunk_size=2",
        "runner.rollout_chunks=2",
        "runner.eval_interval=0",
        "algo.update_epochs=1",
        "algo.minibatch_size=4",
        "algo.micro_batch_size=4",
        "placement.stages=2",  # one env per stage, each in its own thread of the env worker
    ]
    args = ["train", *METAWORLD, *small, "runner.max_iterations=1"]
    assert cli.main([*args, f"runner.output_dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1]

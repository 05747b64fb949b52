"""The critic's own encoder (``value_encoder=cnn``) of the OpenVLA family: its value by hand,
its gradient stays out of the actor, its checkpoints, its learning-rate group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlinf_vla.policies import make_policy
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.updater import build_learner
from tests.policies.conftest import bounds_stats, make_obs

CAMERAS = ("main", "wrist")
KW = dict(preset="tiny", chunk_size=2, norm_stats=bounds_stats(7, 8), seed=0)


@pytest.fixture(scope="module")
def policy():
    return make_policy("openvla_oft", value_encoder="cnn", **KW)


def _value_by_hand(policy, obs):
    """The Nature CNN over both cameras' [0, 1] pixels stacked on the channels, the
    normalised proprioception through its linear layer, both ReLU'd, concatenated, through
    the value MLP (GELU after each hidden layer, no bias on the last): written out with torch.nn.functional."""
    sd = {k: v.detach() for k, v in policy.state_dict().items()}
    x = torch.cat([obs.images[k].permute(0, 3, 1, 2).float() / 255 for k in CAMERAS], 1)
    for i, stride in ((0, 4), (2, 2), (4, 1)):
        x = F.relu(
            F.conv2d(
                x, sd[f"value_encoder.cnn.{i}.weight"], sd[f"value_encoder.cnn.{i}.bias"], stride
            )
        )
    assert x.shape[-2:] == (4, 4)  # a 64-pixel image: nothing to pool
    x = F.relu(
        F.linear(x.flatten(1), sd["value_encoder.cnn.8.weight"], sd["value_encoder.cnn.8.bias"])
    )
    # OFT's normalize_proprio, clip(2 (s - q01) / (q99 - q01 + 1e-8) - 1, -1, 1), with the
    # bounds [-1, 1] of bounds_stats
    s = (2 * (obs.state + 1) / (2 + 1e-8) - 1).clamp(-1, 1)
    s = F.relu(F.linear(s, sd["value_encoder.state.0.weight"], sd["value_encoder.state.0.bias"]))
    h = torch.cat([x, s], -1)
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("value_head.mlp.")})
    for n, layer in enumerate(layers):
        h = F.linear(
            h, sd[f"value_head.mlp.{layer}.weight"], sd.get(f"value_head.mlp.{layer}.bias")
        )
        h = F.gelu(h) if n + 1 < len(layers) else h
    return h.squeeze(-1)


def test_value_by_hand_and_the_same_in_act_value_and_evaluate(policy):
    obs = make_obs(3, CAMERAS, 8, size=64)
    out = policy.act(obs)
    want = _value_by_hand(policy, obs)
    torch.testing.assert_close(out.value, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(policy.value(obs), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(policy.evaluate(obs, out.replay).value, want, rtol=1e-4, atol=1e-5)
    # it reads the pictures: another image, another value
    other = make_obs(3, CAMERAS, 8, size=64, seed=1)
    other.state = obs.state
    assert (policy.value(other) - want).abs().max() > 1e-6


def test_the_value_loss_reaches_the_encoder_and_not_the_actor(policy):
    obs = make_obs(2, CAMERAS, 8, size=64)
    out = policy.act(obs)
    policy.zero_grad()
    policy.evaluate(obs, out.replay).value.square().sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    critic = [n for n in grads if n.startswith(("value_encoder.", "value_head."))]
    assert {n.split(".")[0] for n in critic} == {"value_encoder", "value_head"}
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in critic)
    actor = [n for n in grads if n not in critic]
    assert actor and all(grads[n] is None or not grads[n].any() for n in actor)
    policy.zero_grad()
    # the actor's loss, in turn, does not reach the critic
    policy.evaluate(obs, out.replay).logprob.sum().backward()
    assert all(p.grad is None for n, p in policy.named_parameters() if n in critic)
    assert policy.trains_readout_only() is False
    policy.zero_grad()


def test_checkpoint_round_trip_and_a_backbone_critic_checkpoint(policy, tmp_path):
    obs = make_obs(2, CAMERAS, 8, size=64)
    policy.save_pretrained(tmp_path / "cnn")
    loaded = make_policy("openvla_oft", checkpoint=str(tmp_path / "cnn"))
    assert loaded.config.value_encoder == "cnn"
    torch.testing.assert_close(loaded.value(obs), policy.value(obs))
    # a checkpoint whose critic read the backbone (a warm start): the actor loads, the critic
    # of the other kind starts fresh instead of failing on the value head's input size
    backbone = make_policy("openvla_oft", **KW)
    backbone.save_pretrained(tmp_path / "backbone")
    own = make_policy("openvla_oft", checkpoint=str(tmp_path / "backbone"), value_encoder="cnn")
    a = backbone.act(obs, greedy=True).replay["normalized_actions"]
    torch.testing.assert_close(own.act(obs, greedy=True).replay["normalized_actions"], a)
    assert own.value_head.mlp[0].weight.shape[1] == own.value_encoder.out_dim == 512
    # and back: the backbone critic of the same checkpoint loads as it was saved
    again = make_policy("openvla_oft", checkpoint=str(tmp_path / "backbone"))
    torch.testing.assert_close(again.value(obs), backbone.value(obs))


def test_openvla_with_its_own_critic_reads_the_camera_only(tmp_path):
    p = make_policy("openvla", preset="tiny", value_encoder="cnn", seed=0)
    assert p.value_encoder.state is None and p.value_encoder.out_dim == 256
    obs = make_obs(2, ("main",), size=48)
    out = p.act(obs)
    torch.testing.assert_close(out.value, p.value(obs))
    torch.testing.assert_close(p.evaluate(obs, out.replay).value, out.value)


def test_bad_settings_and_small_images_are_named():
    with pytest.raises(ValueError, match=r"value_encoder.*one of \['backbone', 'cnn'\]"):
        make_policy("openvla_oft", value_encoder="resnet", **KW)
    with pytest.raises(ValueError, match=r"value_encoder.*needs value_head=true"):
        make_policy("openvla_oft", value_encoder="cnn", value_head=False, **KW)
    p = make_policy("openvla_oft", value_encoder="cnn", **KW)
    with pytest.raises(ValueError, match="at least 36 x 36 pixels, got \\(32, 32\\)"):
        p.value(make_obs(2, CAMERAS, 8, size=32))


def test_the_encoder_learns_at_the_critics_rate(policy):
    algo = AlgoConfig(lr=1e-4, value_lr=1e-3)
    learner = build_learner(policy, algo)
    rates = {}
    for group in learner.optimizer.param_groups:
        for p in group["params"]:
            rates[id(p)] = group["lr"]
    named = dict(policy.named_parameters())
    assert (
        rates[id(named["value_encoder.cnn.0.weight"])]
        == rates[id(named["value_head.mlp.0.weight"])]
    )
    assert (
        rates[id(named["value_encoder.cnn.0.weight"])]
        != rates[id(named["action_head.model.fc1.weight"])]
    )

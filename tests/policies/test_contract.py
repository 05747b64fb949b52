"""The policy contract, for every registered family at the tiny preset: shapes, env units,
``evaluate`` reproducing ``act``, greedy determinism, save/load round trip, learning, LoRA."""

from __future__ import annotations

import pytest
import torch

from rlinf_vla.policies import POLICIES, make_policy
from tests.policies.conftest import make_obs

K, A = 2, 7

# name -> (extra config, cameras, state dim)
FAMILIES: dict[str, tuple[dict, tuple[str, ...], int | None]] = {
    "openvla": ({}, ("main",), None),
    "openvla_oft": ({}, ("main", "wrist"), 8),
    "pi0": ({"noise_method": "flow_sde"}, ("main", "wrist"), 8),
    "pi05": ({"noise_method": "flow_noise"}, ("main", "wrist"), 8),
    "smolvla": ({"noise_method": "flow_sde"}, ("main", "wrist"), 6),
}


def stats_for(name: str) -> dict:
    if name.startswith("pi0") or name == "smolvla":
        return {
            "actions": {
                "mean": [0.5] * A,
                "std": [2.0] * A,
                "q01": [-2.0] * A,
                "q99": [3.0] * A,
            },
            "state": {"mean": [0.0] * 8, "std": [1.0] * 8, "q01": [-1.0] * 8, "q99": [1.0] * 8},
        }
    action = {"q01": [-2.0] * A, "q99": [3.0] * A, "mask": [True] * (A - 1) + [False]}
    return {"toy": {"action": action, "proprio": {"q01": [-1.0] * 8, "q99": [1.0] * 8}}}


def build(name: str, **kw):
    extra, _, _ = FAMILIES[name]
    return make_policy(
        name,
        preset="tiny",
        chunk_size=K,
        action_dim=A,
        norm_stats=stats_for(name),
        seed=0,
        **{**extra, **kw},
    )


def obs_for(name: str, batch: int = 3, seed: int = 0):
    _, cameras, state_dim = FAMILIES[name]
    return make_obs(batch, cameras, state_dim, seed=seed)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    name = request.param
    return name, build(name)


def test_registry_names():
    assert set(POLICIES) == {"openvla", "openvla_oft", "pi0", "pi05", "smolvla"}
    assert POLICIES["pi05"].cls is POLICIES["pi0"].cls  # one folder, a config flag


@pytest.mark.parametrize("granularity", ["token", "action", "chunk"])
def test_act_shapes_and_evaluate_reproduces_logprob(family, granularity):
    name, policy = family
    policy.config = policy.config.replace(logprob_granularity=granularity)
    obs = obs_for(name)
    torch.manual_seed(1)
    out = policy.act(obs)
    shape = {"token": (3, K, A), "action": (3, K), "chunk": (3,)}[granularity]
    assert out.actions.shape == (3, K, A) and out.actions.dtype == torch.float32
    assert out.logprob.shape == shape
    assert out.value.shape == (3,)
    ev = policy.evaluate(obs, out.replay)
    assert ev.logprob.shape == shape and ev.entropy.shape == shape and ev.value.shape == (3,)
    assert (ev.logprob - out.logprob).abs().max().item() <= 1e-5
    assert (ev.value - out.value).abs().max().item() <= 1e-5
    assert torch.isfinite(ev.entropy).all()
    policy.config = policy.config.replace(logprob_granularity="action")


def test_value_matches_act(family):
    # ``value`` (bootstrapping) may skip action decoding, but must give act's value.
    name, policy = family
    obs = obs_for(name)
    expected = policy.act(obs, greedy=True).value
    assert (policy.value(obs) - expected).abs().max().item() <= 1e-5
    no_critic = build(name, value_head=False)
    assert no_critic.value(obs) is None


def test_actions_in_env_units(family):
    name, policy = family
    low, high = -2.0, 3.0  # q01/q99 of the statistics
    for greedy in (True, False):
        actions = policy.act(obs_for(name), greedy=greedy).actions
        # OFT's greedy action is its head's unclipped mean, as upstream (test_openvla_oft.py).
        if name == "openvla" or (name == "openvla_oft" and not greedy):
            assert actions[..., :-1].min() >= low and actions[..., :-1].max() <= high
            assert actions[..., -1].abs().max() <= 1.0  # gripper: mask False, not rescaled
        assert torch.isfinite(actions).all()


def test_greedy_is_deterministic(family):
    name, policy = family
    obs = obs_for(name)
    torch.manual_seed(0)
    a = policy.act(obs, greedy=True).actions
    torch.manual_seed(123)
    b = policy.act(obs, greedy=True).actions
    assert torch.equal(a, b)


def test_save_load_round_trip(family, tmp_path):
    name, policy = family
    policy.save_pretrained(tmp_path)
    loaded = make_policy(name, checkpoint=str(tmp_path))
    obs = obs_for(name)
    torch.manual_seed(0)
    a = policy.act(obs, greedy=True)
    torch.manual_seed(0)
    b = loaded.act(obs, greedy=True)
    assert torch.equal(a.actions, b.actions)
    torch.testing.assert_close(a.value, b.value, rtol=0, atol=0)
    out = policy.act(obs)
    ev1, ev2 = policy.evaluate(obs, out.replay), loaded.evaluate(obs, out.replay)
    torch.testing.assert_close(ev1.logprob, ev2.logprob, rtol=0, atol=0)


def test_supervised_loss_falls(family):
    name, _ = family
    policy = build(name)
    obs = obs_for(name, batch=2)
    g = torch.Generator().manual_seed(0)
    actions = torch.rand(2, K, A, generator=g) * 4 - 1.5  # inside the [-2, 3] bounds
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(8):
        torch.manual_seed(0)  # flow matching draws noise and time: the same every step
        loss = policy.loss(obs, actions)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses


def test_lora_freezes_base_weights(family):
    name, _ = family
    policy = build(name, lora_rank=4, lora_alpha=8)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    frozen_before = {
        n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad
    }
    assert frozen_before and all("lora_" not in n for n in frozen_before)
    lora_before = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    obs = obs_for(name, batch=2)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        out = policy.act(obs)
        ev = policy.evaluate(obs, out.replay)
        loss = -ev.logprob.mean() + ev.value.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, p in policy.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
    assert any(
        not torch.equal(p, lora_before[n]) for n, p in policy.named_parameters() if n in lora_before
    )


def test_gradient_checkpointing_saves_less_and_matches(family):
    name, _ = family
    obs = obs_for(name, batch=2)
    actions = torch.rand(2, K, A)
    grads, saved = [], []
    for checkpointing in (False, True):
        policy = build(name, gradient_checkpointing=checkpointing)
        policy.train()
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = policy.loss(obs, actions)
        loss.backward()
        saved.append(count[0])
        grads.append([p.grad.clone() for p in policy.parameters() if p.grad is not None])
    # checkpointed layers keep only their inputs for the backward pass
    assert saved[1] < 0.7 * saved[0], saved
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16(family):
    name, _ = family
    policy = build(name, dtype="bfloat16")
    assert policy.value_head.mlp[0].weight.dtype == torch.float32  # heads stay float32
    obs = obs_for(name, batch=2)
    out = policy.act(obs)
    assert out.actions.dtype == torch.float32 and torch.isfinite(out.actions).all()
    ev = policy.evaluate(obs, out.replay)
    assert (ev.logprob - out.logprob).abs().max().item() <= 1e-5

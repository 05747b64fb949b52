"""π0 / π0.5: checkpoint keys, masks, time embedding, adaRMS, prompt and the Flow-SDE density,
each checked against a direct computation of the published formula."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlinf_vla.policies import CheckpointMismatchError, make_policy
from rlinf_vla.policies.pi0.model import (
    AdaRMSNorm,
    make_att_2d_masks,
    posemb_sincos,
    sample_time,
)
from tests.policies.conftest import make_obs
from tests.policies.test_contract import stats_for

CAMERAS = ("main", "wrist")
P = r"paligemma_with_expert\."
VLM = P + r"paligemma\.model\."
COMMON_KEYS = [
    VLM + r"vision_tower\.vision_model\.embeddings\.patch_embedding\.(weight|bias)",
    VLM + r"vision_tower\.vision_model\.embeddings\.position_embedding\.weight",
    VLM
    + r"vision_tower\.vision_model\.encoder\.layers\.\d+\.(layer_norm1|layer_norm2)\.(weight|bias)",
    VLM
    + r"vision_tower\.vision_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)\.(weight|bias)",
    VLM + r"vision_tower\.vision_model\.encoder\.layers\.\d+\.mlp\.(fc1|fc2)\.(weight|bias)",
    VLM + r"vision_tower\.vision_model\.post_layernorm\.(weight|bias)",
    VLM + r"multi_modal_projector\.linear\.(weight|bias)",
    P + r"paligemma\.lm_head\.weight",  # tied to the token embedding; openpi stores this name
    VLM + r"language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight",
    VLM + r"language_model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight",
    VLM + r"language_model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    VLM + r"language_model\.norm\.weight",
    P + r"gemma_expert\.model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight",
    P + r"gemma_expert\.model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight",
    P + r"gemma_expert\.lm_head\.weight",  # unused, but in openpi's state dict
    r"(action_in_proj|action_out_proj)\.(weight|bias)",
]
PI0_KEYS = [
    P + r"gemma_expert\.model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    P + r"gemma_expert\.model\.norm\.weight",
    r"(state_proj|action_time_mlp_in|action_time_mlp_out)\.(weight|bias)",
]
PI05_KEYS = [
    P
    + r"gemma_expert\.model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.dense\.(weight|bias)",
    P + r"gemma_expert\.model\.norm\.dense\.(weight|bias)",
    r"(time_mlp_in|time_mlp_out)\.(weight|bias)",
]


def build(name: str, **kw):
    return make_policy(name, preset="tiny", chunk_size=2, norm_stats=stats_for(name), seed=0, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name in ("pi0", "pi05"):
        path = tmp_path_factory.mktemp(name)
        build(name).save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_checkpoint_has_openpi_key_names(saved, name):
    sd = load_file(str(saved[name] / "model.safetensors"))
    patterns = COMMON_KEYS + (PI05_KEYS if name == "pi05" else PI0_KEYS)
    assert [k for k in sd if not any(re.fullmatch(p, k) for p in patterns)] == []
    assert [p for p in patterns if not any(re.fullmatch(p, k) for k in sd)] == []
    # the expert shares the VLM's heads and head_dim (4 x 16) at its own width 32
    e = P.replace("\\", "") + "gemma_expert.model.layers.0."
    assert sd[e + "self_attn.q_proj.weight"].shape == (64, 32)
    assert sd[e + "self_attn.k_proj.weight"].shape == (16, 32)  # one kv head
    assert sd[e + "self_attn.o_proj.weight"].shape == (32, 64)
    if name == "pi05":
        assert sd[e + "input_layernorm.dense.weight"].shape == (3 * 32, 32)
    else:
        assert sd["action_time_mlp_in.weight"].shape == (32, 2 * 32)
    config = json.loads((saved[name] / "config.json").read_text())
    assert config["action_dim"] == 8 and config["action_horizon"] == 4
    stats = saved[name] / "assets" / "default" / "norm_stats.json"
    assert "norm_stats" in json.loads(stats.read_text())


def test_lerobot_prefix_and_tied_embedding_load(saved, tmp_path):
    src = saved["pi0"]
    sd = load_file(str(src / "model.safetensors"))
    embed = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    sd[embed] = sd.pop("paligemma_with_expert.paligemma.lm_head.weight")  # the other tied name
    sd["paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.zeros(3, 32)  # unused
    save_file({f"model.{k}": v for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    shutil.copytree(src / "assets", tmp_path / "assets")
    obs = make_obs(2, CAMERAS, 8)
    a = make_policy("pi0", checkpoint=str(src)).act(obs, greedy=True).actions
    b = make_policy("pi0", checkpoint=str(tmp_path)).act(obs, greedy=True).actions
    assert torch.equal(a, b)


def test_wrong_variant_is_named(saved):
    with pytest.raises(CheckpointMismatchError, match="policy=pi05"):
        make_policy("pi0", checkpoint=str(saved["pi05"]))


def test_attention_mask_by_hand():
    # prefix: 2 valid tokens + 1 padding; suffix (π0): state token, then 2 action tokens.
    pad = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    ar = torch.tensor([[0, 0, 0, 1, 1, 0]])
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0],  # prefix: bidirectional over the valid prefix
            [1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],  # padding attends to nothing and is never attended
            [1, 1, 0, 1, 0, 0],  # state: prefix + itself
            [1, 1, 0, 1, 1, 1],  # actions: prefix, state and all actions
            [1, 1, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(make_att_2d_masks(pad, ar)[0], expected)


def test_time_embedding_and_time_sampling_by_hand():
    # dim 4: periods 4e-3 and 4.0; t = 0.25 -> sin(125 pi), sin(pi/8), cos(125 pi), cos(pi/8)
    emb = posemb_sincos(torch.tensor([0.25]), 4, 4e-3, 4.0)[0]
    expected = [0.0, math.sin(math.pi / 8), -1.0, math.cos(math.pi / 8)]
    assert emb.tolist() == pytest.approx(expected, abs=1e-6)
    torch.manual_seed(0)
    t = sample_time(20000)
    assert t.min() >= 0.001 and t.max() <= 1.0
    assert t.mean().item() == pytest.approx(1.5 / 2.5 * 0.999 + 0.001, abs=0.01)  # Beta mean


def test_adarms_by_hand():
    norm = AdaRMSNorm(2, 1)
    with torch.no_grad():
        norm.dense.weight.copy_(torch.tensor([[0.5], [0.0], [1.0], [0.0], [2.0], [2.0]]))
        norm.dense.bias.zero_()
    x = torch.tensor([[[3.0, 4.0]]])
    y, gate = norm(x, torch.tensor([[1.0]]))
    rms = math.sqrt((9 + 16) / 2 + 1e-6)
    # scale = (0.5, 0), shift = (1, 0), gate = (2, 2)
    assert y[0, 0].tolist() == pytest.approx([3 / rms * 1.5 + 1, 4 / rms], abs=1e-5)
    assert gate[0, 0].tolist() == [2.0, 2.0]
    assert torch.equal(AdaRMSNorm(2, 1).dense.weight, torch.zeros(6, 1))  # zero-initialised


def test_pi05_discrete_state_prompt():
    p = build("pi05", discrete_state_input=True)
    # quantile stats of the state are q01=-1, q99=1: normalised ~ raw state
    # digitize on linspace(-1, 1, 257)[:-1] minus 1: -1 -> 0, 0 -> 128, 0.999 -> 255
    ids = p.processor.prompt_ids("pick_up the cube\n", torch.tensor([-1.0, 0.0, 0.999]))
    text = p.processor.tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "Task: pick up the cube, State: 0 128 255;\nAction: "
    assert ids[0] == p.processor.bos_id


def test_cached_velocity_matches_the_joint_pass():
    """``act`` runs the prefix once and the suffix against its KV cache; ``loss`` runs both in
    one pass. The flow-matching loss from the cached velocity must equal ``loss``."""
    for name in ("pi0", "pi05"):
        p = build(name)
        obs = make_obs(2, CAMERAS, 8)
        g = torch.Generator().manual_seed(0)
        actions = torch.rand(2, 4, 7, generator=g)
        noise = torch.randn(2, 4, 8, generator=g)
        t = torch.tensor([0.3, 0.8])
        a = p.processor.normalize_actions(actions)
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * a
        v = p.velocity(obs, x_t, t)
        by_hand = ((v - (noise - a)) ** 2).mean()
        loss = p.loss(obs, actions, noise=noise, time=t)
        assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_flow_sde_logprob_is_the_gaussian_transition_density():
    p = build("pi0", noise_method="flow_sde", num_steps=3, logprob_granularity="token")
    obs = make_obs(3, CAMERAS, 8)
    torch.manual_seed(0)
    out = p.act(obs)
    chain, chosen = out.replay["chain"], out.replay["denoise_index"]
    ts = [1.0, 2 / 3, 1 / 3, 0.0]
    a = 0.5  # noise_level
    for b in range(3):
        single = obs.select([b])
        for k in range(3):
            t, delta = ts[k], ts[k] - ts[k + 1]
            x = chain[b : b + 1, k]
            v = p.velocity(single, x, torch.tensor([t]))
            if k != chosen[b]:  # deterministic Euler step
                torch.testing.assert_close(
                    chain[b : b + 1, k + 1], x - delta * v, atol=1e-5, rtol=0
                )
                continue
            sigma = a * math.sqrt(t / (1 - (ts[1] if t == 1 else t)))
            x0, x1 = x - t * v, x + (1 - t) * v
            mean = x0 * (1 - t + delta) + x1 * (t - delta - sigma**2 * delta / (2 * t))
            std = math.sqrt(delta) * sigma
            density = torch.distributions.Normal(mean, std).log_prob(chain[b : b + 1, k + 1])
            torch.testing.assert_close(out.logprob[b], density[0, :2, :7], atol=1e-4, rtol=0)


def test_flow_noise_std_range_and_values():
    p = build("pi05", noise_method="flow_noise")
    std = p.noise_head(torch.randn(50, 32) * 10)
    assert std.min() >= 0.08 - 1e-6 and std.max() <= 0.16 + 1e-6
    obs = make_obs(2, CAMERAS, 8)
    out = p.act(obs)
    other = {"chain": torch.randn_like(out.replay["chain"])}
    # π0.5's value reads the VLM prefix: it does not depend on the denoising chain.
    torch.testing.assert_close(p.evaluate(obs, other).value, out.value, rtol=0, atol=1e-6)


def test_missing_camera_is_named():
    p = build("pi0")
    with pytest.raises(KeyError, match="'wrist'"):
        p.act(make_obs(1, ("main",), 8))


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_actions_are_unnormalised_by_hand(name):
    p = build(name)
    out = p.act(make_obs(2, CAMERAS, 8))
    x = out.replay["chain"][:, -1, :2, :7]  # the final denoised state, executed part
    zscore = x * (2.0 + 1e-6) + 0.5  # π0: mean 0.5, std 2
    quantile = (x + 1) / 2 * (5.0 + 1e-6) - 2.0  # π0.5: q01 = -2, q99 = 3
    expected = zscore if name == "pi0" else quantile
    torch.testing.assert_close(out.actions, expected, rtol=0, atol=1e-5)


# -- greedy actions: the ODE from sampled (default) or zero noise ------------------------------
def euler_by_hand(p, obs, x):
    """openpi's ``sample_actions``: ``x <- x + dt v(x, t)``, ``dt = -1/K``, ``t = 1, 1 - 1/K, ...``
    (3 steps for the tiny preset)."""
    k = p.config.num_steps
    for step in range(k):
        x = x - (1.0 / k) * p.velocity(obs, x, torch.full((x.shape[0],), 1.0 - step / k))
    return x


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_greedy_zero_noise_integrates_from_zeros(name):
    p = build(name, greedy_noise="zero")
    obs = make_obs(2, CAMERAS, 8)
    out = p.act(obs, greedy=True)
    x = euler_by_hand(p, obs, torch.zeros(2, 4, 8))
    torch.testing.assert_close(out.replay["chain"][:, -1], x, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        out.actions, p.processor.unnormalize_actions(x[:, :2]), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_greedy_sample_noise_integrates_the_ode_from_a_seeded_draw(name):
    obs = make_obs(2, CAMERAS, 8)
    p = build(name, greedy_seed=1)
    rng = torch.get_rng_state()
    out = p.act(obs, greedy=True)
    assert torch.equal(torch.get_rng_state(), rng)  # torch's global RNG is not drawn from
    x0 = out.replay["chain"][:, 0]
    assert torch.equal(x0, p.greedy_initial_noise(obs))
    assert x0.abs().min() > 0 and not torch.equal(x0[0], x0[1])
    # the plain ODE (also for Flow-SDE: no drift term at its step 0) from that draw
    torch.testing.assert_close(
        out.replay["chain"][:, -1], euler_by_hand(p, obs, x0.clone()), rtol=0, atol=1e-5
    )
    # equal seeds: equal actions (another policy object, or the same one again); other seeds:
    # other actions
    assert torch.equal(build(name, greedy_seed=1).act(obs, greedy=True).actions, out.actions)
    assert torch.equal(p.act(obs, greedy=True).actions, out.actions)
    other = build(name, greedy_seed=2).act(obs, greedy=True).actions
    assert (other - out.actions).abs().max() > 1e-3
    # an observation's noise does not depend on its batch
    torch.testing.assert_close(p.greedy_initial_noise(obs.select([1]))[0], x0[1], rtol=0, atol=0)


def test_greedy_sample_noise_is_standard_normal():
    p = build("pi0")
    obs = make_obs(64, CAMERAS, 8, seed=3)
    x = p.greedy_initial_noise(obs)  # 64 x 4 x 8 draws
    assert abs(x.mean().item()) < 0.1 and abs(x.std().item() - 1) < 0.1
    # each observation its own draw: rows far apart (independent rows: distance ~ sqrt(64))
    dist = torch.cdist(x.flatten(1), x.flatten(1))
    assert dist[~torch.eye(64, dtype=torch.bool)].min() > 4


def test_joint_flow_sde_scores_every_step_of_the_chain():
    # Every step is the Flow-SDE transition; the log-prob is the mean of log N(x_0; 0, I) and
    # the K transition densities, each computed here from the formula.
    p = build("pi0", noise_method="flow_sde", num_steps=3, joint_logprob=True)
    obs = make_obs(2, CAMERAS, 8)
    torch.manual_seed(0)
    out = p.act(obs)
    chain = out.replay["chain"]
    assert "denoise_index" not in out.replay
    ts = [1.0, 2 / 3, 1 / 3, 0.0]
    a = 0.5  # noise_level
    for b in range(2):
        single = obs.select([b])
        terms = [torch.distributions.Normal(0.0, 1.0).log_prob(chain[b : b + 1, 0])]
        for k in range(3):
            t, delta = ts[k], ts[k] - ts[k + 1]
            x = chain[b : b + 1, k]
            v = p.velocity(single, x, torch.tensor([t]))
            sigma = a * math.sqrt(t / (1 - (ts[1] if t == 1 else t)))
            x0, x1 = x - t * v, x + (1 - t) * v
            mean = x0 * (1 - t + delta) + x1 * (t - delta - sigma**2 * delta / (2 * t))
            std = math.sqrt(delta) * sigma
            # each step is stochastic: the next state is not the deterministic mean
            assert (chain[b : b + 1, k + 1] - mean).abs().max() > 1e-3
            terms.append(torch.distributions.Normal(mean, std).log_prob(chain[b : b + 1, k + 1]))
        by_hand = torch.stack(terms).mean(0)[0, :2, :7].sum(-1)  # per action: over its dims
        torch.testing.assert_close(out.logprob[b], by_hand, atol=1e-4, rtol=0)
    again = p.evaluate(obs, out.replay)
    torch.testing.assert_close(again.logprob, out.logprob, atol=1e-4, rtol=0)


def test_joint_logprob_is_refused_where_it_means_nothing():
    with pytest.raises(Exception, match="joint_logprob"):
        build("pi0", noise_method="flow_noise", joint_logprob=True)
    with pytest.raises(Exception, match="sde_ignore_last"):
        build("pi0", joint_logprob=True, sde_ignore_last=True)

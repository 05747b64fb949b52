"""OpenVLA-OFT: checkpoint pieces, parallel bidirectional decoding and the Gaussian L1 head."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlinf_vla.policies import make_policy
from rlinf_vla.types import Observation
from tests.policies.conftest import bounds_stats, make_obs

CAMERAS = ("main", "wrist")


@pytest.fixture(scope="module")
def policy():
    return make_policy(
        "openvla_oft", preset="tiny", chunk_size=2, norm_stats=bounds_stats(7, 8), seed=0
    )


@pytest.fixture(scope="module")
def saved(policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("oft_ckpt")
    policy.save_pretrained(path)
    return path


def test_checkpoint_pieces_have_official_names(saved):
    head = torch.load(saved / "action_head--latest_checkpoint.pt", weights_only=True)
    d, a = 64, 7  # tiny LLM width, action dim
    expected = {
        "model.layer_norm1.weight": (d * a,),
        "model.layer_norm1.bias": (d * a,),
        "model.fc1.weight": (d, d * a),
        "model.fc1.bias": (d,),
        "model.layer_norm2.weight": (d,),
        "model.layer_norm2.bias": (d,),
        "model.fc2.weight": (a, d),
        "model.fc2.bias": (a,),
    }
    for i in (0, 1):
        expected[f"model.mlp_resnet_blocks.{i}.ffn.0.weight"] = (d,)  # LayerNorm
        expected[f"model.mlp_resnet_blocks.{i}.ffn.0.bias"] = (d,)
        expected[f"model.mlp_resnet_blocks.{i}.ffn.1.weight"] = (d, d)  # Linear
        expected[f"model.mlp_resnet_blocks.{i}.ffn.1.bias"] = (d,)
    assert {k: tuple(v.shape) for k, v in head.items()} == expected
    proprio = torch.load(saved / "proprio_projector--latest_checkpoint.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in proprio.items()} == {
        "fc1.weight": (d, 8),
        "fc1.bias": (d,),
        "fc2.weight": (d, d),
        "fc2.bias": (d,),
    }
    assert "language_model.lm_head.weight" in load_file(str(saved / "model.safetensors"))


def test_attention_is_bidirectional(saved):
    """With causal attention the first action's features could not see the placeholders after
    it; in OFT they do, so the chunk length changes the first action."""
    obs = make_obs(2, CAMERAS, 8)
    short = make_policy("openvla_oft", checkpoint=str(saved), chunk_size=1)
    long = make_policy("openvla_oft", checkpoint=str(saved), chunk_size=3)
    a1 = short.act(obs, greedy=True).replay["normalized_actions"][:, 0]
    a3 = long.act(obs, greedy=True).replay["normalized_actions"][:, 0]
    assert (a1 - a3).abs().max() > 1e-4


def test_gaussian_logprob_by_hand(policy):
    obs = make_obs(2, CAMERAS, 8)
    mean = policy.act(obs, greedy=True).replay["normalized_actions"]
    p = make_policy(
        "openvla_oft",
        preset="tiny",
        chunk_size=2,
        norm_stats=bounds_stats(7, 8),
        seed=0,
        logprob_granularity="token",
    )
    # 0.3 from the mean, toward 0: inside [-1, 1], where the density is the normal one
    ev = p.evaluate(obs, {"normalized_actions": mean - 0.3 * mean.sign()})
    sigma = math.exp(-2.0)  # init_log_std
    by_hand = -math.log(sigma) - 0.5 * math.log(2 * math.pi) - 0.5 * (0.3 / sigma) ** 2
    torch.testing.assert_close(ev.logprob, torch.full_like(ev.logprob, by_hand), rtol=0, atol=1e-4)
    entropy = 0.5 * math.log(2 * math.pi * math.e * sigma**2)
    torch.testing.assert_close(ev.entropy, torch.full_like(ev.entropy, entropy), rtol=0, atol=1e-5)


def test_a_clipped_samples_logprob_is_the_mass_clipped_onto_its_bound():
    p = make_policy(
        "openvla_oft",
        preset="tiny",
        chunk_size=1,
        action_dim=3,
        norm_stats=bounds_stats(3, 8),
        seed=0,
        logprob_granularity="token",
    )
    mean, std = torch.tensor([[[0.8, 0.8, 0.8]]]), torch.full((1, 1, 3), 0.5)
    p._gaussian = lambda hidden: (mean, std)
    x = torch.tensor([[[0.5, 1.3, -1.2]]])  # inside, beyond +1, beyond -1
    ev = p.evaluate(make_obs(1, CAMERAS, 8), {"normalized_actions": x})

    def phi(z):  # the standard normal CDF
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    by_hand = [
        -math.log(0.5) - 0.5 * math.log(2 * math.pi) - 0.5 * (0.3 / 0.5) ** 2,
        math.log(1 - phi((1 - 0.8) / 0.5)),  # P(X >= 1)
        math.log(phi((-1 - 0.8) / 0.5)),  # P(X <= -1)
    ]
    assert ev.logprob[0, 0].tolist() == pytest.approx(by_hand, rel=1e-5)


def test_official_style_directory_loads(policy, saved, tmp_path):
    """DDP-prefixed step-named pieces and a config.json without our head settings."""
    for f in ("model.safetensors", "dataset_statistics.json", "tokenizer.json"):
        (tmp_path / f).write_bytes((saved / f).read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes((saved / "tokenizer_config.json").read_bytes())
    config = json.loads((saved / "config.json").read_text())
    for key in ("action_head", "use_proprio", "proprio_dim", "action_head_blocks"):
        config["rlinf_vla"].pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("action_head", "proprio_projector"):
        sd = torch.load(saved / f"{name}--latest_checkpoint.pt", weights_only=True)
        torch.save(
            {f"module.{k}": v for k, v in sd.items()}, tmp_path / f"{name}--50000_checkpoint.pt"
        )
    loaded = make_policy("openvla_oft", checkpoint=str(tmp_path))
    assert loaded.config.action_head == "l1_gaussian" and loaded.config.proprio_dim == 8
    obs = make_obs(2, CAMERAS, 8)
    assert torch.equal(loaded.act(obs, greedy=True).actions, policy.act(obs, greedy=True).actions)


def test_lora_adapter_folder_round_trip(saved, tmp_path):
    base = str(saved)
    tuned = make_policy("openvla_oft", checkpoint=base, lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    tuned.save_pretrained(tmp_path / "tuned")
    adapter = tmp_path / "tuned" / "lora_adapter"
    keys = list(load_file(str(adapter / "adapter_model.safetensors")))
    assert all(k.startswith("base_model.model.language_model.model.layers.") for k in keys)
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    obs = make_obs(2, CAMERAS, 8)
    expected = tuned.act(obs, greedy=True).actions
    # base weights + the adapter folder (as OFT's lora_adapter/) ...
    with_adapter = make_policy("openvla_oft", checkpoint=base, lora_adapter=str(adapter))
    torch.testing.assert_close(with_adapter.act(obs, greedy=True).actions, expected)
    # ... and the merged export
    merged = make_policy("openvla_oft", checkpoint=str(tmp_path / "tuned"))
    torch.testing.assert_close(merged.act(obs, greedy=True).actions, expected, rtol=0, atol=1e-5)


def test_missing_wrist_camera_and_state(policy):
    with pytest.raises(KeyError, match="'wrist'"):
        policy.act(make_obs(1, ("main",), 8))
    with pytest.raises(KeyError, match=r"obs\.state"):
        policy.act(make_obs(1, CAMERAS, None))


def test_discrete_head_samples_action_ids():
    p = make_policy("openvla_oft", preset="tiny", chunk_size=2, action_head="discrete", seed=0)
    out = p.act(make_obs(2, CAMERAS, 8))
    ids = out.replay["action_tokens"]
    assert ids.shape == (2, 2, 7) and ((ids >= 768) & (ids < 1024)).all()
    assert p.action_head is None


def test_proprio_is_normalised_as_upstream_normalize_proprio():
    # normalize_proprio (OFT's openvla_utils.py) by hand: clip(where(mask, 2 (x - q01) /
    # (q99 - q01 + 1e-8) - 1, x), -1, 1). A constant dim (q01 == q99) goes to +-1, not 0; an
    # unmasked dim is clipped too.
    stats = {"toy": {**bounds_stats(7)["toy_dataset"]}}
    stats["toy"]["proprio"] = {
        "q01": [0.0, 1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0],
        "q99": [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        "mask": [True, True, True, False, True, True, True, True],
    }
    proc = make_policy("openvla_oft", preset="tiny", norm_stats=stats, seed=0).processor
    state = torch.tensor([[1.5, 1.5, 0.5, 3.0, 0.25, 0.0, 1.0, 2.0]])
    got = proc.proprio(Observation(images={}, state=state, instruction=["x"]), 8)[0].tolist()
    q01, q99 = stats["toy"]["proprio"]["q01"], stats["toy"]["proprio"]["q99"]
    mask = stats["toy"]["proprio"]["mask"]
    expected = [
        min(1.0, max(-1.0, 2 * (x - lo) / (hi - lo + 1e-8) - 1 if m else x))
        for x, lo, hi, m in zip(state[0].tolist(), q01, q99, mask, strict=True)
    ]
    assert got == pytest.approx(expected, abs=1e-6)
    assert got[1] == 1.0 and got[2] == -1.0 and got[3] == 1.0


def test_greedy_mean_is_not_clipped_samples_are():
    policy = make_policy(
        "openvla_oft", preset="tiny", norm_stats=bounds_stats(7), chunk_size=1, seed=0
    )
    mean = torch.full((1, 1, 7), 1.5)  # outside the normalised range
    policy._gaussian = lambda hidden: (mean, torch.full_like(mean, 1e-6))
    obs = make_obs(1, cameras=("main", "wrist"), state_dim=8)
    # bounds_stats: q01 = -2, q99 = 3 for dims 0-5; OFT un-normalises with +1e-8 in the range.
    greedy = policy.act(obs, greedy=True).actions[0, 0, :6]
    assert greedy.tolist() == pytest.approx([0.5 * (1.5 + 1) * (5 + 1e-8) - 2] * 6)
    sampled = policy.act(obs).actions[0, 0, :6]
    assert sampled.tolist() == pytest.approx([0.5 * (1.0 + 1) * (5 + 1e-8) - 2] * 6)


def test_clip_greedy_executes_the_mean_clipped_as_samples_are():
    policy = make_policy(
        "openvla_oft",
        preset="tiny",
        norm_stats=bounds_stats(7),
        chunk_size=1,
        seed=0,
        clip_greedy=True,
    )
    mean = torch.tensor([[[1.5, -1.25, 0.5, 1.0, -1.0, 0.0, 0.0]]])
    policy._gaussian = lambda hidden: (mean, torch.full_like(mean, 1e-6))
    obs = make_obs(1, cameras=("main", "wrist"), state_dim=8)
    out = policy.act(obs, greedy=True)
    # q01 = -2, q99 = 3: the mean clipped to [-1, 1], then 0.5 (x + 1) (5 + 1e-8) - 2
    clipped = [1.0, -1.0, 0.5, 1.0, -1.0, 0.0]
    expected = [0.5 * (x + 1) * (5 + 1e-8) - 2 for x in clipped]
    assert out.actions[0, 0, :6].tolist() == pytest.approx(expected)
    # what the update scores is the mean itself
    assert torch.equal(out.replay["normalized_actions"], mean)


# ----------------------------------------------------------------------------------------------
# Official ALOHA checkpoints: min/max bounds, 25-step chunks, 14 dims, three cameras
# ----------------------------------------------------------------------------------------------
ALOHA_KEY = "aloha1_put_X_into_pot_300_demos"


def _aloha_stats() -> dict:
    lo = [-1.0 - 0.1 * i for i in range(14)]
    hi = [1.0 + 0.2 * i for i in range(14)]
    entry = {"min": lo, "max": hi, "q01": [v / 2 for v in lo], "q99": [v / 2 for v in hi]}
    return {ALOHA_KEY: {"action": dict(entry), "proprio": dict(entry)}}


@pytest.fixture(scope="module")
def aloha_official(tmp_path_factory):
    """An OFT ALOHA run folder as finetune.py writes it (no rlinf_vla section)."""
    src = tmp_path_factory.mktemp("aloha_src")
    make_policy(
        "openvla_oft",
        preset="tiny",
        action_dim=14,
        proprio_dim=14,
        chunk_size=2,
        norm_stats=_aloha_stats(),
        seed=0,
    ).save_pretrained(src)
    path = tmp_path_factory.mktemp("aloha_official")
    for f in src.iterdir():
        if f.is_file() and f.name != "rl_heads.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    tiny = {"timm_kwargs": config.pop("rlinf_vla")["timm_kwargs"]}
    (path / "config.json").write_text(json.dumps(config))
    return path, tiny


def test_official_aloha_checkpoint_gets_the_aloha_constants(aloha_official):
    path, tiny = aloha_official
    cfg = make_policy("openvla_oft", checkpoint=str(path), **tiny).config
    # openvla-oft's ALOHA_CONSTANTS: NUM_ACTIONS_CHUNK 25, ACTION_DIM 14, PROPRIO_DIM 14, BOUNDS
    assert (cfg.chunk_size, cfg.action_dim, cfg.proprio_dim) == (25, 14, 14)
    assert cfg.action_normalization == "bounds"
    assert cfg.gripper == "env"  # joint angles go to the robot unchanged
    assert cfg.image_keys == ("main", "left_wrist", "right_wrist")
    assert cfg.center_crop is True and cfg.image_pipeline == "rlds"
    # explicit values win
    mine = make_policy(
        "openvla_oft",
        checkpoint=str(path),
        chunk_size=8,
        action_normalization="bounds_q99",
        image_keys=["main"],
        **tiny,
    ).config
    assert (mine.chunk_size, mine.action_normalization, mine.image_keys) == (
        8,
        "bounds_q99",
        ("main",),
    )


def test_aloha_min_max_unnormalisation_by_hand(aloha_official):
    path, tiny = aloha_official
    proc = make_policy("openvla_oft", checkpoint=str(path), **tiny).processor
    stats = _aloha_stats()[ALOHA_KEY]
    x = torch.linspace(-1, 1, 14).expand(2, 3, 14)
    got = proc.unnormalize_actions(x)[0, 0].tolist()
    # _unnormalize_actions (BOUNDS): 0.5 (x + 1) (max - min + 1e-8) + min, every dim (no mask)
    lo, hi = stats["action"]["min"], stats["action"]["max"]
    expected = [
        0.5 * (v + 1) * (b - a + 1e-8) + a for v, a, b in zip(x[0, 0].tolist(), lo, hi, strict=True)
    ]
    assert got == pytest.approx(expected, abs=1e-5)
    assert got[0] == pytest.approx(-1.0) and got[-1] == pytest.approx(1.0 + 0.2 * 13)
    # normalize_proprio (BOUNDS): clip(2 (s - min) / (max - min + 1e-8) - 1, -1, 1)
    state = torch.tensor([[0.5 * i - 2 for i in range(14)]])
    obs = Observation(images={}, state=state, instruction=["x"])
    got_p = proc.proprio(obs, 14)[0].tolist()
    lo, hi = stats["proprio"]["min"], stats["proprio"]["max"]
    expected_p = [
        min(1.0, max(-1.0, 2 * (s - a) / (b - a + 1e-8) - 1))
        for s, a, b in zip(state[0].tolist(), lo, hi, strict=True)
    ]
    assert got_p == pytest.approx(expected_p, abs=1e-6)
    # with q01/q99 (the LIBERO bounds) the same actions would be half as large
    q99 = make_policy(
        "openvla_oft", checkpoint=str(path), action_normalization="bounds_q99", **tiny
    ).processor
    assert q99.unnormalize_actions(x)[0, 0].tolist() == pytest.approx(
        [v / 2 for v in expected], abs=1e-5
    )


def test_aloha_policy_acts_with_25_step_chunks(aloha_official):
    path, tiny = aloha_official
    policy = make_policy("openvla_oft", checkpoint=str(path), **tiny)
    obs = make_obs(1, ("main", "left_wrist", "right_wrist"), 14)
    assert policy.act(obs, greedy=True).actions.shape == (1, 25, 14)


def test_written_here_keeps_recorded_chunk_and_bounds(tmp_path):
    stats = _aloha_stats()
    make_policy(
        "openvla_oft",
        preset="tiny",
        action_dim=14,
        proprio_dim=14,
        chunk_size=3,
        action_normalization="bounds",
        norm_stats=stats,
        seed=0,
    ).save_pretrained(tmp_path)
    cfg = make_policy("openvla_oft", checkpoint=str(tmp_path)).config
    assert (cfg.chunk_size, cfg.action_normalization, cfg.gripper) == (3, "bounds", "env")


def test_libero_official_keeps_the_libero_constants(saved, tmp_path):
    for f in saved.iterdir():
        if f.is_file() and f.name != "rl_heads.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((saved / "config.json").read_text())
    tiny = {"timm_kwargs": config.pop("rlinf_vla")["timm_kwargs"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    stats = {"libero_10_no_noops": bounds_stats(7, 8)["toy_dataset"]}
    (tmp_path / "dataset_statistics.json").write_text(json.dumps(stats))
    cfg = make_policy("openvla_oft", checkpoint=str(tmp_path), **tiny).config
    assert (cfg.chunk_size, cfg.action_normalization, cfg.gripper) == (8, "bounds_q99", "rlds")
    assert cfg.image_keys == ("main", "wrist") and cfg.unnorm_key is None


def test_a_checkpoint_keeps_its_log_std_unless_init_log_std_is_given(tmp_path):
    # The log-std a run trained travels with the checkpoint; policy.init_log_std on the command
    # line resets it (more exploration after a behaviour-cloned start).
    trained = make_policy("openvla_oft", preset="tiny", seed=0)
    with torch.no_grad():
        trained.log_std.copy_(torch.linspace(-1.2, -0.6, trained.log_std.numel()))
    trained.save_pretrained(tmp_path)
    assert load_file(str(tmp_path / "rl_heads.safetensors"))["log_std"][0].item() == pytest.approx(
        -1.2
    )

    kept = make_policy("openvla_oft", checkpoint=str(tmp_path))
    assert torch.equal(kept.log_std, trained.log_std)
    reset = make_policy("openvla_oft", checkpoint=str(tmp_path), init_log_std=-1.5)
    assert torch.equal(reset.log_std, torch.full_like(trained.log_std, -1.5))
    # The same through the typed config a job resolves and hands its workers.
    from rlinf_vla.policies.resolve import policy_config_for

    kept = make_policy(
        "openvla_oft", policy_config_for("openvla_oft", {"checkpoint": str(tmp_path)})
    )
    assert torch.equal(kept.log_std, trained.log_std)
    given = {"checkpoint": str(tmp_path), "init_log_std": -1.5}
    reset = make_policy("openvla_oft", policy_config_for("openvla_oft", given))
    assert torch.equal(reset.log_std, torch.full_like(trained.log_std, -1.5))


def test_init_log_std_takes_one_value_per_action_dim(tmp_path):
    per_dim = [-1.5, -1.5, -1.5, -3.0, -3.0, -3.0, -4.0]
    fresh = make_policy("openvla_oft", preset="tiny", seed=0, init_log_std=per_dim)
    assert fresh.log_std.tolist() == per_dim
    make_policy("openvla_oft", preset="tiny", seed=0).save_pretrained(tmp_path)
    reset = make_policy("openvla_oft", checkpoint=str(tmp_path), init_log_std=per_dim)
    assert reset.log_std.tolist() == per_dim
    with pytest.raises(ValueError, match=r"init_log_std.*action_dim=7 values"):
        make_policy("openvla_oft", preset="tiny", init_log_std=[-1.0, -2.0])
    with pytest.raises(ValueError, match=r"init_log_std.*log_std_range"):
        make_policy("openvla_oft", preset="tiny", init_log_std=[-1.0] * 6 + [-9.0])


def test_trainable_modules_freezes_every_other_parameter():
    kw = dict(preset="tiny", chunk_size=2, norm_stats=bounds_stats(7, 8), seed=0)
    regex = "(action_head|value_head|log_std)"
    policy = make_policy("openvla_oft", trainable_modules=regex, **kw)
    heads = ("action_head.", "value_head.")
    expected = {n for n, _ in policy.named_parameters() if n.startswith(heads) or n == "log_std"}
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == expected
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == sum(
        p.numel() for n, p in policy.named_parameters() if n in expected
    )
    assert "proprio_projector.fc1.weight" not in trainable
    with pytest.raises(ValueError, match=r"trainable_modules='no_such_module' matches no .*vla\."):
        make_policy("openvla_oft", trainable_modules="no_such_module", **kw)
    with pytest.raises(ValueError, match="not a valid regex"):
        make_policy("openvla_oft", trainable_modules="(", **kw)

"""OpenVLA: action tokenizer, prompt, un-normalisation and checkpoint format, checked against
numbers computed by hand from the published formulas and key names."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlinf_vla.policies import CheckpointMismatchError, make_policy
from rlinf_vla.policies.heads import restricted_logits
from rlinf_vla.policies.tokenizers import ActionTokenizer
from tests.policies.conftest import bounds_stats, make_obs

# The official openvla-7b key layout (MODELS.md §1.6), as regexes.
OFFICIAL_OPENVLA_KEYS = [
    r"vision_backbone\.featurizer\.(cls_token|reg_token|pos_embed)",
    r"vision_backbone\.featurizer\.patch_embed\.proj\.(weight|bias)",
    r"vision_backbone\.featurizer\.blocks\.\d+\.(norm1|norm2)\.(weight|bias)",
    r"vision_backbone\.featurizer\.blocks\.\d+\.attn\.(qkv|proj)\.(weight|bias)",
    r"vision_backbone\.featurizer\.blocks\.\d+\.(ls1|ls2)\.scale_factor",
    r"vision_backbone\.featurizer\.blocks\.\d+\.mlp\.(fc1|fc2)\.(weight|bias)",
    r"vision_backbone\.featurizer\.norm\.(weight|bias)",
    r"vision_backbone\.fused_featurizer\.pos_embed",
    r"vision_backbone\.fused_featurizer\.patch_embed\.proj\.(weight|bias)",
    r"vision_backbone\.fused_featurizer\.blocks\.\d+\.(norm1|norm2)\.(weight|bias)",
    r"vision_backbone\.fused_featurizer\.blocks\.\d+\.attn\.(qkv|proj)\.(weight|bias)",
    r"vision_backbone\.fused_featurizer\.blocks\.\d+\.mlp\.(fc1|fc2)\.(weight|bias)",
    r"vision_backbone\.fused_featurizer\.norm\.(weight|bias)",
    r"vision_backbone\.fused_featurizer\.attn_pool\.latent",
    r"vision_backbone\.fused_featurizer\.attn_pool\.(q|kv|proj|norm|mlp\.fc1|mlp\.fc2)\.(weight|bias)",
    r"projector\.fc[123]\.(weight|bias)",
    r"language_model\.model\.embed_tokens\.weight",
    r"language_model\.model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight",
    r"language_model\.model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight",
    r"language_model\.model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    r"language_model\.model\.norm\.weight",
    r"language_model\.lm_head\.weight",
]


@pytest.fixture(scope="module")
def policy():
    return make_policy("openvla", preset="tiny", norm_stats=bounds_stats(7), chunk_size=2, seed=0)


@pytest.fixture(scope="module")
def saved(policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("openvla_ckpt")
    policy.save_pretrained(path)
    return path


def test_action_token_ids_by_hand():
    # bins_k = -1 + 2k/255 (k = 0..255); numpy.digitize gives d with bins_{d-1} <= a < bins_d;
    # id = 32000 - d.  a=-1: d=1 -> 31999.  a=0: bins_127 = -1/255 <= 0 < 1/255 = bins_128, d=128
    # -> 31872.  a=+1 >= bins_255: d=256 -> 31744 (the first of the last 256 ids of 32000).
    tok = ActionTokenizer(vocab_size=32000, n_bins=256)
    ids = tok.encode(torch.tensor([-1.0, 0.0, 1.0]))
    assert ids.tolist() == [31999, 31872, 31744]
    assert tok.encode(torch.tensor([-7.0, 7.0])).tolist() == [31999, 31744]  # clipped
    # decode: centre (bins_i + bins_{i+1}) / 2 = -1 + (2i + 1)/255 with i = clip(32000 - id - 1,
    # 0, 254): 31999 -> i=0; 31872 -> i=127 -> 0; 31744 -> i=255 clipped to 254.
    values = tok.decode(torch.tensor([31999, 31872, 31744, 31745]))
    expected = [-1 + 1 / 255, 0.0, -1 + 509 / 255, -1 + 509 / 255]
    assert values.tolist() == pytest.approx(expected, abs=1e-6)


def test_restricted_logits_by_hand():
    logits = torch.tensor([[5.0, 0.0, 1.0, 2.0, 3.0, 9.0]])
    # action ids 1..4, temperature 2, top-2: [0, 1, 2, 3]/2 -> keep 1.0 and 1.5
    out = restricted_logits(logits, first_id=1, n_ids=4, temperature=2.0, top_k=2)
    inf = float("-inf")
    assert out.tolist() == [[inf, inf, 1.0, 1.5]]


def test_tiny_size(policy):
    n = sum(p.numel() for p in policy.parameters())
    assert 200_000 < n < 1_000_000


def test_prompt_layout(policy):
    proc = policy.processor
    batch = proc.prompts(["Pick Up The Cube", "open it"])
    ids, mask = batch.input_ids, batch.attention_mask
    assert ids[:, 0].tolist() == [proc.bos_id] * 2  # BOS first, padding after it
    assert ids[:, -1].tolist() == [proc.space_id] * 2  # prompts end with the "▁" piece
    text = proc.tokenizer.decode(ids[0][mask[0].bool()], skip_special_tokens=True)
    assert text.rstrip() == "In: What action should the robot take to pick up the cube?\nOut:"
    assert (ids[1][~mask[1].bool()] == proc.pad_id).all() and mask[1, 1] == 0


def test_sampled_tokens_are_action_ids_and_unnormalised(policy):
    out = policy.act(make_obs(3))
    ids = out.replay["action_tokens"]
    assert ids.shape == (3, 2, 7)
    assert ((ids >= 1024 - 256) & (ids < 1024)).all()  # the last 256 ids of the base vocab
    # By hand: centre c = -1 + (2 i + 1)/255, i = clip(1024 - id - 1, 0, 254); dims 0-5 map
    # [-1, 1] to [q01, q99] = [-2, 3]: a = (c + 1)/2 * 5 - 2; the gripper (mask False) stays c.
    i = (1024 - ids - 1).clamp(0, 254).double()
    c = -1 + (2 * i + 1) / 255
    expected = c.clone()
    expected[..., :6] = (c[..., :6] + 1) / 2 * 5 - 2
    torch.testing.assert_close(out.actions, expected.float(), rtol=0, atol=1e-6)
    assert out.actions.dtype == torch.float32


def test_value_reads_the_state_before_the_first_action(policy):
    obs = make_obs(2)
    out = policy.act(obs)
    other = {"action_tokens": torch.full_like(out.replay["action_tokens"], 1000)}
    ev = policy.evaluate(obs, other)
    torch.testing.assert_close(ev.value, out.value, rtol=0, atol=1e-6)


def test_action_hidden_states_predict_each_action_token(policy):
    # Greedy decoding (one token at a time, KV cache) picks the argmax at every position, so the
    # teacher-forced hidden states of that sequence must give back the same argmax everywhere.
    obs = make_obs(2)
    greedy = policy.act(obs, greedy=True).replay["action_tokens"]  # [2, K=2, A=7]
    hidden = policy.action_hidden_states(obs, greedy)
    assert hidden.shape == (2, 14, policy.vla.llm_dim)
    index = policy.action_logits(hidden).argmax(-1)
    assert torch.equal(policy.processor.action_tokenizer.from_index(index), greedy.flatten(1))


def test_top_k_one_is_greedy():
    p = make_policy("openvla", preset="tiny", top_k=1, seed=1)
    obs = make_obs(2)
    sampled = p.act(obs).replay["action_tokens"]
    assert torch.equal(sampled, p.act(obs, greedy=True).replay["action_tokens"])


def test_checkpoint_has_official_key_names(saved):
    keys = list(load_file(str(saved / "model.safetensors")))
    unmatched = [k for k in keys if not any(re.fullmatch(p, k) for p in OFFICIAL_OPENVLA_KEYS)]
    assert unmatched == []
    unused = [p for p in OFFICIAL_OPENVLA_KEYS if not any(re.fullmatch(p, k) for k in keys)]
    assert unused == []
    sd = load_file(str(saved / "model.safetensors"))
    assert sd["language_model.model.embed_tokens.weight"].shape == (1024 + 64, 64)
    assert sd["projector.fc1.weight"].shape == (4 * 80, 32 + 48)  # 4 x (DINO 32 + SigLIP 48)
    assert sd["vision_backbone.featurizer.reg_token"].shape == (1, 4, 32)
    config = json.loads((saved / "config.json").read_text())
    assert config["timm_model_ids"] == [
        "vit_large_patch14_reg4_dinov2.lvd142m",
        "vit_so400m_patch14_siglip_224",
    ]
    assert config["text_config"]["vocab_size"] - config["pad_to_multiple_of"] == 1024
    assert config["n_action_bins"] == 256
    assert json.loads((saved / "dataset_statistics.json").read_text()) == bounds_stats(7)


def test_loads_sharded_prismatic_style_checkpoint(policy, saved, tmp_path):
    """Shards + index (as the official 3-shard upload) and timm's ``gamma`` LayerScale name."""
    sd = load_file(str(saved / "model.safetensors"))
    sd = {k.replace(".scale_factor", ".gamma"): v for k, v in sd.items()}
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half]}
    shards["model-00002-of-00002.safetensors"] = names[half:]
    for file, part in shards.items():
        save_file({k: sd[k] for k in part}, str(tmp_path / file))
    weight_map = {k: f for f, part in shards.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in ("config.json", "dataset_statistics.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((saved / f).read_bytes())
    loaded = make_policy("openvla", checkpoint=str(tmp_path))
    obs = make_obs(2)
    assert torch.equal(loaded.act(obs, greedy=True).actions, policy.act(obs, greedy=True).actions)


def test_bad_checkpoint_lists_keys_briefly(saved, tmp_path):
    sd = load_file(str(saved / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if "mlp.gate_proj" not in k}
    sd["projector.fc9.weight"] = torch.zeros(1)
    save_file(sd, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((saved / f).read_bytes())
    with pytest.raises(CheckpointMismatchError) as err:
        make_policy("openvla", checkpoint=str(tmp_path))
    msg = str(err.value)
    assert "language_model.model.layers.*.mlp.gate_proj.weight (x2)" in msg
    assert "projector.fc9.weight" in msg
    assert len(msg) < 600


def test_missing_camera_is_named(policy):
    obs = make_obs(1, cameras=("wrist",))
    with pytest.raises(KeyError, match="'main'"):
        policy.act(obs)


def test_frozen_features_only_when_the_read_out_alone_trains():
    obs = make_obs(3)
    full = make_policy("openvla", preset="tiny", chunk_size=2, seed=0)
    out = full.act(obs)
    assert full.frozen_features(obs, out.replay) is None  # the whole model trains
    policy = make_policy(
        "openvla",
        preset="tiny",
        chunk_size=2,
        seed=0,
        lora_rank=4,
        lora_target_modules=".*lm_head",
    )
    with torch.no_grad():  # a LoRA that changes the logits (B starts at zero)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(
        n.startswith(("vla.language_model.lm_head.", "value_head.")) for n in trainable
    )
    features = policy.frozen_features(obs, out.replay)
    assert features.shape == (3, 2 * 7, 64) and not features.requires_grad
    split = policy.evaluate_features(features, out.replay)
    whole = policy.evaluate(obs, out.replay)
    for a, b in (
        (split.logprob, whole.logprob),
        (split.entropy, whole.entropy),
        (split.value, whole.value),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # The split pass carries the gradient of every trainable parameter.
    (split.logprob.sum() + split.value.sum()).backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for p in policy.parameters()
        if p.requires_grad
    )
    # OpenVLA-OFT scores its actions with its own pass: never split.
    oft = make_policy(
        "openvla_oft", preset="tiny", seed=0, lora_rank=4, lora_target_modules=".*lm_head"
    )
    assert oft.frozen_features(obs, {}) is None


@pytest.mark.parametrize("exact", [True, False])
def test_acting_returns_the_frozen_features_of_its_sample(exact, monkeypatch):
    """What a rollout worker sends an actor that caches frozen features: the hidden states the
    decoding steps read the sampled tokens' log-probs from, the features ``frozen_features``
    computes teacher-forced up to float rounding. The actor scores the read-out on these very
    features, so acting skips the teacher-forced re-scoring even with ``exact_logprob``."""
    obs = make_obs(3)
    lora = {"lora_rank": 4, "lora_target_modules": ".*lm_head"}
    policy = make_policy(
        "openvla", preset="tiny", chunk_size=2, seed=0, exact_logprob=exact, **lora
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    torch.manual_seed(0)
    plain = policy.act(obs)
    with monkeypatch.context() as m:

        def teacher_forced(*args):
            raise AssertionError("acting re-scored the sample although it sends the features")

        m.setattr(policy, "_teacher_forced", teacher_forced)
        torch.manual_seed(0)
        out, features = policy.act_with_features(obs)  # the same sample
    assert torch.equal(plain.replay["action_tokens"], out.replay["action_tokens"])
    torch.testing.assert_close(out.logprob, plain.logprob, rtol=1e-5, atol=1e-5)
    recomputed = policy.frozen_features(obs, out.replay)
    assert features.shape == recomputed.shape == (3, 2 * 7, 64)
    torch.testing.assert_close(features, recomputed, rtol=1e-5, atol=1e-5)
    # The read-out on them gives back the log-probs and value acting recorded.
    scored = policy.evaluate_features(features, out.replay)
    torch.testing.assert_close(scored.logprob, out.logprob, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scored.value, out.value, rtol=1e-6, atol=1e-6)
    # A whole model that trains, or OFT (its own scoring pass), sends none.
    full = make_policy("openvla", preset="tiny", chunk_size=2, seed=0, exact_logprob=exact)
    assert full.act_with_features(obs)[1] is None
    oft = make_policy("openvla_oft", preset="tiny", seed=0, **lora)
    assert oft.act_with_features(make_obs(3, ("main", "wrist"), 8))[1] is None


# ----------------------------------------------------------------------------------------------
# The gripper convention of the official checkpoints (RLDS: 1 = open, 0 = close)
# ----------------------------------------------------------------------------------------------
def _bin_centre(i: int) -> float:
    # OpenVLA's decode, by hand: bins = linspace(-1, 1, 256), centre of bin i = -1 + (2i + 1) / 255
    # for the token id vocab - 1 - i (the tiny model's base vocabulary is 1024, not 32000).
    return -1 + (2 * i + 1) / 255


@pytest.mark.parametrize("name", ["openvla", "openvla_oft"])
def test_rlds_gripper_is_mapped_as_the_official_libero_eval(name):
    # The official LIBERO evaluation: g = sign(2 a - 1) (normalize_gripper_action, binarised),
    # then g = -g (invert_gripper_action): +1 closes, -1 opens.
    kw = {"preset": "tiny", "norm_stats": bounds_stats(7), "chunk_size": 1, "seed": 0}
    if name == "openvla_oft":
        kw["action_head"] = "discrete"
    rlds = make_policy(name, gripper="rlds", **kw).processor
    env = make_policy(name, **kw).processor
    vocab = rlds.action_tokenizer.vocab_size
    bins = [249, 199, 149, 99, 9]  # centres 0.96, 0.56, 0.17, -0.22, -0.93
    ids = torch.full((len(bins), 1, 7), vocab - 128)
    ids[:, 0, -1] = torch.tensor([vocab - 1 - i for i in bins])
    mapped, raw = rlds.tokens_to_actions(ids), env.tokens_to_actions(ids)
    assert raw[:, 0, -1].tolist() == pytest.approx([_bin_centre(i) for i in bins])
    assert torch.equal(mapped[..., :6], raw[..., :6])
    expected = [-math.copysign(1.0, 2 * _bin_centre(i) - 1) for i in bins]
    assert mapped[:, 0, -1].tolist() == expected == [-1.0, -1.0, 1.0, 1.0, 1.0]
    # Demonstrations in the envs' convention train the RLDS model in its own: close -> 0, open
    # -> 1 (OFT's L1 head target too), and back.
    demo = torch.zeros(2, 1, 7)
    demo[:, 0, -1] = torch.tensor([1.0, -1.0])  # close, open
    assert rlds.normalize_actions(demo)[:, 0, -1].tolist() == [0.0, 1.0]
    assert rlds.tokens_to_actions(rlds.actions_to_tokens(demo))[:, 0, -1].tolist() == [1.0, -1.0]


def test_oft_l1_head_actions_get_the_gripper_mapping():
    proc = make_policy(
        "openvla_oft", preset="tiny", norm_stats=bounds_stats(7), gripper="rlds", seed=0
    ).processor
    x = torch.zeros(3, 1, 7)
    x[:, 0, -1] = torch.tensor([0.8, 0.2, -0.6])  # the gripper is not normalised (mask False)
    assert proc.unnormalize_actions(x)[:, 0, -1].tolist() == [-1.0, 1.0, 1.0]


def test_gripper_convention_comes_from_the_checkpoint(saved, tmp_path):
    config = json.loads((saved / "config.json").read_text())
    assert config["rlinf_vla"]["gripper"] == "env"  # recorded
    assert make_policy("openvla", checkpoint=str(saved)).config.gripper == "env"
    # An official checkpoint has no rlinf_vla section: its model speaks RLDS.
    official = tmp_path / "official"
    official.mkdir()
    for f in saved.iterdir():
        if f.is_file() and f.name != "rl_heads.safetensors":  # an official one has no RL heads
            (official / f.name).write_bytes(f.read_bytes())
    tiny = {"timm_kwargs": config["rlinf_vla"]["timm_kwargs"]}  # official files hold full dims
    del config["rlinf_vla"]
    (official / "config.json").write_text(json.dumps(config))
    assert make_policy("openvla", checkpoint=str(official), **tiny).config.gripper == "rlds"
    as_env = make_policy("openvla", checkpoint=str(official), gripper="env", **tiny)
    assert as_env.config.gripper == "env"
    # A checkpoint this package wrote before recording the convention: the envs'.
    config["rlinf_vla"] = tiny
    (official / "config.json").write_text(json.dumps(config))
    assert make_policy("openvla", checkpoint=str(official)).config.gripper == "env"
    # Saving an RLDS policy records it, so RL from an official checkpoint keeps it.
    rlds = tmp_path / "rlds"
    make_policy("openvla", preset="tiny", gripper="rlds", seed=0).save_pretrained(rlds)
    assert make_policy("openvla", checkpoint=str(rlds)).config.gripper == "rlds"


def test_unknown_gripper_convention_is_named():
    with pytest.raises(ValueError, match="gripper must be auto, rlds or env"):
        make_policy("openvla", preset="tiny", gripper="rdls")


# ----------------------------------------------------------------------------------------------
# Official LIBERO fine-tunes: center crop, RLDS image pipeline, unnorm key
# ----------------------------------------------------------------------------------------------
def _official_copy(saved, folder, norm_stats):
    """``saved`` as an official checkpoint: no rlinf_vla section, no RL heads, given stats."""
    folder.mkdir()
    for f in saved.iterdir():
        if f.is_file() and f.name != "rl_heads.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((saved / "config.json").read_text())
    tiny = {"timm_kwargs": config.pop("rlinf_vla")["timm_kwargs"]}
    config["norm_stats"] = norm_stats
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "dataset_statistics.json").write_text(json.dumps(norm_stats))
    return folder, tiny


def test_official_libero_finetune_gets_the_official_preprocessing(saved, tmp_path):
    stats = {"libero_spatial_no_noops": bounds_stats(7)["toy_dataset"]}
    path, tiny = _official_copy(saved, tmp_path / "libero", stats)
    cfg = make_policy("openvla", checkpoint=str(path), unnorm_key="libero_spatial", **tiny).config
    # run_libero_eval.py: center_crop asserted, unnorm key + "_no_noops", resize_image (rlds)
    assert cfg.center_crop is True and cfg.image_pipeline == "rlds"
    assert cfg.unnorm_key == "libero_spatial_no_noops"
    # an explicit setting is an explicit deviation
    off = make_policy("openvla", checkpoint=str(path), center_crop=False, **tiny).config
    assert off.center_crop is False
    torch_path = make_policy("openvla", checkpoint=str(path), image_pipeline="torch", **tiny)
    assert torch_path.config.image_pipeline == "torch"


def test_other_official_checkpoints_are_not_cropped(saved, tmp_path):
    stats = {"bridge_orig": bounds_stats(7)["toy_dataset"]}
    path, tiny = _official_copy(saved, tmp_path / "base", stats)
    cfg = make_policy("openvla", checkpoint=str(path), **tiny).config
    assert cfg.center_crop is False and cfg.image_pipeline == "rlds"
    # trained with image augmentation (the official eval's "image_aug" in the run name)
    aug, _ = _official_copy(saved, tmp_path / "openvla-7b+bridge--image_aug", stats)
    assert make_policy("openvla", checkpoint=str(aug), **tiny).config.center_crop is True


def test_checkpoint_written_here_keeps_its_recorded_preprocessing(tmp_path):
    stats = {"libero_spatial_no_noops": bounds_stats(7)["toy_dataset"]}
    make_policy("openvla", preset="tiny", norm_stats=stats, seed=0).save_pretrained(tmp_path)
    recorded = json.loads((tmp_path / "config.json").read_text())["rlinf_vla"]
    assert recorded["center_crop"] is False
    cfg = make_policy("openvla", checkpoint=str(tmp_path)).config
    assert cfg.center_crop is False  # recorded, though the stats name a LIBERO fine-tune
    assert cfg.image_pipeline == recorded.get("image_pipeline", "torch")

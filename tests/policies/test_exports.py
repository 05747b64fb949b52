"""Exports that load back into the official code.

π0 / π0.5: openpi serves a PyTorch checkpoint with ``safetensors.torch.load_model(PI0Pytorch(...),
"model.safetensors")`` (strict) and ``assets/<asset_id>/norm_stats.json``. The expected key set is
written out here from openpi's architecture (``pi0_pytorch.py``, ``gemma_pytorch.py`` on
transformers 4.53) for the tiny sizes, and openpi's strict load is replayed on a module with
exactly that state dict.

OpenVLA / OFT: transformers 4.40 (the official pin) must know the tokenizer class; the image
processor file keeps the checkpoint's normalisation; no ``auto_map`` names a file the folder lacks.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model, save_file
from torch import nn

from rlinf_vla.policies import make_policy
from rlinf_vla.policies.pi0.config import TINY_PI0
from rlinf_vla.policies.pi0.model import Pi0Policy
from rlinf_vla.policies.tokenizers import load_text_tokenizer
from tests.policies.conftest import make_obs
from tests.policies.test_contract import build as build_family

CAMERAS = ("main", "wrist")
PI0_STATS = {
    "actions": {
        "mean": [0.5 - 0.1 * i for i in range(7)],
        "std": [2.0 + 0.25 * i for i in range(7)],
        "q01": [-2.0 - i for i in range(7)],
        "q99": [3.0 + i for i in range(7)],
        "min": [-9.0] * 7,  # lerobot keeps these too; openpi's NormStats has no such field
        "max": [9.0] * 7,
    },
    "state": {"mean": [0.1] * 8, "std": [1.5] * 8, "q01": [-1.0] * 8, "q99": [1.0] * 8},
}


# -- π0 / π0.5 ------------------------------------------------------------------------------------
def openpi_state_dict_shapes(pi05: bool) -> dict[str, tuple[int, ...]]:
    """``PI0Pytorch(config).state_dict()`` names and shapes for the tiny sizes, from openpi's
    modules: ``PaliGemmaForConditionalGeneration`` (SigLIP under ``vision_tower.vision_model``,
    ``multi_modal_projector.linear``, Gemma ``language_model``, ``lm_head`` tied to
    ``embed_tokens``), the expert ``GemmaForCausalLM`` with ``embed_tokens = None`` (its
    ``lm_head`` stays, ``[vocab, width]``), π0.5's adaRMS norms (``dense`` only, no ``weight``),
    and the projections of ``PI0Pytorch.__init__`` (``state_proj`` reads ``action_dim`` dims)."""
    v, t, e = TINY_PI0["vision_config"], TINY_PI0["text_config"], TINY_PI0["expert_config"]
    dv, iv, dt, it, de, ie = (
        v["hidden_size"],
        v["intermediate_size"],
        t["hidden_size"],
        t["intermediate_size"],
        e["hidden_size"],
        e["intermediate_size"],
    )
    vocab, a = t["vocab_size"], TINY_PI0["max_action_dim"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    out: dict[str, tuple[int, ...]] = {}
    vis = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    out[vis + "embeddings.patch_embedding.weight"] = (dv, 3, v["patch_size"], v["patch_size"])
    out[vis + "embeddings.patch_embedding.bias"] = (dv,)
    out[vis + "embeddings.position_embedding.weight"] = (patches, dv)
    for i in range(v["num_hidden_layers"]):
        layer = f"{vis}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            out[f"{layer}{norm}.weight"] = out[f"{layer}{norm}.bias"] = (dv,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{layer}self_attn.{proj}.weight"] = (dv, dv)
            out[f"{layer}self_attn.{proj}.bias"] = (dv,)
        out[f"{layer}mlp.fc1.weight"], out[f"{layer}mlp.fc1.bias"] = (iv, dv), (iv,)
        out[f"{layer}mlp.fc2.weight"], out[f"{layer}mlp.fc2.bias"] = (dv, iv), (dv,)
    out[vis + "post_layernorm.weight"] = out[vis + "post_layernorm.bias"] = (dv,)
    pali = "paligemma_with_expert.paligemma."
    out[pali + "model.multi_modal_projector.linear.weight"] = (dt, dv)
    out[pali + "model.multi_modal_projector.linear.bias"] = (dt,)
    out[pali + "model.language_model.embed_tokens.weight"] = (vocab, dt)
    out[pali + "lm_head.weight"] = (vocab, dt)  # tied: one storage, two names

    def gemma(prefix: str, width: int, mlp: int, adarms: bool) -> None:
        heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        norm = {"dense.weight": (3 * width, width), "dense.bias": (3 * width,)}
        if not adarms:
            norm = {"weight": (width,)}
        for i in range(t["num_hidden_layers"]):
            layer = f"{prefix}layers.{i}."
            out[layer + "self_attn.q_proj.weight"] = (heads * hd, width)
            out[layer + "self_attn.k_proj.weight"] = (kv * hd, width)
            out[layer + "self_attn.v_proj.weight"] = (kv * hd, width)
            out[layer + "self_attn.o_proj.weight"] = (width, heads * hd)
            out[layer + "mlp.gate_proj.weight"] = out[layer + "mlp.up_proj.weight"] = (mlp, width)
            out[layer + "mlp.down_proj.weight"] = (width, mlp)
            for name in ("input_layernorm", "post_attention_layernorm"):
                for k, shape in norm.items():
                    out[f"{layer}{name}.{k}"] = shape
        for k, shape in norm.items():
            out[f"{prefix}norm.{k}"] = shape

    gemma(pali + "model.language_model.", dt, it, adarms=False)
    gemma("paligemma_with_expert.gemma_expert.model.", de, ie, adarms=pi05)
    out["paligemma_with_expert.gemma_expert.lm_head.weight"] = (vocab, de)
    linears = {"action_in_proj": (de, a), "action_out_proj": (a, de)}
    if pi05:
        linears |= {"time_mlp_in": (de, de), "time_mlp_out": (de, de)}
    else:
        linears |= {
            "state_proj": (de, a),
            "action_time_mlp_in": (de, 2 * de),
            "action_time_mlp_out": (de, de),
        }
    for name, shape in linears.items():
        out[f"{name}.weight"], out[f"{name}.bias"] = shape, (shape[0],)
    return out


class OpenpiSkeleton(nn.Module):
    """A module whose ``state_dict()`` is exactly ``shapes`` (tied ``lm_head`` / ``embed_tokens``
    sharing one parameter, as in openpi's model), for replaying openpi's strict load."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for key, shape in shapes.items():
            *path, leaf = key.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))
        pali = self.paligemma_with_expert.paligemma
        pali.lm_head.weight = pali.model.language_model.embed_tokens.weight


def build_pi0(name: str, **kw) -> Pi0Policy:
    return make_policy(name, preset="tiny", chunk_size=2, norm_stats=PI0_STATS, seed=0, **kw)


@pytest.fixture(scope="module")
def pi0_exports(tmp_path_factory):
    out = {}
    for name in ("pi0", "pi05"):
        policy = build_pi0(name, asset_id="physical-intelligence/libero")
        path = tmp_path_factory.mktemp(name)
        policy.save_pretrained(path)
        out[name] = (policy, path)
    return out


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_pi0_export_has_openpi_strict_key_set(pi0_exports, name):
    _, path = pi0_exports[name]
    assert not list(path.glob("model-*.safetensors"))  # one file: openpi reads no shards
    sd = load_file(str(path / "model.safetensors"))
    expected = openpi_state_dict_shapes(pi05=name == "pi05")
    # safetensors' save_model keeps one name of the tied pair: the alphabetically first
    del expected["paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"]
    assert sorted(set(sd) - set(expected)) == []
    assert sorted(set(expected) - set(sd)) == []
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert not sd["paligemma_with_expert.gemma_expert.lm_head.weight"].any()  # unused: zeros
    # openpi's loader: safetensors.torch.load_model(model, file), strict
    skeleton = OpenpiSkeleton(openpi_state_dict_shapes(pi05=name == "pi05"))
    load_model(skeleton, str(path / "model.safetensors"))
    embed = skeleton.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight
    torch.testing.assert_close(embed, sd["paligemma_with_expert.paligemma.lm_head.weight"])


def test_openpi_strict_load_replay_rejects_a_missing_key(pi0_exports, tmp_path):
    """The replay above fails the way openpi failed on earlier exports."""
    _, path = pi0_exports["pi0"]
    sd = load_file(str(path / "model.safetensors"))
    del sd["paligemma_with_expert.gemma_expert.lm_head.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError, match=re.escape("gemma_expert.lm_head.weight")):
        load_model(
            OpenpiSkeleton(openpi_state_dict_shapes(False)), str(tmp_path / "model.safetensors")
        )


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_pi0_export_norm_stats_in_openpi_assets(pi0_exports, name):
    _, path = pi0_exports[name]
    assert not (path / "norm_stats.json").exists()
    file = path / "assets" / "physical-intelligence" / "libero" / "norm_stats.json"
    data = json.loads(file.read_text())
    # openpi normalize.save: {"norm_stats": {key: NormStats(mean, std, q01, q99)}}
    want = {
        key: {k: PI0_STATS[key][k] for k in ("mean", "std", "q01", "q99")}
        for key in ("actions", "state")
    }
    assert data == {"norm_stats": want}


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_pi0_export_loads_back_with_identical_outputs(pi0_exports, name):
    policy, path = pi0_exports[name]
    loaded = make_policy(name, checkpoint=str(path))
    assert loaded.config.asset_id == "physical-intelligence/libero"
    assert (
        loaded.config.norm_stats
        == json.loads((path / "assets/physical-intelligence/libero/norm_stats.json").read_text())[
            "norm_stats"
        ]
    )
    obs = make_obs(2, CAMERAS, 8)
    a, b = policy.act(obs, greedy=True), loaded.act(obs, greedy=True)
    assert torch.equal(a.actions, b.actions)
    torch.testing.assert_close(a.value, b.value, rtol=0, atol=0)
    torch.manual_seed(5)
    sampled = policy.act(obs)
    torch.manual_seed(5)
    assert torch.equal(loaded.act(obs).actions, sampled.actions)
    ev1, ev2 = policy.evaluate(obs, sampled.replay), loaded.evaluate(obs, sampled.replay)
    torch.testing.assert_close(ev1.logprob, ev2.logprob, rtol=0, atol=0)


def test_pi0_export_asset_id_default_and_from_the_checkpoint(pi0_exports, tmp_path, caplog):
    _, path = pi0_exports["pi0"]
    # an openpi folder with one asset id: loading records it, an export writes it there again
    src = tmp_path / "openpi"
    shutil.copytree(path, src)
    shutil.rmtree(src / "assets")
    (src / "assets" / "trossen").mkdir(parents=True)
    shutil.copy(
        path / "assets/physical-intelligence/libero/norm_stats.json",
        src / "assets/trossen/norm_stats.json",
    )
    policy = make_policy("pi0", checkpoint=str(src))
    assert policy.config.asset_id == "trossen"
    policy.save_pretrained(tmp_path / "again")
    assert [p.parent.name for p in (tmp_path / "again/assets").rglob("norm_stats.json")] == [
        "trossen"
    ]
    # no asset id anywhere: "default", with a warning that names the option
    with caplog.at_level(logging.WARNING):
        build_pi0("pi0").save_pretrained(tmp_path / "plain")
    assert (tmp_path / "plain/assets/default/norm_stats.json").is_file()
    assert "set asset_id" in caplog.text
    # rlinf-vla sft: the dataset's name is the asset id
    cfg = Pi0Policy.statistics_config("pick_cube", PI0_STATS["actions"], None, {})
    assert cfg["asset_id"] == "pick_cube"


# -- OpenVLA / OpenVLA-OFT --------------------------------------------------------------------------
#: Tokenizer classes of ``transformers==4.40.1`` for Llama (``TOKENIZER_MAPPING_NAMES["llama"]``);
#: the released openvla-7b's ``tokenizer_config.json`` names ``LlamaTokenizer``.
TRANSFORMERS_440_LLAMA_TOKENIZERS = ("LlamaTokenizer", "LlamaTokenizerFast")
REMOTE_CODE = ("configuration_prismatic.py", "modeling_prismatic.py", "processing_prismatic.py")
#: non-default per-backbone normalisation (a checkpoint's rounded values, as the released ones)
MEANS = [[0.484375, 0.455078125, 0.40625], [0.5, 0.5, 0.5]]
STDS = [[0.228515625, 0.2236328125, 0.224609375], [0.5, 0.498046875, 0.5]]


def auto_map_modules(path: Path) -> dict[str, list[str]]:
    """Every module an ``auto_map`` of a JSON file in ``path`` names (``module.Class``)."""
    out = {}
    for file in path.glob("*.json"):
        data = json.loads(file.read_text())
        refs = (data.get("auto_map") or {}).values() if isinstance(data, dict) else []
        flat = [r for ref in refs for r in (ref if isinstance(ref, list) else [ref]) if r]
        out[file.name] = [re.sub(r"^.*--", "", r).rsplit(".", 1)[0] for r in flat]
    return out


@pytest.fixture(scope="module", params=["openvla", "openvla_oft"])
def vla_export(request, tmp_path_factory):
    policy = build_family(request.param)
    path = tmp_path_factory.mktemp(request.param)
    policy.save_pretrained(path)
    return request.param, policy, path


def test_vla_export_tokenizer_class_is_known_to_transformers_440(vla_export):
    _, policy, path = vla_export
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in TRANSFORMERS_440_LLAMA_TOKENIZERS
    assert "backend" not in config  # a transformers 5 key
    text = "In: What action should the robot take to pick up the cube?\nOut:"
    assert load_text_tokenizer(path)(text).input_ids == policy.processor.tokenizer(text).input_ids


def test_vla_export_names_no_unshipped_file(vla_export):
    _, _, path = vla_export
    for file, modules in auto_map_modules(path).items():
        assert [m for m in modules if not (path / f"{m}.py").is_file()] == [], file


def test_vla_export_copies_remote_code_from_its_checkpoint(vla_export, tmp_path):
    """A policy loaded from a folder with the official remote code (a released checkpoint)
    exports it, with the ``auto_map`` entries that name it."""
    name, _, path = vla_export
    src = tmp_path / "src"
    shutil.copytree(path, src)
    for f in REMOTE_CODE:
        (src / f).write_text(f"# {f} of the base checkpoint\n")
    make_policy(name, checkpoint=str(src)).save_pretrained(tmp_path / "out")
    out = tmp_path / "out"
    for f in REMOTE_CODE:
        assert (out / f).read_text() == f"# {f} of the base checkpoint\n"
    modules = auto_map_modules(out)
    assert sorted(modules["config.json"]) == ["configuration_prismatic", "modeling_prismatic"]
    assert set(modules["preprocessor_config.json"]) == {"processing_prismatic"}
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForVision2Seq"] == (
        "modeling_prismatic.OpenVLAForActionPrediction"
    )


def test_vla_export_keeps_the_checkpoint_image_normalisation(vla_export, tmp_path):
    name, _, path = vla_export
    src = tmp_path / "src"
    shutil.copytree(path, src)
    pre = json.loads((src / "preprocessor_config.json").read_text())
    pre["means"], pre["stds"] = MEANS, STDS
    pre["tvf_normalize_params"] = [
        {"mean": m, "std": s, "inplace": False} for m, s in zip(MEANS, STDS, strict=True)
    ]
    (src / "preprocessor_config.json").write_text(json.dumps(pre))
    make_policy(name, checkpoint=str(src)).save_pretrained(tmp_path / "out")
    out = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert out["means"] == MEANS and out["stds"] == STDS
    assert [p["mean"] for p in out["tvf_normalize_params"]] == MEANS
    assert [p["std"] for p in out["tvf_normalize_params"]] == STDS

"""What a π0 / π0.5 checkpoint folder supplies besides its weights: the normalisation
statistics (openpi ``assets/<asset_id>/norm_stats.json``, lerobot processor files, lerobot < 0.4
buffers), ``discrete_state_input``, and the SentencePiece tokenizer. The folders are written
here the way openpi and lerobot write them; expected values are computed by hand."""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlinf_vla.config import ConfigError
from rlinf_vla.policies import make_policy
from rlinf_vla.policies.pi0.config import TINY_PI0
from rlinf_vla.policies.pi0.model import Pi0Policy
from rlinf_vla.policies.resolve import policy_config_for
from rlinf_vla.policies.tokenizers import load_text_tokenizer
from tests.policies.test_contract import stats_for

A = 7  # env action dims
S = 8  # state dims
#: the tiny architecture; an official config.json names gemma_2b / gemma_300m instead
ARCH = {**TINY_PI0, "action_dim": A, "chunk_size": 2}
#: known statistics, one value per dim
Q01 = [-1.0 - i for i in range(A)]
Q99 = [2.0 + 0.5 * i for i in range(A)]
MEAN = [0.25 * i - 0.5 for i in range(A)]
STD = [1.5 + 0.1 * i for i in range(A)]
STATE = {"mean": [0.0] * S, "std": [1.0] * S, "q01": [-1.0] * S, "q99": [1.0] * S}
X = 0.5  # a model output, in normalised units


def quantile_unnorm(x: float) -> list[float]:
    """openpi ``Unnormalize`` with quantiles: ``(x + 1) / 2 * (q99 - q01 + 1e-6) + q01``."""
    return [(x + 1.0) / 2.0 * (hi - lo + 1e-6) + lo for lo, hi in zip(Q01, Q99, strict=True)]


def zscore_unnorm(x: float) -> list[float]:
    """lerobot ``MEAN_STD`` inverse ``x * std + mean`` (openpi adds 1e-6 to std)."""
    return [x * s + m for m, s in zip(MEAN, STD, strict=True)]


def unnormalised(policy) -> list[float]:
    out = policy.processor.unnormalize_actions(torch.full((1, 1, ARCH["max_action_dim"]), X))
    assert out.shape == (1, 1, A)
    return out[0, 0].tolist()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny π0 and π0.5 saved by this package: openpi's key names plus tokenizer files."""
    out = {}
    for name in ("pi0", "pi05"):
        path = tmp_path_factory.mktemp(name)
        make_policy(
            name, preset="tiny", chunk_size=2, norm_stats=stats_for(name), seed=0
        ).save_pretrained(path)
        out[name] = path
    return out


def copy_tokenizer(src, dst) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)


def openpi_folder(weights, name, dst, config_extra=None):
    """openpi's ``convert_jax_model_to_pytorch.py`` output: ``model.safetensors``, a
    ``config.json`` with five fields and the training run's ``assets/`` copied over."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(weights[name] / "model.safetensors", dst / "model.safetensors")
    config = {
        "action_dim": ARCH["max_action_dim"],
        "action_horizon": ARCH["action_horizon"],
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "precision": "float32",
        **(config_extra or {}),
    }
    (dst / "config.json").write_text(json.dumps(config))
    copy_tokenizer(weights[name], dst)
    return dst


def write_openpi_stats(folder, asset_id, actions) -> None:
    """``openpi.shared.normalize.save(assets / asset_id, ...)``."""
    d = folder / "assets" / asset_id
    d.mkdir(parents=True)
    (d / "norm_stats.json").write_text(
        json.dumps({"norm_stats": {"state": STATE, "actions": actions}}, indent=2)
    )


def lerobot_stats() -> dict[str, torch.Tensor]:
    """``NormalizerProcessorStep.state_dict()``: ``{feature}.{stat}`` over every dataset key."""
    out = {}
    for key, stats in (
        ("observation.state", {**STATE, "min": [-1.0] * S, "max": [1.0] * S}),
        ("action", {"mean": MEAN, "std": STD, "q01": Q01, "q99": Q99, "min": Q01, "max": Q99}),
    ):
        for stat, v in stats.items():
            out[f"{key}.{stat}"] = torch.tensor(v)
    out["observation.images.image.mean"] = torch.full((3, 1, 1), 0.5)
    return out


def lerobot_weights(weights, name, dst, extra=None):
    """``PreTrainedPolicy.save_pretrained``: ``model.`` prefixed keys and ``config.json``."""
    dst.mkdir(parents=True, exist_ok=True)
    sd = {f"model.{k}": v for k, v in load_file(str(weights[name] / "model.safetensors")).items()}
    save_file({**sd, **(extra or {})}, str(dst / "model.safetensors"))
    copy_tokenizer(weights[name], dst)


def lerobot_config(dst, name, mode) -> None:
    config = {
        "type": name,
        "chunk_size": ARCH["action_horizon"],
        "n_action_steps": ARCH["action_horizon"],
        "max_state_dim": ARCH["max_state_dim"],
        "max_action_dim": ARCH["max_action_dim"],
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode},
    }
    (dst / "config.json").write_text(json.dumps(config))


def lerobot_processor_folder(weights, name, dst, mode):
    """lerobot >= 0.4: ``policy_preprocessor.json`` / ``policy_postprocessor.json``
    (``DataProcessorPipeline._save_pretrained``) and one ``.safetensors`` per stateful step."""
    lerobot_weights(weights, name, dst)
    lerobot_config(dst, name, mode)
    norm = {
        "eps": 1e-8,
        "features": {
            "observation.state": {"type": "STATE", "shape": [S]},
            "action": {"type": "ACTION", "shape": [A]},
        },
        "norm_map": {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode},
    }
    tokenize = (
        {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}
        if name == "pi05"
        else {"registry_name": "pi0_new_line_processor", "config": {}}
    )
    pre = {
        "name": "policy_preprocessor",
        "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {
                "registry_name": "normalizer_processor",
                "config": norm,
                "state_file": "policy_preprocessor_step_2_normalizer_processor.safetensors",
            },
            tokenize,
            {"registry_name": "device_processor", "config": {"device": "cpu"}},
        ],
    }
    post = {
        "name": "policy_postprocessor",
        "steps": [
            {
                "registry_name": "unnormalizer_processor",
                "config": norm,
                "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors",
            },
            {"registry_name": "device_processor", "config": {"device": "cpu"}},
        ],
    }
    for pipeline in (pre, post):
        (dst / f"{pipeline['name']}.json").write_text(json.dumps(pipeline, indent=2))
        for step in pipeline["steps"]:
            if "state_file" in step:
                save_file(lerobot_stats(), str(dst / step["state_file"]))
    return dst


# -- normalisation statistics -----------------------------------------------------------------
def test_openpi_stats_two_levels_deep_are_found(weights, tmp_path):
    folder = openpi_folder(weights, "pi05", tmp_path / "pi05_libero")
    write_openpi_stats(folder, "physical-intelligence/libero", {"q01": Q01, "q99": Q99})
    policy = make_policy("pi05", checkpoint=str(folder), **ARCH)
    assert unnormalised(policy) == pytest.approx(quantile_unnorm(X), abs=1e-5)
    # the state is normalised with the same file's state entry: q01 -1, q99 1 -> identity
    assert policy.config.norm_stats["state"] == STATE


@pytest.mark.parametrize(
    ("name", "mode"), [("pi0", "MEAN_STD"), ("pi05", "QUANTILES"), ("pi05", "MEAN_STD")]
)
def test_lerobot_processor_stats_are_found(weights, tmp_path, name, mode):
    folder = lerobot_processor_folder(weights, name, tmp_path / name, mode)
    policy = make_policy(name, checkpoint=str(folder), **ARCH)
    expected = zscore_unnorm(X) if mode == "MEAN_STD" else quantile_unnorm(X)
    assert unnormalised(policy) == pytest.approx(expected, abs=1e-4)
    assert policy.config.normalization == ("zscore" if mode == "MEAN_STD" else "quantile")
    assert policy.config.norm_stats["state"]["q99"] == STATE["q99"]


def test_lerobot_buffer_stats_are_found_and_not_loaded_as_weights(weights, tmp_path):
    """lerobot < 0.4 (pi0 only): ``Normalize`` / ``Unnormalize`` buffers in
    ``model.safetensors`` (``buffer_`` + the feature name with ``_`` for ``.``)."""
    buffers = {
        "normalize_inputs.buffer_observation_state.mean": torch.zeros(S),
        "normalize_inputs.buffer_observation_state.std": torch.ones(S),
        "normalize_targets.buffer_action.mean": torch.tensor(MEAN),
        "normalize_targets.buffer_action.std": torch.tensor(STD),
        "unnormalize_outputs.buffer_action.mean": torch.tensor(MEAN),
        "unnormalize_outputs.buffer_action.std": torch.tensor(STD),
    }
    folder = tmp_path / "pi0_lerobot_03"
    lerobot_weights(weights, "pi0", folder, buffers)
    lerobot_config(folder, "pi0", "MEAN_STD")
    policy = make_policy("pi0", checkpoint=str(folder), **ARCH)
    assert unnormalised(policy) == pytest.approx(zscore_unnorm(X), abs=1e-4)
    assert policy.config.norm_stats["state"] == {"mean": [0.0] * S, "std": [1.0] * S}


def test_no_stats_fails_naming_the_places_and_the_key(weights, tmp_path):
    folder = openpi_folder(weights, "pi0", tmp_path / "bare")
    with pytest.raises(FileNotFoundError) as e:
        Pi0Policy.config_from_dir(folder, pi05=False, **ARCH)
    msg = str(e.value)
    for part in ("norm_stats=", "assets/<asset_id>/norm_stats.json", "policy_preprocessor"):
        assert part in msg
    with pytest.raises(ConfigError, match="norm_stats="):
        policy_config_for("pi0", {"checkpoint": str(folder), **ARCH})
    # norm_stats= a file path: the statistics come from there
    write_openpi_stats(tmp_path / "elsewhere", "x", {"mean": MEAN, "std": STD})
    file = tmp_path / "elsewhere" / "assets" / "x" / "norm_stats.json"
    cfg = Pi0Policy.config_from_dir(folder, pi05=False, norm_stats=str(file), **ARCH)
    assert cfg.norm_stats["actions"]["mean"] == MEAN


def test_several_asset_ids_need_asset_id(weights, tmp_path):
    folder = openpi_folder(weights, "pi05", tmp_path / "two")
    write_openpi_stats(folder, "trossen", {"q01": [0.0] * A, "q99": [1.0] * A})
    write_openpi_stats(folder, "physical-intelligence/libero", {"q01": Q01, "q99": Q99})
    with pytest.raises(ValueError, match="asset_id") as e:
        Pi0Policy.config_from_dir(folder, pi05=True, **ARCH)
    assert "'physical-intelligence/libero'" in str(e.value) and "'trossen'" in str(e.value)
    policy = make_policy(
        "pi05", checkpoint=str(folder), asset_id="physical-intelligence/libero", **ARCH
    )
    assert unnormalised(policy) == pytest.approx(quantile_unnorm(X), abs=1e-5)
    with pytest.raises(FileNotFoundError, match="trossen"):
        Pi0Policy.config_from_dir(folder, pi05=True, asset_id="droid", **ARCH)


def test_tiny_preset_without_checkpoint_needs_no_stats():
    policy = make_policy("pi05", preset="tiny", chunk_size=2, seed=0)
    assert policy.config.norm_stats is None
    x = torch.full((1, 1, policy.config.max_action_dim), X)
    assert torch.equal(policy.processor.unnormalize_actions(x), x[..., : policy.config.action_dim])


# -- discrete_state_input -----------------------------------------------------------------------
def test_pi05_openpi_checkpoint_without_record_uses_openpi_default(weights, tmp_path, caplog):
    """openpi ``Pi0Config.__post_init__``: ``discrete_state_input = pi05`` when unset; the
    converted ``config.json`` does not record it, so it is logged."""
    folder = openpi_folder(weights, "pi05", tmp_path / "pi05")
    write_openpi_stats(folder, "droid", {"q01": Q01, "q99": Q99})
    with caplog.at_level(logging.WARNING, logger="rlinf_vla.policies.pi0.model"):
        cfg = Pi0Policy.config_from_dir(folder, pi05=True, **ARCH)
    assert cfg.discrete_state_input is True
    assert "discrete_state_input" in caplog.text and "pi05_libero" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlinf_vla.policies.pi0.model"):
        cfg = Pi0Policy.config_from_dir(folder, pi05=True, discrete_state_input=False, **ARCH)
    assert cfg.discrete_state_input is False and caplog.text == ""


def test_pi05_checkpoint_record_wins(weights, tmp_path):
    folder = openpi_folder(
        weights, "pi05", tmp_path / "recorded", config_extra={"discrete_state_input": False}
    )
    write_openpi_stats(folder, "physical-intelligence/libero", {"q01": Q01, "q99": Q99})
    assert Pi0Policy.config_from_dir(folder, pi05=True, **ARCH).discrete_state_input is False
    # this package's own checkpoints record it in their rlinf_vla section
    ours = tmp_path / "ours"
    make_policy(
        "pi05",
        preset="tiny",
        chunk_size=2,
        norm_stats=stats_for("pi05"),
        discrete_state_input=False,
    ).save_pretrained(ours)
    assert make_policy("pi05", checkpoint=str(ours)).config.discrete_state_input is False
    # lerobot's PI0.5 processor always writes the state into the prompt
    lerobot = lerobot_processor_folder(weights, "pi05", tmp_path / "lerobot", "QUANTILES")
    assert Pi0Policy.config_from_dir(lerobot, pi05=True, **ARCH).discrete_state_input is True


# -- tokenizer ------------------------------------------------------------------------------------
def test_missing_sentencepiece_is_named(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import sentencepiece fails
    with pytest.raises(ImportError, match=r"`sentencepiece` package.*pip install sentencepiece"):
        load_text_tokenizer(tmp_path)


def test_sentencepiece_tokenizer_model_loads(tmp_path):
    """A real ``tokenizer.model`` (trained here, Gemma's special ids) loads with the
    ``sentencepiece`` dependency installed."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    lines = ["pick up the red block and put it in the basket", "open the drawer", "close the door"]
    corpus.write_text("\n".join(lines * 20))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        model_type="bpe",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tmp_path / "sp.model", folder / "tokenizer.model")
    tok = load_text_tokenizer(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    text = "pick up the red block"
    assert tok(text, add_special_tokens=False).input_ids == sp.encode(text)


@pytest.mark.parametrize("layout", ["openpi", "lerobot"])
def test_a_foreign_folder_is_read_at_the_published_sizes(weights, tmp_path, layout):
    """An openpi or lerobot config.json records the Gemma variants but neither the vision tower
    nor this package's heads: those are the published model's (the full preset), not the tiny
    preset's, which is only the default of a policy built without a checkpoint."""
    from rlinf_vla.policies.pi0.config import GEMMA_VARIANTS, SIGLIP_SO400M
    from rlinf_vla.policies.pi0.model import Pi0Policy

    if layout == "openpi":
        folder = openpi_folder(weights, "pi0", tmp_path / "pi0_base")
        write_openpi_stats(folder, "x", {"mean": MEAN, "std": STD})
    else:
        folder = lerobot_processor_folder(weights, "pi0", tmp_path / "pi0_lerobot", "MEAN_STD")
        config = json.loads((folder / "config.json").read_text())
        config |= {"paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
        (folder / "config.json").write_text(json.dumps(config))
    cfg = Pi0Policy.config_from_dir(folder, chunk_size=2)  # the fixture horizon is 4
    assert cfg.preset == "full"
    assert cfg.text_config["hidden_size"] == GEMMA_VARIANTS["gemma_2b"]["hidden_size"] == 2048
    assert cfg.expert_config["hidden_size"] == GEMMA_VARIANTS["gemma_300m"]["hidden_size"]
    assert cfg.vision_config["hidden_size"] == SIGLIP_SO400M["hidden_size"]
    # a tiny folder of this package's own keeps its sizes (its config records them)
    assert Pi0Policy.config_from_dir(weights["pi0"]).text_config["hidden_size"] == 64

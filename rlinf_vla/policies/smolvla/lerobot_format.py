"""lerobot 0.4's SmolVLA folder: ``config.json`` fields <-> :class:`SmolVLAConfig`, and the
``policy_preprocessor`` / ``policy_postprocessor`` pipelines that carry the statistics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlinf_vla.policies.smolvla.config import NOT_SAVED, SmolVLAConfig

__all__ = ["EXTRA_FILE", "IMAGE_PREFIX", "config_kwargs", "write_config", "write_processors"]

#: This package's settings beside lerobot's ``config.json`` (value head, RL, cameras, ...).
EXTRA_FILE = "rlinf_vla.json"

IMAGE_PREFIX = "observation.images."
STATE_KEY = "observation.state"
ACTION_KEY = "action"
#: lerobot's padding camera slots (``SmolVLAConfig.validate_features`` adds them).
EMPTY_CAMERA = IMAGE_PREFIX + "empty_camera_"
#: lerobot ``NormalizationMode`` <-> :attr:`SmolVLAConfig.normalization`.
_MODES = {"MEAN_STD": "zscore", "QUANTILES": "quantile"}
#: lerobot field -> ours, for the fields that mean the same.
_SAME = {
    "chunk_size": "action_horizon",
    "n_action_steps": "chunk_size",
    "max_state_dim": "max_state_dim",
    "max_action_dim": "max_action_dim",
    "num_steps": "num_steps",
    "resize_imgs_with_padding": "resize_imgs_with_padding",
    "empty_cameras": "num_empty_cameras",
    "tokenizer_max_length": "tokenizer_max_length",
    "pad_language_to": "pad_language_to",
    "prefix_length": "prefix_length",
    "vlm_model_name": "vlm_model_name",
    "num_vlm_layers": "num_vlm_layers",
    "num_expert_layers": "num_expert_layers",
    "self_attn_every_n_layers": "self_attn_every_n_layers",
    "expert_width_multiplier": "expert_width_multiplier",
    "attention_mode": "attention_mode",
    "min_period": "min_period",
    "max_period": "max_period",
}
#: lerobot options this port does not implement (their value when off).
_NOT_PORTED = {
    "adapt_to_pi_aloha": False,
    "use_delta_joint_actions_aloha": False,
    "add_image_special_tokens": False,
}


def config_kwargs(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """:class:`SmolVLAConfig` arguments of a lerobot ``config.json``: the architecture and
    inputs, ``action_dim`` from the action feature, ``image_keys`` from the image features
    (``observation.images.<key>``, lerobot's empty camera slots left out), and the features
    themselves for the export.

    Raises:
        NotImplementedError: the checkpoint turns on an option that is not ported.
    """
    for key, off in _NOT_PORTED.items():
        if data.get(key, off) != off:
            raise NotImplementedError(f"{path}: lerobot's SmolVLA option {key}={data[key]!r}")
    kwargs = {ours: data[theirs] for theirs, ours in _SAME.items() if data.get(theirs) is not None}
    inputs = data.get("input_features") or {}
    outputs = data.get("output_features") or {}
    cameras = [k for k in inputs if k.startswith(IMAGE_PREFIX) and not k.startswith(EMPTY_CAMERA)]
    if cameras:
        kwargs["image_keys"] = tuple(k[len(IMAGE_PREFIX) :] for k in cameras)
    if ACTION_KEY in outputs:
        kwargs["action_dim"] = int(outputs[ACTION_KEY]["shape"][0])
    if inputs or outputs:
        kwargs["lerobot_features"] = {"input_features": inputs, "output_features": outputs}
    mapping = data.get("normalization_mapping") or {}
    modes = {mapping.get(k) for k in ("STATE", "ACTION")} - {None, "IDENTITY"}
    if len(modes) > 1 or not modes <= set(_MODES):
        raise NotImplementedError(
            f"{path}: normalisation {mapping} (this port: one of {sorted(_MODES)} for both the "
            "state and the actions)"
        )
    if modes:
        kwargs["normalization"] = _MODES[modes.pop()]
    return kwargs


def _features(cfg: SmolVLAConfig) -> dict[str, dict[str, Any]]:
    """The checkpoint's features when it had some, else ones that fit the config: cameras at
    the resize target, the state of the statistics' size."""
    if cfg.lerobot_features is not None:
        return json.loads(json.dumps(cfg.lerobot_features))
    if cfg.resize_imgs_with_padding is not None:
        width, height = cfg.resize_imgs_with_padding
    else:
        width = height = int(cfg.vlm_config["vision_config"]["image_size"])
    image = {"type": "VISUAL", "shape": [3, height, width]}
    inputs = {f"{IMAGE_PREFIX}{k}": dict(image) for k in cfg.image_keys}
    state = (cfg.norm_stats or {}).get("state")
    state_dim = len(state["mean"]) if state and "mean" in state else cfg.max_state_dim
    inputs[STATE_KEY] = {"type": "STATE", "shape": [state_dim]}
    for i in range(cfg.num_empty_cameras):
        inputs[f"{EMPTY_CAMERA}{i}"] = {"type": "VISUAL", "shape": [3, 480, 640]}
    outputs = {ACTION_KEY: {"type": "ACTION", "shape": [cfg.action_dim]}}
    return {"input_features": inputs, "output_features": outputs}


def _norm_map(cfg: SmolVLAConfig) -> dict[str, str]:
    mode = {v: k for k, v in _MODES.items()}[cfg.normalization]
    return {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}


def write_config(path: Path, cfg: SmolVLAConfig) -> None:
    """lerobot's ``config.json`` (``type: smolvla``; the training-only fields at lerobot's
    defaults; lerobot reads it strictly) and this package's other settings in
    :data:`EXTRA_FILE`."""
    features = _features(cfg)
    theirs = {ours: theirs for theirs, ours in _SAME.items()}
    value = {theirs[k]: getattr(cfg, k) for k in theirs}
    if value["resize_imgs_with_padding"] is not None:
        value["resize_imgs_with_padding"] = list(value["resize_imgs_with_padding"])
    data = {
        "type": "smolvla",
        "n_obs_steps": 1,
        **features,
        "device": str(cfg.device).split(":")[0],
        "use_amp": False,
        "use_peft": False,
        "push_to_hub": False,
        "repo_id": None,
        "private": None,
        "tags": None,
        "license": None,
        "pretrained_path": None,
        "chunk_size": value["chunk_size"],
        "n_action_steps": value["n_action_steps"],
        "normalization_mapping": _norm_map(cfg),
        "max_state_dim": value["max_state_dim"],
        "max_action_dim": value["max_action_dim"],
        "resize_imgs_with_padding": value["resize_imgs_with_padding"],
        "empty_cameras": value["empty_cameras"],
        "adapt_to_pi_aloha": False,
        "use_delta_joint_actions_aloha": False,
        "tokenizer_max_length": value["tokenizer_max_length"],
        "num_steps": value["num_steps"],
        "use_cache": True,
        "freeze_vision_encoder": True,
        "train_expert_only": True,
        "train_state_proj": True,
        "optimizer_lr": 0.0001,
        "optimizer_betas": [0.9, 0.95],
        "optimizer_eps": 1e-08,
        "optimizer_weight_decay": 1e-10,
        "optimizer_grad_clip_norm": 10,
        "scheduler_warmup_steps": 1000,
        "scheduler_decay_steps": 30000,
        "scheduler_decay_lr": 2.5e-06,
        "vlm_model_name": value["vlm_model_name"],
        "load_vlm_weights": False,
        "add_image_special_tokens": False,
        "attention_mode": value["attention_mode"],
        "prefix_length": value["prefix_length"],
        "pad_language_to": value["pad_language_to"],
        "num_expert_layers": value["num_expert_layers"],
        "num_vlm_layers": value["num_vlm_layers"],
        "self_attn_every_n_layers": value["self_attn_every_n_layers"],
        "expert_width_multiplier": value["expert_width_multiplier"],
        "min_period": value["min_period"],
        "max_period": value["max_period"],
        "rtc_config": None,
        "compile_model": False,
        "compile_mode": "max-autotune",
    }
    (path / "config.json").write_text(json.dumps(data, indent=4))
    ours = {k: v for k, v in cfg.to_dict().items() if k not in NOT_SAVED and k not in theirs}
    (path / EXTRA_FILE).write_text(json.dumps(ours, indent=2))


def write_processors(path: Path, cfg: SmolVLAConfig) -> None:
    """lerobot's SmolVLA pipelines (rename, batch, newline, tokenizer, device, normaliser /
    un-normaliser, device) with the statistics in their ``state_file``."""
    import torch
    from safetensors.torch import save_file

    features = _features(cfg)
    stats = cfg.norm_stats or {}
    tensors = {}
    for ours, theirs in (("state", STATE_KEY), ("actions", ACTION_KEY)):
        for stat, values in (stats.get(ours) or {}).items():
            tensors[f"{theirs}.{stat}"] = torch.tensor(values, dtype=torch.float32)
    device = {"device": str(cfg.device).split(":")[0], "float_dtype": None}
    norm = {"eps": 1e-08, "norm_map": _norm_map(cfg)}
    pre_file = "policy_preprocessor_step_5_normalizer_processor.safetensors"
    post_file = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    pre = {
        "name": "policy_preprocessor",
        "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {"registry_name": "smolvla_new_line_processor", "config": {}},
            {
                "registry_name": "tokenizer_processor",
                "config": {
                    "max_length": cfg.tokenizer_max_length,
                    "task_key": "task",
                    "padding_side": "right",
                    "padding": cfg.pad_language_to,
                    "truncation": True,
                    "tokenizer_name": cfg.vlm_model_name,
                },
            },
            {"registry_name": "device_processor", "config": device},
            {
                "registry_name": "normalizer_processor",
                "config": {
                    "eps": norm["eps"],
                    "features": {**features["input_features"], **features["output_features"]},
                    "norm_map": norm["norm_map"],
                },
                "state_file": pre_file,
            },
        ],
    }
    post = {
        "name": "policy_postprocessor",
        "steps": [
            {
                "registry_name": "unnormalizer_processor",
                "config": {
                    "eps": norm["eps"],
                    "features": features["output_features"],
                    "norm_map": norm["norm_map"],
                },
                "state_file": post_file,
            },
            {"registry_name": "device_processor", "config": device},
        ],
    }
    save_file(tensors, str(path / pre_file))
    save_file(tensors, str(path / post_file))
    (path / "policy_preprocessor.json").write_text(json.dumps(pre, indent=2))
    (path / "policy_postprocessor.json").write_text(json.dumps(post, indent=2))

"""π0 / π0.5 transforms: images -> ``[-1, 1]`` slots with masks, prompt tokens, state and
action (un)normalisation (openpi's model transforms)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.policies.base import require_cameras
from rlinf_vla.policies.pi0.config import Pi0Config
from rlinf_vla.policies.tokenizers import (
    build_offline_tokenizer,
    has_tokenizer_files,
    load_text_tokenizer,
)
from rlinf_vla.policies.transforms import (
    Identity,
    Quantile,
    ZScore,
    images_to_float,
    resize_with_pad,
)
from rlinf_vla.types import Observation

__all__ = [
    "NORM_STATS_LOCATIONS",
    "CheckpointNormStats",
    "Pi0Inputs",
    "Pi0Processor",
    "discretize_state",
    "find_norm_stats",
    "openpi_asset_ids",
    "read_openpi_norm_stats",
    "write_openpi_norm_stats",
]


def discretize_state(state: Tensor) -> Tensor:
    """π0.5's state tokens: ``digitize(state, linspace(-1, 1, 257)[:-1]) - 1`` in ``0..255``."""
    bins = torch.linspace(-1.0, 1.0, 257, dtype=torch.float64)[:-1]
    return torch.bucketize(state.double(), bins, right=True) - 1


#: Where :func:`find_norm_stats` looks, in this order (for error messages and the docs).
NORM_STATS_LOCATIONS = (
    "norm_stats.json at the top (checkpoints of earlier versions of this package)",
    "assets/<asset_id>/norm_stats.json at any depth (openpi and this package's save_pretrained; "
    "the asset id may hold a '/')",
    "policy_postprocessor*.json / policy_preprocessor*.json with their normalizer .safetensors "
    "(lerobot >= 0.4)",
    "normalize_inputs.* / normalize_targets.* / unnormalize_outputs.* buffers in "
    "model*.safetensors (lerobot < 0.4)",
)
#: lerobot ``NormalizationMode`` -> :attr:`Pi0Config.normalization`.
_LEROBOT_MODES = {"MEAN_STD": "zscore", "QUANTILES": "quantile"}
#: lerobot's feature names of the state and the actions, by our stats keys.
_LEROBOT_KEYS = {"state": "observation.state", "actions": "action"}
#: Module prefixes of lerobot < 0.4's normalisation buffers in ``model.safetensors``.
LEROBOT_BUFFER_PREFIXES = ("normalize_inputs.", "normalize_targets.", "unnormalize_outputs.")


@dataclass(frozen=True)
class CheckpointNormStats:
    """Normalisation statistics found in a checkpoint folder.

    Attributes:
        stats: openpi layout ``{"state": {...}, "actions": {...}}`` (``mean``, ``std``, ``q01``,
            ``q99``, ... as lists).
        source: the file(s) they were read from.
        normalization: ``zscore`` / ``quantile`` when the files record the mode (lerobot's
            ``norm_map`` / ``normalization_mapping``), else ``None`` (openpi: by model).
        asset_id: the openpi asset id of ``assets/<asset_id>/norm_stats.json``, else ``None``.
    """

    stats: dict[str, Any]
    source: str
    normalization: str | None = None
    asset_id: str | None = None


def read_openpi_norm_stats(file: Path) -> dict[str, Any]:
    """One openpi ``norm_stats.json`` (``{"norm_stats": {...}}``, or the bare inner dict)."""
    data = json.loads(Path(file).read_text())
    return data.get("norm_stats", data)


#: The statistics openpi's ``NormStats`` holds (``mean`` and ``std`` are required there).
OPENPI_STATS = ("mean", "std", "q01", "q99")


def write_openpi_norm_stats(path: Path, asset_id: str, stats: dict[str, Any]) -> Path:
    """Write ``stats`` (``{"state": {...}, "actions": {...}}``) where openpi's serving reads
    them, ``path/assets/<asset_id>/norm_stats.json``, in the layout of openpi's
    ``normalize.save``: ``{"norm_stats": {key: {"mean", "std", "q01", "q99"}}}`` (other
    statistics, e.g. lerobot's ``min`` / ``max``, are left out). Returns the file."""
    out = {
        key: {k: [float(x) for x in value[k]] for k in OPENPI_STATS if value.get(k) is not None}
        for key, value in stats.items()
    }
    file = Path(path) / "assets" / asset_id / "norm_stats.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"norm_stats": out}, indent=2))
    return file


def openpi_asset_ids(path: Path) -> list[str]:
    """The asset ids of ``path/assets``: every folder below it that holds a
    ``norm_stats.json`` (openpi writes ``assets/<asset_id>/``, and a dataset repo id such as
    ``physical-intelligence/libero`` is two folders deep)."""
    assets = path / "assets"
    return sorted(f.parent.relative_to(assets).as_posix() for f in assets.rglob("norm_stats.json"))


def find_norm_stats(path: Path, asset_id: str | None = None) -> CheckpointNormStats | None:
    """The statistics kept in checkpoint folder ``path``, looked for in the places of
    :data:`NORM_STATS_LOCATIONS` in that order; ``None`` when there are none.

    With ``asset_id`` only ``assets/<asset_id>/norm_stats.json`` is read (openpi's
    ``AssetsConfig.asset_id``).

    Raises:
        FileNotFoundError: ``asset_id`` names no stats file (the known ids are listed).
        ValueError: several asset ids and no ``asset_id``, or lerobot files with a mode that
            has no equivalent here.
    """
    path = Path(path)
    if asset_id is not None:
        file = path / "assets" / asset_id / "norm_stats.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"asset_id={asset_id!r}: no {file}; asset ids in {path}: {openpi_asset_ids(path)}"
            )
        return CheckpointNormStats(read_openpi_norm_stats(file), str(file), asset_id=asset_id)
    top = path / "norm_stats.json"
    if top.is_file():
        return CheckpointNormStats(read_openpi_norm_stats(top), str(top))
    ids = openpi_asset_ids(path)
    if len(ids) > 1:
        raise ValueError(
            f"{path}/assets holds normalisation statistics for several asset ids {ids}: set "
            "asset_id=<one of them> (the one the policy was trained with)"
        )
    if ids:
        file = path / "assets" / ids[0] / "norm_stats.json"
        return CheckpointNormStats(read_openpi_norm_stats(file), str(file), asset_id=ids[0])
    return _lerobot_processor_stats(path) or _lerobot_buffer_stats(path)


def _lerobot_mode(modes: dict[str, Any], source: str) -> str | None:
    """One :attr:`Pi0Config.normalization` from lerobot's per-feature modes (``STATE`` and
    ``ACTION``; ``None`` when neither is recorded)."""
    used = {modes[k] for k in ("STATE", "ACTION") if modes.get(k) not in (None, "IDENTITY")}
    unknown = sorted(used - set(_LEROBOT_MODES))
    if unknown or len(used) > 1:
        raise ValueError(
            f"{source}: lerobot normalisation modes {modes} are not supported here (one of "
            f"{sorted(_LEROBOT_MODES)} for both state and action): set norm_stats= and "
            "normalization= explicitly"
        )
    return _LEROBOT_MODES[used.pop()] if used else None


def _lerobot_processor_stats(path: Path) -> CheckpointNormStats | None:
    """lerobot >= 0.4: a ``DataProcessorPipeline`` saved as ``<name>.json`` (``{"name",
    "steps": [{"registry_name", "config", "state_file"}]}``) whose (un)normalizer steps keep
    ``{feature}.{stat}`` tensors in ``state_file`` and the modes in ``config.norm_map``. The
    post-processor (which un-normalises the actions at inference) is read first."""
    from safetensors.torch import load_file

    stats: dict[str, dict[str, Any]] = {}
    modes: dict[str, Any] = {}
    sources: list[str] = []
    files = [
        *sorted(path.glob("policy_postprocessor*.json")),
        *sorted(path.glob("policy_preprocessor*.json")),
    ]
    for file in files:
        data = json.loads(file.read_text())
        for step in data.get("steps", []) if isinstance(data, dict) else []:
            norm_map = (step.get("config") or {}).get("norm_map")
            if norm_map is None or not step.get("state_file"):
                continue
            tensors = load_file(str(path / step["state_file"]))
            for ours, theirs in _LEROBOT_KEYS.items():
                part = {
                    k.rsplit(".", 1)[1]: v.tolist()
                    for k, v in tensors.items()
                    if k.rsplit(".", 1)[0] == theirs
                }
                feature = "STATE" if ours == "state" else "ACTION"
                if part and ours not in stats and norm_map.get(feature, "IDENTITY") != "IDENTITY":
                    stats[ours] = part
                    modes[feature] = norm_map[feature]
                    sources.append(str(path / step["state_file"]))
    if "actions" not in stats:
        return None
    source = ", ".join(dict.fromkeys(sources))
    return CheckpointNormStats(stats, source, _lerobot_mode(modes, source))


def _lerobot_buffer_stats(path: Path) -> CheckpointNormStats | None:
    """lerobot < 0.4: ``Normalize`` / ``Unnormalize`` modules of the policy keep
    ``buffer_{feature with '.' -> '_'}.{stat}`` in ``model.safetensors`` (filled with ``inf``
    when the policy was built without statistics); the modes are ``config.json``'s
    ``normalization_mapping``."""
    from safetensors import safe_open

    found: dict[str, dict[str, dict[str, Any]]] = {}
    for file in sorted(path.glob("model*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if not key.startswith(LEROBOT_BUFFER_PREFIXES):
                    continue
                module, buffer, stat = key.split(".", 2)
                value = f.get_tensor(key)
                if torch.isfinite(value).all():
                    found.setdefault(buffer, {}).setdefault(module, {})[stat] = value.tolist()
    stats: dict[str, Any] = {}
    for ours, theirs in _LEROBOT_KEYS.items():
        by_module = found.get("buffer_" + theirs.replace(".", "_"), {})
        for module in ("unnormalize_outputs", "normalize_targets", "normalize_inputs"):
            if module in by_module:
                stats[ours] = by_module[module]
                break
    if "actions" not in stats:
        return None
    config = path / "config.json"
    mapping = (
        json.loads(config.read_text()).get("normalization_mapping") if config.exists() else None
    )
    if mapping is None:  # lerobot's PI0Config default
        mapping = {"STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    source = f"{path}/model*.safetensors ({', '.join(LEROBOT_BUFFER_PREFIXES)}*)"
    return CheckpointNormStats(stats, source, _lerobot_mode(mapping, source))


@dataclass
class Pi0Inputs:
    """Model inputs of one batch.

    Attributes:
        images: ``float32 [B, n_slots, 3, S, S]`` in ``[-1, 1]``.
        image_masks: ``bool [B, n_slots]`` (False for the empty slots).
        tokens: ``long [B, max_token_len]`` prompt ids, padded with 0.
        token_mask: ``bool [B, max_token_len]``.
        state: ``float32 [B, max_state_dim]`` normalised and zero-padded (π0's state token).
    """

    images: Tensor
    image_masks: Tensor
    tokens: Tensor
    token_mask: Tensor
    state: Tensor


class Pi0Processor:
    """The frozen transforms around the π0 model.

    Args:
        config: the policy config.
        tokenizer: a tokenizer with the PaliGemma layout (BOS prepended by ``tokenizer(text)``).
    """

    def __init__(self, config: Pi0Config, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.policy_name = "pi05" if config.pi05 else "pi0"
        stats = config.norm_stats or {}
        norm = {"zscore": ZScore, "quantile": Quantile}[config.normalization]
        self.action_norm = norm(stats["actions"]) if "actions" in stats else Identity()
        self.state_norm = norm(stats["state"]) if "state" in stats else Identity()
        self.bos_id = int(tokenizer.bos_token_id)

    @classmethod
    def make_tokenizer(cls, config: Pi0Config, checkpoint: Path | None = None) -> Any:
        """``config.tokenizer``, else the checkpoint's tokenizer files, else an offline tokenizer
        with the Gemma special-token layout and the configured vocabulary size (official π0
        checkpoints ship no tokenizer: point ``tokenizer=`` at a PaliGemma tokenizer folder)."""
        for candidate in (config.tokenizer, checkpoint):
            if candidate is not None and has_tokenizer_files(candidate):
                return load_text_tokenizer(candidate)
        if checkpoint is not None:
            raise FileNotFoundError(
                f"{checkpoint} has no tokenizer files: set tokenizer=<folder with the PaliGemma "
                "tokenizer.model or tokenizer.json> (openpi downloads it from "
                "gs://big_vision/paligemma_tokenizer.model)"
            )
        return build_offline_tokenizer(int(config.text_config["vocab_size"]), "gemma")

    # -- inputs ---------------------------------------------------------------------------------
    def images(
        self, obs: Observation, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """Image slots ``float32 [B, n_slots, 3, S, S]`` in ``[-1, 1]`` and their mask; with
        ``device`` the ``uint8`` images move there first and the transforms run there."""
        cfg = self.config
        require_cameras(obs, cfg.image_keys, self.policy_name)
        size = cfg.image_size
        slots = [
            resize_with_pad(images_to_float(obs.images[k].to(device)), size) * 2 - 1
            for k in cfg.image_keys
        ]
        b = obs.batch_size
        empty = torch.full((b, 3, size, size), -1.0, device=slots[0].device)
        slots += [empty] * cfg.num_empty_cameras
        masks = torch.zeros(b, len(slots), dtype=torch.bool)
        masks[:, : len(cfg.image_keys)] = True
        return torch.stack(slots, dim=1), masks

    def state(self, obs: Observation) -> Tensor:
        """Normalised state zero-padded to ``max_state_dim`` (zeros when the env has none)."""
        cfg = self.config
        b = obs.batch_size
        out = torch.zeros(b, cfg.max_state_dim)
        if obs.state is None:
            if cfg.discrete_state_input or not cfg.pi05:
                raise KeyError(
                    f"policy {self.policy_name!r} needs proprioception (obs.state), "
                    "the observation has None"
                )
            return out
        if obs.state.shape[-1] > cfg.max_state_dim:
            raise ValueError(
                f"obs.state has {obs.state.shape[-1]} dims, more than max_state_dim="
                f"{cfg.max_state_dim}"
            )
        state = self.state_norm.normalize(obs.state.cpu())
        out[:, : state.shape[-1]] = state
        return out

    def prompt_ids(self, instruction: str, state: Tensor | None) -> list[int]:
        """openpi's ``PaligemmaTokenizer.tokenize``: π0 ``BOS text \\n``; π0.5 with discrete
        state ``BOS "Task: {text}, State: {s0 s1 ...};\\nAction: "``."""
        text = instruction.strip().replace("_", " ").replace("\n", " ")
        if state is not None:
            state_str = " ".join(str(int(s)) for s in discretize_state(state))
            ids = list(self.tokenizer(f"Task: {text}, State: {state_str};\nAction: ").input_ids)
        else:
            ids = list(self.tokenizer(text).input_ids)
            ids += list(self.tokenizer("\n", add_special_tokens=False).input_ids)
        if ids[0] != self.bos_id:
            ids = [self.bos_id, *ids]
        return ids[: self.config.max_token_len]

    def __call__(self, obs: Observation, device: torch.device | str | None = None) -> Pi0Inputs:
        """The model inputs of ``obs``; with ``device`` the images are transformed there (the
        prompt ids and the state stay in host memory)."""
        cfg = self.config
        images, masks = self.images(obs, device)
        state = self.state(obs)
        n = cfg.max_token_len
        tokens = torch.zeros(obs.batch_size, n, dtype=torch.long)
        token_mask = torch.zeros(obs.batch_size, n, dtype=torch.bool)
        for i, text in enumerate(obs.instruction):
            raw = state[i, : obs.state.shape[-1]] if cfg.discrete_state_input else None
            ids = self.prompt_ids(text, raw)
            tokens[i, : len(ids)] = torch.tensor(ids)
            token_mask[i, : len(ids)] = True
        return Pi0Inputs(images, masks, tokens, token_mask, state)

    # -- outputs --------------------------------------------------------------------------------
    def unnormalize_actions(self, actions: Tensor) -> Tensor:
        """Model actions ``[B, K, max_action_dim]`` -> env actions ``[B, K, action_dim]``."""
        return self.action_norm.unnormalize(actions[..., : self.config.action_dim])

    def normalize_actions(self, actions: Tensor) -> Tensor:
        """Env actions ``[B, K, A]`` -> normalised, zero-padded to ``max_action_dim``."""
        x = self.action_norm.normalize(actions)
        pad = self.config.max_action_dim - x.shape[-1]
        return torch.nn.functional.pad(x, (0, pad))

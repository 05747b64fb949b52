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

__all__ = ["Pi0Inputs", "Pi0Processor", "discretize_state", "load_openpi_norm_stats"]


def discretize_state(state: Tensor) -> Tensor:
    """π0.5's state tokens: ``digitize(state, linspace(-1, 1, 257)[:-1]) - 1`` in ``0..255``."""
    bins = torch.linspace(-1.0, 1.0, 257, dtype=torch.float64)[:-1]
    return torch.bucketize(state.double(), bins, right=True) - 1


def load_openpi_norm_stats(path: Path) -> dict[str, Any] | None:
    """``norm_stats.json`` (openpi layout ``{"norm_stats": {...}}``) from the folder or from
    its single ``assets/<asset_id>/`` subfolder; ``None`` when there is none."""
    candidates = [path / "norm_stats.json", *sorted(path.glob("assets/*/norm_stats.json"))]
    found = [c for c in candidates if c.exists()]
    if not found:
        return None
    if len(found) > 1 and found[0] != path / "norm_stats.json":
        raise ValueError(f"several norm_stats.json under {path}: {[str(f) for f in found]}")
    data = json.loads(found[0].read_text())
    return data.get("norm_stats", data)


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

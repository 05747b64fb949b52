"""OpenVLA-OFT: one bidirectional forward pass decodes a whole action chunk.

Sequence (moojink/openvla-oft ``predict_action``)::

    [BOS] + patches(main) + patches(wrist) + proprio token + prompt[1:] (ends with ▁)
          + K*A zero-embedded action placeholders + STOP (</s>)

with **bidirectional** attention over all tokens (OFT's transformers fork; ``is_causal=False``
here). The action features are the last hidden states at the ``K*A`` positions starting at the
prompt's last token (``NUM_PATCHES + NUM_PROMPT_TOKENS``), i.e. shifted by one as in a causal LM.

Two action heads:

- ``discrete``: the LM head's logits restricted to the 256 action ids; categorical per token
  (temperature, top-k), as RLinf's OFT.
- ``l1_gaussian``: the upstream ``L1RegressionActionHead`` (``MLPResNet`` on the ``A`` features
  of each action concatenated) gives the mean in normalised units; a learnable per-dim log-std
  makes it a Gaussian policy. Samples are clipped to ``[-1, 1]`` before un-normalisation (the
  greedy mean with ``clip_greedy``); the log-prob is that of the executed action: the density
  inside the range, the clipped mass at a bound (:func:`clipped_gaussian_logprob`, computed from
  the unclipped sample kept in ``replay``).

Checkpoint pieces as OFT's ``finetune.py`` writes them: the merged model (OpenVLA layout),
``action_head--<step>_checkpoint.pt``, ``proprio_projector--<step>_checkpoint.pt`` and the peft
``lora_adapter/`` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlinf_vla.policies.base import (
    CheckpointMismatchError,
    check_state_dict,
    reduce_to_granularity,
    register_policy,
)
from rlinf_vla.policies.heads import (
    categorical_logprob_entropy,
    clipped_gaussian_logprob,
    gaussian_entropy,
)
from rlinf_vla.policies.openvla.config import checkpoint_files
from rlinf_vla.policies.openvla.model import OpenVLAPolicy
from rlinf_vla.policies.openvla_oft.config import PLATFORMS, OpenVLAOFTConfig, detect_platform
from rlinf_vla.policies.openvla_oft.processor import OpenVLAOFTProcessor
from rlinf_vla.types import ActOutput, EvalOutput, Observation

__all__ = [
    "L1RegressionActionHead",
    "MLPResNet",
    "OpenVLAOFTPolicy",
    "ProprioProjector",
    "find_checkpoint_file",
]

#: The log-std of a new Gaussian head when ``init_log_std`` is unset.
NEW_HEAD_LOG_STD = -2.0


class ProprioProjector(nn.Module):
    """``fc1 GELU fc2``: normalised proprio ``[B, P] -> [B, D]`` (one token)."""

    def __init__(self, llm_dim: int, proprio_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.act_fn1 = nn.GELU()
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act_fn1(self.fc1(x)))


class MLPResNetBlock(nn.Module):
    """``x + ReLU(Linear(LayerNorm(x)))`` (keys ``ffn.0`` LayerNorm, ``ffn.1`` Linear)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    """``LN fc1 ReLU [block]*n LN fc2`` (OFT's ``MLPResNet``)."""

    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList(
            MLPResNetBlock(hidden_dim) for _ in range(num_blocks)
        )
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """Upstream ``L1RegressionActionHead``: features ``[B, K*A, D]`` -> actions ``[B, K, A]``
    (normalised), through ``model = MLPResNet(blocks, D * A, hidden, A)`` per action."""

    def __init__(self, input_dim: int, hidden_dim: int, action_dim: int, num_blocks: int) -> None:
        super().__init__()
        self.action_dim = action_dim
        self.model = MLPResNet(num_blocks, input_dim * action_dim, hidden_dim, action_dim)

    def predict_action(self, hidden: Tensor) -> Tensor:
        b, n, d = hidden.shape
        return self.model(hidden.reshape(b, n // self.action_dim, self.action_dim * d))


def find_checkpoint_file(path: Path, pattern: str) -> Path | None:
    """The one file in ``path`` whose name contains ``pattern`` and ``checkpoint`` (OFT's
    ``find_checkpoint_file``); ``None`` when there is none, an error when several."""
    found = sorted(p for p in path.iterdir() if pattern in p.name and "checkpoint" in p.name)
    if len(found) > 1:
        raise ValueError(f"several {pattern} checkpoints in {path}: {[p.name for p in found]}")
    return found[0] if found else None


def official_platform_settings(path: Path, values: dict[str, Any]) -> dict[str, Any]:
    """The settings an official OFT checkpoint was trained and evaluated with: its platform's
    :data:`PLATFORMS` entry (from the un-normalising dataset key, or all of them, and the
    folder name), plus ``gripper=env`` for ALOHA (absolute joint angles, sent unchanged)."""
    key = values.get("unnorm_key")
    names = [key] if key else list(values.get("norm_stats") or {})
    platform = detect_platform([*names, path.name])
    settings = dict(PLATFORMS[platform])
    if platform == "aloha":
        settings["gripper"] = "env"
    return settings


def _load_pt(file: Path) -> dict[str, Tensor]:
    sd = torch.load(str(file), map_location="cpu", weights_only=True)
    return {k.removeprefix("module."): v for k, v in sd.items()}


@register_policy("openvla_oft")
class OpenVLAOFTPolicy(OpenVLAPolicy):
    """OpenVLA-OFT as an RL policy (see the module docstring).

    ``replay``: ``action_tokens long [B, K, A]`` (``discrete``) or ``normalized_actions
    float32 [B, K, A]`` (``l1_gaussian``, the unclipped Gaussian sample).
    """

    config_cls = OpenVLAOFTConfig
    config: OpenVLAOFTConfig
    _rl_heads = ("value_head", "value_encoder", "log_std")

    def _build_heads(self) -> None:
        super()._build_heads()
        cfg = self.config
        d = self.vla.llm_dim
        self.proprio_projector = ProprioProjector(d, cfg.proprio_dim) if cfg.use_proprio else None
        self.action_head = None
        self.log_std = None
        if cfg.action_head == "l1_gaussian":
            self.action_head = L1RegressionActionHead(d, d, cfg.action_dim, cfg.action_head_blocks)
            init = [NEW_HEAD_LOG_STD] if cfg.init_log_std is None else cfg.log_std_values()
            self.log_std = nn.Parameter(torch.tensor(init).expand(cfg.action_dim).clone())

    def _make_processor(self, tokenizer: Any) -> OpenVLAOFTProcessor:
        return OpenVLAOFTProcessor(self.config, tokenizer)

    def _critic_state_dim(self) -> int:
        """The critic's own encoder reads the robot state the actor reads (``use_proprio``)."""
        return self.config.proprio_dim if self.config.use_proprio else 0

    def _critic_state(self, obs: Observation) -> Tensor | None:
        """The normalised proprioception, as the proprio projector gets it."""
        if not self.config.use_proprio:
            return None
        return self.processor.proprio(obs, self.config.proprio_dim)

    # -- forward ---------------------------------------------------------------------------------
    def _action_hidden(self, obs: Observation) -> Tensor:
        """Last hidden states ``[B, K*A, D]`` at the positions that decode each action token."""
        cfg = self.config
        device = self.device
        patches = self.vla.patch_embeddings(self.processor.pixel_values(obs, device))
        if self.proprio_projector is not None:
            proprio = self.processor.proprio(obs, cfg.proprio_dim).to(device)
            dtype = self.proprio_projector.fc1.weight.dtype
            patches = torch.cat([patches, self.proprio_projector(proprio.to(dtype))[:, None]], 1)
        prompts = self.processor.prompts(obs.instruction, device)
        b, n = patches.shape[0], self.num_action_tokens
        stop = torch.full((b, 1), self.processor.eos_id, dtype=torch.long, device=device)
        stop_embed = self.vla.embed_tokens(stop)
        placeholders = stop_embed.new_zeros(b, n, stop_embed.shape[-1])  # "empty" embeddings
        embeds, mask, positions = self.vla.multimodal_inputs(
            patches,
            prompts.input_ids,
            prompts.attention_mask,
            suffix=torch.cat([placeholders, stop_embed], dim=1),
        )
        hidden = self._lm(embeds, mask, positions, is_causal=False).last_hidden_state
        return hidden[:, -n - 2 : -2]

    def _gaussian(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        assert self.action_head is not None and self.log_std is not None
        mean = self.action_head.predict_action(hidden).float()
        lo, hi = self.config.log_std_range
        std = self.log_std.clamp(lo, hi).exp().expand_as(mean)
        return mean, std

    @torch.no_grad()
    def value(self, obs: Observation) -> Tensor | None:
        """V from the first action position's hidden state (one parallel-decoding pass), or
        from the critic's own encoder alone (``value_encoder=cnn``)."""
        if self.value_head is None:
            return None
        if self.value_encoder is not None:
            return self._value(None, obs)
        return self._value(self._action_hidden(obs)[:, 0], obs)

    @torch.no_grad()
    def act(self, obs: Observation, greedy: bool = False) -> ActOutput:
        hidden = self._action_hidden(obs)
        value = self._value(hidden[:, 0], obs)
        if self.config.action_head == "discrete":
            logits = self.action_logits(hidden)
            if greedy:
                index = logits.argmax(-1)
            else:
                probs = torch.softmax(logits, -1)
                index = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
            logp, _ = categorical_logprob_entropy(logits, index)
            ids = self._shape_tokens(self.processor.action_tokenizer.from_index(index))
            actions = self.processor.tokens_to_actions(ids.cpu()).to(ids.device)
            replay = {"action_tokens": ids}
            logp = self._shape_tokens(logp)
        else:
            mean, std = self._gaussian(hidden)
            x = mean if greedy else mean + std * torch.randn_like(mean)
            logp = clipped_gaussian_logprob(x, mean, std)
            # Samples are clipped to the normalised range; the greedy mean only with
            # clip_greedy (upstream executes it as it is).
            clip = not greedy or self.config.clip_greedy
            executed = x.clamp(-1.0, 1.0) if clip else x
            actions = self.processor.unnormalize_actions(executed.cpu()).to(x.device)
            replay = {"normalized_actions": x}
        return ActOutput(
            actions=actions.float(), logprob=self.reduce(logp), value=value, replay=replay
        )

    def trains_readout_only(self) -> bool:
        """``False``: OFT scores its actions with its own pass (:meth:`evaluate`), not with
        the parent's teacher-forced one, so the actor always calls :meth:`evaluate`."""
        return False

    def evaluate(self, obs: Observation, replay: dict[str, Tensor]) -> EvalOutput:
        hidden = self._action_hidden(obs)
        if self.config.action_head == "discrete":
            logits = self.action_logits(hidden)
            flat = replay["action_tokens"].reshape(hidden.shape[0], -1).to(hidden.device)
            index = self.processor.action_tokenizer.to_index(flat)
            logp, entropy = categorical_logprob_entropy(logits, index)
            logp, entropy = self._shape_tokens(logp), self._shape_tokens(entropy)
        else:
            mean, std = self._gaussian(hidden)
            x = replay["normalized_actions"].to(mean.device)
            logp, entropy = clipped_gaussian_logprob(x, mean, std), gaussian_entropy(std)
        return EvalOutput(
            logprob=self.reduce(logp),
            entropy=reduce_to_granularity(entropy, self.config.logprob_granularity),
            value=self._value(hidden[:, 0], obs),
        )

    def loss(self, obs: Observation, actions: Tensor) -> Tensor:
        """OFT's fine-tuning loss: L1 between the head's output and the normalised actions
        (``l1_gaussian``), or cross-entropy of the action tokens (``discrete``)."""
        hidden = self._action_hidden(obs)
        if self.config.action_head == "discrete":
            ids = self.processor.actions_to_tokens(actions.cpu()).to(hidden.device)
            logits = self.vla.language_model.lm_head(hidden).float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        target = self.processor.normalize_actions(actions.cpu()).to(hidden.device)
        assert self.action_head is not None
        return nn.functional.l1_loss(self.action_head.predict_action(hidden).float(), target)

    # -- checkpoints -----------------------------------------------------------------------------
    def _config_json(self) -> dict[str, Any]:
        data = super()._config_json()
        cfg = self.config.to_dict()
        extra = (
            "use_proprio",
            "proprio_dim",
            "action_head",
            "action_head_blocks",
            "init_log_std",
            "log_std_range",
            "action_normalization",
        )
        data["rlinf_vla"].update({k: cfg[k] for k in extra})
        return data

    def save_pretrained(self, path: str | Path) -> None:
        """OpenVLA's files plus ``action_head--latest_checkpoint.pt`` and
        ``proprio_projector--latest_checkpoint.pt`` (``torch.save`` of the state dicts, as
        OFT's ``finetune.py``); the log-std goes to ``rl_heads.safetensors``."""
        super().save_pretrained(path)
        path = Path(path)
        for name in ("action_head", "proprio_projector"):
            module = getattr(self, name)
            if module is not None:
                sd = {k: v.detach().cpu() for k, v in module.state_dict().items()}
                torch.save(sd, path / f"{name}--latest_checkpoint.pt")

    @classmethod
    def config_from_dir(cls, path: Path, **overrides: Any) -> OpenVLAOFTConfig:
        """OpenVLA's config fields, with the head type, proprio size and block count read from
        the OFT checkpoint files when the directory has no ``rlinf_vla`` section.

        An official checkpoint (no ``rlinf_vla`` section) also gets its platform's settings
        (:data:`PLATFORMS`, chosen as OFT's ``constants.py`` does, from its dataset keys and
        folder name): chunk size and normalisation, sizes the weights do not give, and for
        ALOHA three cameras and no gripper mapping (its actions are joint angles). Keys in
        ``overrides`` win."""
        if find_checkpoint_file(path, "vision_backbone") is not None:
            raise NotImplementedError(
                f"{path} holds a FiLM vision backbone (vision_backbone--*checkpoint.pt); "
                "FiLM is not supported"
            )
        inferred: dict[str, Any] = {}
        head = find_checkpoint_file(path, "action_head")
        proprio = find_checkpoint_file(path, "proprio_projector")
        inferred["action_head"] = "l1_gaussian" if head is not None else "discrete"
        if head is not None:
            sd = _load_pt(head)
            blocks = {k.split(".")[2] for k in sd if k.startswith("model.mlp_resnet_blocks.")}
            inferred["action_head_blocks"] = len(blocks)
            inferred["action_dim"] = int(sd["model.fc2.weight"].shape[0])
        inferred["use_proprio"] = proprio is not None
        if proprio is not None:
            inferred["proprio_dim"] = int(_load_pt(proprio)["fc1.weight"].shape[1])
        config = super().config_from_dir(path)  # architecture + rlinf_vla section
        # the log-std a checkpoint trained is kept (rl_heads.safetensors) unless one is given
        merged = {**config.to_dict(), **inferred, "init_log_std": None, **overrides}
        files = checkpoint_files(str(path))
        if files is not None and not files.written_here:
            platform = official_platform_settings(path, merged)
            for key, value in platform.items():
                if key in inferred or overrides.get(key, "auto") != "auto":
                    continue  # the weights' sizes and the caller's values win
                merged[key] = value
        if merged.get("gripper") == "auto":
            merged["gripper"] = config.gripper  # the checkpoint's convention
        merged["checkpoint"] = str(path)
        return cls.config_cls.from_kwargs(cls.__name__, **merged)

    def _load_weights(self, path: Path) -> None:
        super()._load_weights(path)
        for name in ("action_head", "proprio_projector"):
            module = getattr(self, name)
            file = find_checkpoint_file(path, name)
            if module is None:
                continue
            if file is None:
                raise CheckpointMismatchError(
                    f"checkpoint {path} has no {name}--*checkpoint.pt, the policy needs one "
                    f"(set action_head='discrete' / use_proprio=False to run without)"
                )
            sd = _load_pt(file)
            check_state_dict(module.state_dict(), sd, str(file))
            module.load_state_dict(sd)
        if self.log_std is not None and self.config.init_log_std is not None:
            with torch.no_grad():  # given with a checkpoint: replaces the trained log-std
                values = torch.tensor(self.config.log_std_values())
                self.log_std.copy_(values.expand_as(self.log_std))

    @property
    def gaussian_std(self) -> Tensor | None:
        """The current std of the Gaussian head (normalised units), or ``None``."""
        if self.log_std is None:
            return None
        lo, hi = self.config.log_std_range
        return self.log_std.detach().clamp(lo, hi).exp()

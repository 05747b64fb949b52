"""OpenVLA on timm + transformers blocks, loading the official HF checkpoint layout.

Modules and state-dict keys follow ``prismatic/extern/hf/modeling_prismatic.py``:

- ``vision_backbone.featurizer`` (DINOv2 ViT-L/14 reg4) and ``vision_backbone.fused_featurizer``
  (SigLIP So400m/14), timm models whose features are the patch tokens of the second-to-last
  block (no prefix tokens, no final norm), concatenated on the feature dim; LayerScale weights
  are named ``scale_factor`` (the official checkpoints renamed timm's ``gamma``);
- ``projector.fc1..fc3`` (``Linear(2176, 8704) GELU Linear(8704, 4096) GELU Linear(4096, 4096)``);
- ``language_model``: ``LlamaForCausalLM`` (Llama-2-7B, vocabulary 32064 = 32000 + ``<PAD>``
  padded to a multiple of 64).

The multimodal sequence is ``[BOS] + projected patches + prompt tokens`` (patches right after
BOS). Actions are the last 256 ids of the 32000-token base vocabulary (see
:class:`~rlinf_vla.policies.tokenizers.ActionTokenizer`), decoded autoregressively.

RL: sampling is restricted to the 256 action ids (temperature, top-k); the log-prob of each
token is that of this restricted distribution; the value head reads the last hidden state at the
position that predicts the first action token (RLinf's ``hidden_states[-1][:, -A-1]``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlinf_vla.policies.base import (
    Policy,
    check_state_dict,
    find_checkpoint,
    kv_cache,
    load_rl_heads,
    load_safetensors_dir,
    register_policy,
    save_rl_heads,
    save_safetensors_dir,
    seeded,
)
from rlinf_vla.policies.heads import (
    CriticEncoder,
    ValueHead,
    categorical_logprob_entropy,
    restricted_logits,
)
from rlinf_vla.policies.llama_decode import LlamaStepDecoder
from rlinf_vla.policies.openvla.config import OpenVLAConfig
from rlinf_vla.policies.openvla.processor import OpenVLAProcessor, load_norm_stats
from rlinf_vla.policies.tokenizers import save_tokenizer
from rlinf_vla.types import ActOutput, EvalOutput, Observation

__all__ = [
    "OpenVLAPolicy",
    "PrismaticProjector",
    "PrismaticVLA",
    "PrismaticVisionBackbone",
    "attach_remote_code",
    "prismatic_config_json",
    "prismatic_kwargs_from_json",
]

#: The language-model linear layers LoRA wraps by default (a regex over module names).
LLM_LORA_TARGETS = (
    r".*language_model\.model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------
class ScaleFactorLayerScale(nn.Module):
    """timm's ``LayerScale`` with the parameter named ``scale_factor`` (the official key)."""

    def __init__(self, gamma: Tensor) -> None:
        super().__init__()
        self.scale_factor = nn.Parameter(gamma.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale_factor


def make_featurizer(
    timm_id: str, img_size: int, act_layer: str | None, kwargs: dict[str, Any]
) -> nn.Module:
    """A timm ViT as Prismatic builds it (no classifier, LayerScale renamed)."""
    import timm
    from timm.layers import LayerScale

    extra = dict(kwargs)
    if act_layer is not None:
        extra["act_layer"] = act_layer
    model = timm.create_model(timm_id, pretrained=False, num_classes=0, img_size=img_size, **extra)
    for block in model.blocks:
        for name in ("ls1", "ls2"):
            ls = getattr(block, name, None)
            if isinstance(ls, LayerScale):
                setattr(block, name, ScaleFactorLayerScale(ls.gamma))
    if len(model.blocks) < 2:
        raise ValueError(f"{timm_id}: depth must be >= 2 (features come from block depth-2)")
    return model


class PrismaticVisionBackbone(nn.Module):
    """``featurizer`` (+ ``fused_featurizer``) -> patch features ``[B, P, D_vision]``."""

    def __init__(self, config: OpenVLAConfig) -> None:
        super().__init__()
        size = config.image_sizes[0]
        self.featurizer = make_featurizer(
            config.timm_model_ids[0],
            size,
            config.timm_override_act_layers[0],
            config.timm_kwargs[0],
        )
        self.fused_featurizer = None
        if config.use_fused_vision_backbone:
            self.fused_featurizer = make_featurizer(
                config.timm_model_ids[1],
                size,
                config.timm_override_act_layers[1],
                config.timm_kwargs[1],
            )
        self.embed_dim = self.featurizer.embed_dim + (
            self.fused_featurizer.embed_dim if self.fused_featurizer is not None else 0
        )
        self.num_patches = self.featurizer.patch_embed.num_patches
        self.channels = 3 * (2 if self.fused_featurizer is not None else 1)

    @staticmethod
    def _features(model: nn.Module, x: Tensor) -> Tensor:
        # Output of the second-to-last block, patch tokens only, no final norm.
        return model.get_intermediate_layers(x, n=[len(model.blocks) - 2])[0]

    def forward(self, pixel_values: Tensor) -> Tensor:
        """``[B, channels, S, S] -> [B, P, D_vision]``."""
        feats = self._features(self.featurizer, pixel_values[:, :3])
        if self.fused_featurizer is not None:
            fused = self._features(self.fused_featurizer, pixel_values[:, 3:6])
            feats = torch.cat([feats, fused], dim=2)
        return feats


class PrismaticProjector(nn.Module):
    """``fc1 GELU fc2 GELU fc3`` (fused backbone) or ``fc1 GELU fc2``; all with bias."""

    def __init__(self, vision_dim: int, llm_dim: int, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
            self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
            self.fc3 = nn.Linear(llm_dim, llm_dim)
            self.act_fn2 = nn.GELU()
        else:
            self.fc1 = nn.Linear(vision_dim, llm_dim)
            self.fc2 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1 = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc2(self.act_fn1(self.fc1(x)))
        if self.fused:
            x = self.fc3(self.act_fn2(x))
        return x


class PrismaticVLA(nn.Module):
    """``vision_backbone``, ``projector`` and ``language_model`` (the official module names)."""

    def __init__(self, config: OpenVLAConfig) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        text = {k: v for k, v in config.text_config.items() if k not in ("model_type",)}
        self.vision_backbone = PrismaticVisionBackbone(config)
        llm_config = LlamaConfig(**text)
        self.projector = PrismaticProjector(
            self.vision_backbone.embed_dim,
            llm_config.hidden_size,
            config.use_fused_vision_backbone,
        )
        self.language_model = LlamaForCausalLM(llm_config)

    @property
    def llm_dim(self) -> int:
        return self.language_model.config.hidden_size

    def patch_embeddings(self, pixel_values: Tensor) -> Tensor:
        """``[B, channels * n_images, S, S]`` -> projected patches ``[B, n_images * P, D]``
        (each camera through the backbone separately, as OFT's multi-image input)."""
        c = self.vision_backbone.channels
        dtype = self.projector.fc1.weight.dtype
        groups = pixel_values.to(dtype).split(c, dim=1)
        feats = torch.cat([self.vision_backbone(g) for g in groups], dim=1)
        return self.projector(feats)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.language_model.get_input_embeddings()(ids)

    def multimodal_inputs(
        self,
        patches: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        suffix: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``[BOS] + patches + input_ids[:, 1:] (+ suffix)``: embeddings ``[B, T, D]``, the 2D
        attention mask ``[B, T]`` and RoPE positions ``[B, T]`` (``cumsum(mask) - 1``)."""
        tok = self.embed_tokens(input_ids)
        parts = [tok[:, :1], patches.to(tok.dtype), tok[:, 1:]]
        ones = attention_mask.new_ones(patches.shape[:2])
        masks = [attention_mask[:, :1], ones, attention_mask[:, 1:]]
        if suffix is not None:
            parts.append(suffix.to(tok.dtype))
            masks.append(attention_mask.new_ones(suffix.shape[:2]))
        mask = torch.cat(masks, dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return torch.cat(parts, dim=1), mask, positions


# ----------------------------------------------------------------------------------------------
# Checkpoint layout
# ----------------------------------------------------------------------------------------------
_RL_FIELDS = (
    "action_dim",
    "chunk_size",
    "logprob_granularity",
    "value_head",
    "value_hidden_sizes",
    "detach_value_input",
    "value_encoder",
    "image_keys",
    "center_crop",
    "image_pipeline",
    "temperature",
    "top_k",
    "unnorm_key",
    "gripper",
    "timm_kwargs",
)


def prismatic_config_json(cfg: OpenVLAConfig, extra_rl: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``config.json`` of an OpenVLA checkpoint (``OpenVLAConfig`` fields of the official
    remote code, plus an ``rlinf_vla`` section with the RL settings and tiny timm overrides).

    It has no ``auto_map``: that names the official remote-code files, which this package does
    not ship; :func:`attach_remote_code` adds both when a folder that has the files is at hand.
    """
    fused = cfg.use_fused_vision_backbone
    text = {"model_type": "llama", **cfg.text_config}
    rl = cfg.to_dict()
    return {
        "architectures": ["OpenVLAForActionPrediction"],
        "model_type": "openvla",
        "vision_backbone_id": cfg.vision_backbone_id,
        "llm_backbone_id": cfg.llm_backbone_id,
        "arch_specifier": "no-align+fused-gelu-mlp" if fused else "gelu-mlp",
        "use_fused_vision_backbone": fused,
        "timm_model_ids": list(cfg.timm_model_ids),
        "timm_override_act_layers": list(cfg.timm_override_act_layers),
        "image_sizes": list(cfg.image_sizes),
        "image_resize_strategy": cfg.image_resize_strategy,
        "hf_llm_id": "meta-llama/Llama-2-7b-hf",
        "llm_max_length": 2048,
        "pad_token_id": int(cfg.text_config.get("pad_token_id", cfg.base_vocab_size)),
        "pad_to_multiple_of": cfg.pad_to_multiple_of,
        "output_projector_states": False,
        "n_action_bins": cfg.n_action_bins,
        "norm_stats": cfg.norm_stats,
        "text_config": text,
        "torch_dtype": "bfloat16" if cfg.torch_dtype == torch.bfloat16 else "float32",
        "rlinf_vla": {k: rl[k] for k in (*_RL_FIELDS, *extra_rl)},
    }


def prismatic_kwargs_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """Config keyword arguments from an official (or our) OpenVLA ``config.json``."""
    out: dict[str, Any] = {}
    for key in (
        "vision_backbone_id",
        "timm_model_ids",
        "timm_override_act_layers",
        "image_sizes",
        "image_resize_strategy",
        "llm_backbone_id",
        "pad_to_multiple_of",
        "n_action_bins",
        "norm_stats",
    ):
        if data.get(key) is not None:
            out[key] = data[key]
    text = dict(data.get("text_config") or {})
    for drop in ("model_type", "torch_dtype", "dtype", "_name_or_path", "architectures"):
        text.pop(drop, None)
    if "vocab_size" not in text:
        text["vocab_size"] = 32000 + int(data.get("pad_to_multiple_of", 64))
    text.setdefault("pad_token_id", int(data.get("pad_token_id", 32000)))
    out["text_config"] = text
    out.update(data.get("rlinf_vla") or {})
    return out


def write_preprocessor_config(cfg: OpenVLAConfig, path: Path) -> None:
    """``preprocessor_config.json`` with the fields the official ``PrismaticImageProcessor``
    saves, normalising with the config's ``image_mean`` / ``image_std`` (a loaded checkpoint's
    own values): as ``means`` / ``stds`` and as ``tvf_normalize_params``, which the official
    class reads back in place of the values it would derive. No ``auto_map`` (see
    :func:`attach_remote_code`)."""
    size = cfg.image_sizes[0]
    n = len(cfg.timm_model_ids)
    means = [[float(x) for x in m] for m in cfg.image_mean]
    stds = [[float(x) for x in sd] for sd in cfg.image_std]
    data = {
        "image_processor_type": "PrismaticImageProcessor",
        "processor_class": "PrismaticProcessor",
        "use_fused_vision_backbone": cfg.use_fused_vision_backbone,
        "image_resize_strategy": cfg.image_resize_strategy,
        "input_sizes": [[3, size, size]] * n,
        "interpolations": ["bicubic"] * n,
        "means": means,
        "stds": stds,
        "tvf_normalize_params": [
            {"mean": m, "std": sd, "inplace": False} for m, sd in zip(means, stds, strict=True)
        ],
    }
    (path / "preprocessor_config.json").write_text(json.dumps(data, indent=2))


#: The official remote-code files of an OpenVLA / OpenVLA-OFT checkpoint folder (the released
#: checkpoints ship them; their ``auto_map`` entries name them).
REMOTE_CODE_FILES = (
    "configuration_prismatic.py",
    "modeling_prismatic.py",
    "processing_prismatic.py",
)
#: ``auto_map`` of the released ``config.json`` and ``preprocessor_config.json``.
REMOTE_CODE_AUTO_MAP = {
    "config.json": {
        "AutoConfig": "configuration_prismatic.OpenVLAConfig",
        "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction",
    },
    "preprocessor_config.json": {
        "AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor",
        "AutoProcessor": "processing_prismatic.PrismaticProcessor",
    },
}


def attach_remote_code(path: str | Path, source: str | Path) -> bool:
    """Make an exported folder ``path`` loadable by the official code
    (``AutoModelForVision2Seq.from_pretrained(path, trust_remote_code=True)`` and
    ``AutoProcessor``): copy the official remote-code files from checkpoint folder ``source``
    (e.g. the ``openvla/openvla-7b`` snapshot the policy was fine-tuned from) and add the
    ``auto_map`` entries that name them.

    Returns:
        ``False``, changing nothing, when ``source`` lacks one of :data:`REMOTE_CODE_FILES`.
    """
    import shutil

    path, source = Path(path), Path(source)
    if not all((source / f).is_file() for f in REMOTE_CODE_FILES):
        return False
    for name in REMOTE_CODE_FILES:
        if (path / name).resolve() != (source / name).resolve():
            shutil.copyfile(source / name, path / name)
    for file, auto_map in REMOTE_CODE_AUTO_MAP.items():
        data = json.loads((path / file).read_text())
        data["auto_map"] = dict(auto_map)
        (path / file).write_text(json.dumps(data, indent=2))
    return True


# ----------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------
@register_policy("openvla")
class OpenVLAPolicy(Policy):
    """OpenVLA as an RL policy: ``K * A`` action tokens decoded autoregressively.

    ``replay["action_tokens"]``: ``long [B, K, A]`` sampled token ids.
    """

    config_cls = OpenVLAConfig
    config: OpenVLAConfig
    _rl_heads = ("value_head", "value_encoder")

    def __init__(
        self,
        config: OpenVLAConfig,
        tokenizer: Any = None,
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        super().__init__(config)
        ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
        with torch.device(config.device), seeded(config.seed):
            self.vla = PrismaticVLA(config)
            self._build_heads()
        if tokenizer is None:
            tokenizer = OpenVLAProcessor.make_tokenizer(config, ckpt)
        self.processor = self._make_processor(tokenizer)
        if ckpt is not None:
            self._load_weights(ckpt)
        self._finish_init()
        if config.gradient_checkpointing:
            self.enable_gradient_checkpointing()

    # -- construction pieces (OpenVLA-OFT extends these) --------------------------------------
    def _build_heads(self) -> None:
        cfg = self.config
        self.value_encoder = None
        width = self.vla.llm_dim
        if cfg.value_encoder == "cnn":
            self.value_encoder = CriticEncoder(len(cfg.image_keys), self._critic_state_dim())
            width = self.value_encoder.out_dim
        self.value_head = (
            ValueHead(width, cfg.value_hidden_sizes, 1, "gelu", bias_last=False)
            if cfg.value_head
            else None
        )

    def _critic_state_dim(self) -> int:
        """The size of the robot state the critic's own encoder reads (OpenVLA: none)."""
        return 0

    def _critic_state(self, obs: Observation) -> Tensor | None:
        """The robot state the critic's own encoder reads (OpenVLA: none)."""
        return None

    def _make_processor(self, tokenizer: Any) -> OpenVLAProcessor:
        return OpenVLAProcessor(self.config, tokenizer)

    def lora_root(self) -> nn.Module:
        return self.vla

    def lora_target_modules(self) -> str:
        return LLM_LORA_TARGETS

    def enable_gradient_checkpointing(self) -> None:
        lm = self.vla.language_model
        kwargs = {"use_reentrant": False}
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for m in (self.vla.vision_backbone.featurizer, self.vla.vision_backbone.fused_featurizer):
            if m is not None:
                m.set_grad_checkpointing(True)

    # -- the forward pieces --------------------------------------------------------------------
    @property
    def num_action_tokens(self) -> int:
        return self.config.chunk_size * self.config.action_dim

    def _prefix(self, obs: Observation) -> tuple[Tensor, Tensor, Tensor]:
        """Embeddings, mask and positions of ``[BOS, patches, prompt..., ▁]``."""
        device = self.device
        pixels = self.processor.pixel_values(obs, device)
        prompts = self.processor.prompts(obs.instruction, device)
        patches = self.vla.patch_embeddings(pixels)
        return self.vla.multimodal_inputs(patches, prompts.input_ids, prompts.attention_mask)

    def _lm(self, embeds: Tensor, mask: Tensor, positions: Tensor, **kw: Any) -> Any:
        return self.vla.language_model.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, **kw
        )

    def action_logits(self, hidden: Tensor) -> Tensor:
        """Sampling logits over the action bins ``[..., n_bins]`` (float32) from hidden states
        ``[..., D]`` (the temperature and top-k of the config applied)."""
        cfg = self.config
        logits = self.vla.language_model.lm_head(hidden)
        first = self.processor.action_tokenizer.first_id
        return restricted_logits(logits, first, cfg.n_action_bins, cfg.temperature, cfg.top_k)

    def _value(self, hidden: Tensor | None, obs: Observation | None) -> Tensor | None:
        """V from the backbone's ``hidden [B, D]``, or from ``obs`` by the critic's own
        encoder (``value_encoder=cnn``; ``hidden`` is not read and may be ``None``)."""
        if self.value_head is None:
            return None
        if self.value_encoder is not None:
            assert obs is not None, "the critic's own encoder reads the observation"
            device = self.value_head.mlp[0].weight.device
            images = [
                obs.images[k].to(device).permute(0, 3, 1, 2).float() / 255.0
                for k in self.config.image_keys
            ]
            state = self._critic_state(obs)
            h = self.value_encoder(
                torch.cat(images, dim=1), None if state is None else state.to(device).float()
            )
        else:
            assert hidden is not None
            h = hidden.detach() if self.config.detach_value_input else hidden
        return self.value_head(h.float()).squeeze(-1)

    def _shape_tokens(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], self.config.chunk_size, self.config.action_dim)

    # -- the contract --------------------------------------------------------------------------
    def act(self, obs: Observation, greedy: bool = False) -> ActOutput:
        return self._act(obs, greedy, self.config.exact_logprob)[0]

    def act_with_features(
        self, obs: Observation, greedy: bool = False
    ) -> tuple[ActOutput, Tensor | None]:
        """:meth:`act` and, when only the read-out trains, the hidden states that predicted
        the sampled tokens (:meth:`frozen_features`): the decoding steps' own. The actor then
        scores the read-out on these very features, so its first ratio is 1 without the
        teacher-forced re-scoring of ``exact_logprob``, which is skipped."""
        if not self.trains_readout_only():
            return self.act(obs, greedy), None
        return self._act(obs, greedy, rescore=False)

    @torch.no_grad()
    def _act(self, obs: Observation, greedy: bool, rescore: bool) -> tuple[ActOutput, Tensor]:
        """:meth:`act` (re-scored teacher-forced with ``rescore``, ``exact_logprob``), and the
        decoding steps' hidden states ``[B, n, D]`` that predicted the sampled tokens."""
        from transformers import DynamicCache

        prefix = self._prefix(obs)
        embeds, mask, positions = prefix
        lm = self.vla.language_model.model
        cache = DynamicCache()
        out = self._lm(embeds, mask, positions, use_cache=True, **kv_cache(lm, cache))
        hidden = out.last_hidden_state[:, -1]
        value = self._value(hidden, obs)
        n = self.num_action_tokens
        # The tokens after the first: each one position further than the last prompt token's.
        steps = positions[:, -1:] + torch.arange(1, n, device=positions.device)
        decoder = LlamaStepDecoder(lm, cache, mask, steps)
        tokens, logps, hiddens = [], [], []
        for i in range(n):
            hiddens.append(hidden)
            logits = self.action_logits(hidden)
            index = (
                logits.argmax(-1)
                if greedy
                else torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)
            )
            logps.append(categorical_logprob_entropy(logits, index)[0])
            token = self.processor.action_tokenizer.from_index(index)
            tokens.append(token)
            if i + 1 < n:
                hidden = decoder.step(self.vla.embed_tokens(token))
        ids = self._shape_tokens(torch.stack(tokens, dim=1))
        logprob = self._shape_tokens(torch.stack(logps, dim=1))
        if rescore:
            # Score the sampled tokens with the same teacher-forced pass as ``evaluate``, so the
            # first PPO ratio is exactly 1 (the decoding logits differ by float rounding).
            scored = self._score(prefix, ids, obs)
            logprob, value = scored.logprob, scored.value
        else:
            logprob = self.reduce(logprob)
        actions = self.processor.tokens_to_actions(ids.cpu()).to(ids.device)
        out = ActOutput(
            actions=actions.float(), logprob=logprob, value=value, replay={"action_tokens": ids}
        )
        return out, torch.stack(hiddens, dim=1)

    def _teacher_forced(
        self, prefix: tuple[Tensor, Tensor, Tensor], ids: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Hidden states ``[B, n, D]`` at the positions predicting each of the ``n`` action
        tokens ``ids [B, K, A]`` (the first from the prompt's last token), and ``ids [B, n]``."""
        embeds, mask, positions = prefix
        flat = ids.reshape(ids.shape[0], -1).to(embeds.device)
        n = flat.shape[1]
        embeds = torch.cat([embeds, self.vla.embed_tokens(flat[:, :-1])], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], n - 1)], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self._lm(embeds, mask, positions).last_hidden_state
        return hidden[:, -n:], flat

    def action_hidden_states(self, obs: Observation, action_tokens: Tensor) -> Tensor:
        """The language model's last hidden states ``[B, n, D]`` at the ``n = K * A``
        positions that predict the action tokens ``action_tokens [B, K, A]``, teacher-forced
        after the image and prompt of ``obs``: what :meth:`action_logits` reads to score them
        (``lm_head`` of them gives the logits over the whole vocabulary). With gradients; for
        probes and auxiliary losses on the model's internal state."""
        return self._teacher_forced(self._prefix(obs), action_tokens)[0]

    def _score(
        self, prefix: tuple[Tensor, Tensor, Tensor], ids: Tensor, obs: Observation
    ) -> EvalOutput:
        return self._score_hidden(*self._teacher_forced(prefix, ids), obs)

    def _score_hidden(self, hidden: Tensor, flat: Tensor, obs: Observation | None) -> EvalOutput:
        """Log-prob, entropy and value of the action tokens ``flat [B, n]`` from the hidden
        states that predict them ``[B, n, D]``: the read-out part of :meth:`_score` (``obs``
        feeds the critic's own encoder; ``None`` only where there is none)."""
        logits = self.action_logits(hidden)
        index = self.processor.action_tokenizer.to_index(flat)
        logp, entropy = categorical_logprob_entropy(logits, index)
        return EvalOutput(
            logprob=self.reduce(self._shape_tokens(logp)),
            entropy=self.reduce(self._shape_tokens(entropy)),
            value=self._value(hidden[:, 0], obs),
        )

    def evaluate(self, obs: Observation, replay: dict[str, Tensor]) -> EvalOutput:
        return self._score(self._prefix(obs), replay["action_tokens"], obs)

    #: Parameter-name prefixes of the read-out: the action logits and the value head.
    _READOUT = ("vla.language_model.lm_head.", "value_head.")

    def trains_readout_only(self) -> bool:
        """Only ``lm_head`` (or its LoRA) and the value head train, and the value head reads
        the backbone (the critic's own encoder needs the observation, not the features)."""
        if self.value_encoder is not None:
            return False
        return not any(
            p.requires_grad and not name.startswith(self._READOUT)
            for name, p in self.named_parameters()
        )

    def frozen_features(self, obs: Observation, replay: dict[str, Tensor]) -> Tensor | None:
        """The teacher-forced hidden states ``[B, n, D]`` that predict the replayed action
        tokens, when only ``lm_head`` (or its LoRA) and the value head train; else ``None``."""
        if not self.trains_readout_only():
            return None
        with torch.no_grad():
            return self._teacher_forced(self._prefix(obs), replay["action_tokens"])[0]

    def evaluate_features(self, features: Tensor, replay: dict[str, Tensor]) -> EvalOutput:
        ids = replay["action_tokens"]
        flat = ids.reshape(ids.shape[0], -1).to(features.device)
        return self._score_hidden(features, flat, None)

    def critic_values(self, obs: Observation, replay: dict[str, Tensor]) -> Tensor:
        """With the critic's own encoder, that encoder and the value head alone; else the
        value of :meth:`evaluate`."""
        if self.value_encoder is None:
            return super().critic_values(obs, replay)
        value = self._value(None, obs)
        assert value is not None  # value_encoder=cnn needs value_head=true
        return value

    @torch.no_grad()
    def value(self, obs: Observation) -> Tensor | None:
        """V from the prompt's last hidden state (one prefix pass, no action decoding), or
        from the critic's own encoder alone (``value_encoder=cnn``)."""
        if self.value_head is None:
            return None
        if self.value_encoder is not None:
            return self._value(None, obs)
        return self._value(self._lm(*self._prefix(obs)).last_hidden_state[:, -1], obs)

    @classmethod
    def statistics_config(
        cls,
        name: str,
        action: Mapping[str, Any],
        state: Mapping[str, Any] | None,
        counts: Mapping[str, int],
    ) -> dict[str, Any]:
        """``dataset_statistics.json`` as OpenVLA writes it: ``{name: {"action": ...,
        "proprio": ..., "num_transitions", "num_trajectories"}}``; every action dim is
        normalised (``mask`` all true: the data's gripper is in env units already)."""
        keys = ("mean", "std", "max", "min", "q01", "q99")
        entry: dict[str, Any] = {
            "action": {k: list(action[k]) for k in keys} | {"mask": [True] * len(action["q01"])},
            "num_transitions": int(counts["frames"]),
            "num_trajectories": int(counts["episodes"]),
        }
        if state is not None:
            entry["proprio"] = {k: list(state[k]) for k in keys}
        # the data's actions are in env units: no RLDS gripper mapping on the way out
        return {"norm_stats": {name: entry}, "unnorm_key": name, "gripper": "env"}

    def loss(self, obs: Observation, actions: Tensor) -> Tensor:
        """Cross-entropy of the demonstration's action tokens over the full vocabulary (the
        OpenVLA fine-tuning loss), teacher-forced."""
        ids = self.processor.actions_to_tokens(actions.cpu()).to(self.device)
        hidden, flat = self._teacher_forced(self._prefix(obs), ids)
        logits = self.vla.language_model.lm_head(hidden).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), flat.flatten())

    # -- checkpoints ---------------------------------------------------------------------------
    def official_state_dict(self) -> dict[str, Tensor]:
        """The weights under the official key names (LoRA merged in)."""
        return self.merged_state_dict(self.vla)

    def _config_json(self) -> dict[str, Any]:
        return prismatic_config_json(self.config)

    def save_pretrained(self, path: str | Path) -> None:
        """``config.json``, ``model.safetensors`` (sharded above 5 GB), ``dataset_statistics.json``,
        ``preprocessor_config.json``, the tokenizer files (``tokenizer_class: LlamaTokenizer``,
        as the released checkpoints, readable by transformers 4.40), ``rl_heads.safetensors``
        (value head) and, with LoRA, the peft adapter in ``lora_adapter/`` (the weights file is
        merged).

        The official remote code (``*_prismatic.py``) and the ``auto_map`` naming it are written
        only when the checkpoint the policy was loaded from has the files (they are copied from
        there, :func:`attach_remote_code`); otherwise ``attach_remote_code(path, <a folder
        that has them>)`` adds them later."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self._config_json(), indent=2))
        save_safetensors_dir(self.official_state_dict(), path)
        if self.config.norm_stats is not None:
            (path / "dataset_statistics.json").write_text(
                json.dumps(self.config.norm_stats, indent=2)
            )
        write_preprocessor_config(self.config, path)
        save_tokenizer(self.processor.tokenizer, path, "LlamaTokenizer")
        for source in (self.config.checkpoint, path):
            if source and attach_remote_code(path, source):
                break
        save_rl_heads(self, path, self._rl_heads)
        if self.has_lora:
            self.save_lora_adapter(path / "lora_adapter")

    @classmethod
    def config_from_dir(cls, path: Path, **overrides: Any) -> OpenVLAConfig:
        data = json.loads((path / "config.json").read_text())
        kwargs = prismatic_kwargs_from_json(data)
        stats = load_norm_stats(path)
        if stats is not None:
            kwargs["norm_stats"] = stats
        for key in ("checkpoint", "lora_rank", "lora_adapter"):
            kwargs.pop(key, None)
        known = {f for f in cls.config_cls.__dataclass_fields__}
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        kwargs.update(overrides)
        kwargs["checkpoint"] = str(path)
        return cls.config_cls.from_kwargs(cls.__name__, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> OpenVLAPolicy:
        """Load a checkpoint folder, a run's checkpoint, or a Hugging Face model id from the
        local cache (:func:`~rlinf_vla.policies.base.find_checkpoint`)."""
        path = find_checkpoint(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json (not an OpenVLA checkpoint)")
        return cls(cls.config_from_dir(path, **overrides), checkpoint_dir=path)

    def _load_weights(self, path: Path) -> None:
        weights = load_safetensors_dir(path)
        # Prismatic training checkpoints keep timm's LayerScale name.
        weights = {
            re.sub(r"\.(ls[12])\.gamma$", r".\1.scale_factor", k): v for k, v in weights.items()
        }
        expected = self.vla.state_dict()
        check_state_dict(expected, weights, str(path))
        self.vla.load_state_dict(weights)
        load_rl_heads(self, path, self._loadable_rl_heads(path))

    def _loadable_rl_heads(self, path: Path) -> tuple[str, ...]:
        """The RL heads to load from checkpoint ``path``: all, but the critic (value head and
        encoder) when the checkpoint's critic read other features (``value_encoder``), whose
        value head has another input; that critic starts fresh."""
        saved = json.loads((path / "config.json").read_text()).get("rlinf_vla", {})
        if saved.get("value_encoder", "backbone") == self.config.value_encoder:
            return self._rl_heads
        return tuple(h for h in self._rl_heads if h not in ("value_head", "value_encoder"))

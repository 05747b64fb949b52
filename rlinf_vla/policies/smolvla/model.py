"""SmolVLA on transformers 5.x SmolVLM / Llama blocks, with Flow-SDE / Flow-Noise RL.

Model (lerobot's ``SmolVLAPolicy``; keys as in its ``model.safetensors``, ``model.`` prefixed):

- ``vlm_with_expert.vlm``: a SmolVLM (SigLIP-style vision encoder, pixel-shuffle connector,
  Llama text decoder) whose text decoder keeps its first ``num_vlm_layers`` layers;
- ``vlm_with_expert.lm_expert``: a narrower Llama (``expert_width_multiplier`` of the width,
  same heads and head size) without token embedding, the action expert;
- ``state_proj`` (state -> one prefix token), ``action_in_proj``, ``action_time_mlp_in/out``
  (time enters by concatenation with the action embedding) and ``action_out_proj``.

Prefix: per camera the connector's tokens times ``sqrt(width)``, the prompt's token embeddings
times ``sqrt(width)`` (bidirectional among themselves), then the state token (which sees them,
and which they do not see). Suffix: ``H`` action tokens, causal among themselves, seeing the
whole prefix. Rotary positions use wavelength 10000 whatever the backbone's ``rope_theta``.

Layers (``attention_mode="cross_attn"``): in layers ``0, n, 2n, ...``
(``self_attn_every_n_layers``) prefix and actions attend jointly (the expert's queries, keys and
values beside the VLM's); in the others the VLM attends within the prefix, and the expert's
queries attend to the VLM's rotated keys and values of that layer, passed through the expert's
own ``k_proj`` / ``v_proj``, with positions counted from 0 in the suffix. With fewer expert
layers than VLM layers the expert joins every ``num_vlm_layers / num_expert_layers``-th layer.

Flow matching, the Flow-SDE / Flow-Noise log-probabilities, values and greedy noise are
:class:`~rlinf_vla.policies.pi0.model.FlowMatchingPolicy`'s (see the π0 module).

Export (:meth:`SmolVLAPolicy.save_pretrained`): lerobot 0.4's policy folder: ``config.json``
(``type: smolvla``), ``model.safetensors`` and the ``policy_preprocessor`` /
``policy_postprocessor`` pipelines with the normalisation statistics.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlinf_vla.policies.base import (
    check_state_dict,
    find_checkpoint,
    load_rl_heads,
    load_safetensors_dir,
    register_policy,
    save_rl_heads,
    save_safetensors_dir,
    seeded,
)
from rlinf_vla.policies.pi0.model import (
    FlowMatchingPolicy,
    make_att_2d_masks,
    posemb_sincos,
)
from rlinf_vla.policies.pi0.processor import LEROBOT_BUFFER_PREFIXES, find_norm_stats
from rlinf_vla.policies.smolvla import lerobot_format
from rlinf_vla.policies.smolvla.config import NOT_SAVED, SmolVLAConfig, read_vlm_config
from rlinf_vla.policies.smolvla.processor import SmolVLAInputs, SmolVLAProcessor
from rlinf_vla.types import Observation

__all__ = ["SmolVLAPolicy", "SmolVLMWithExpert", "apply_rope", "patch_positions"]


#: Rotary wavelength of SmolVLA's attention (not the backbone's ``rope_theta``).
ROPE_WAVELENGTH = 10_000.0


def apply_rope(x: Tensor, positions: Tensor, wavelength: float = ROPE_WAVELENGTH) -> Tensor:
    """Rotate ``x [B, L, H, D]`` by ``positions [B, L]``: the two halves ``(x1, x2)`` of the
    head dim become ``(x1 cos - x2 sin, x2 cos + x1 sin)`` at angles
    ``pos / wavelength ** (2i / D)``, computed in float32."""
    half = x.shape[-1] // 2
    exponents = torch.arange(half, dtype=torch.float32, device=x.device) * (2.0 / x.shape[-1])
    angles = positions.float()[..., None] / (wavelength**exponents)
    cos, sin = torch.cos(angles)[..., None, :], torch.sin(angles)[..., None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def patch_positions(rows: int, cols: int, side: int, device: Any = "cpu") -> Tensor:
    """Position-embedding ids ``[rows * cols]`` of a ``rows x cols`` patch grid on a
    ``side x side`` table, as transformers 4.x's SmolVLM computes them: coordinate
    ``i / n * (1 - 1e-6)`` (float32) bucketed at ``k / side``, so that on a full grid
    ``(n = side)`` row ``i >= 1`` takes the id of row ``i - 1`` (transformers 5 gives row
    ``i`` its own id)."""
    bounds = torch.arange(1 / side, 1.0, 1 / side, device=device)

    def bucket(n: int) -> Tensor:
        coords = torch.arange(n, dtype=torch.float32, device=device) / n * (1 - 1e-6)
        return torch.bucketize(coords, bounds, right=True)

    return (bucket(rows)[:, None] * side + bucket(cols)[None]).flatten()


class SmolVLMWithExpert(nn.Module):
    """The truncated SmolVLM (``vlm``) and the Llama action expert (``lm_expert``)."""

    def __init__(self, config: SmolVLAConfig) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel, SmolVLMConfig
        from transformers import SmolVLMForConditionalGeneration as SmolVLM

        self.config = config
        vlm_cfg = copy.deepcopy(config.vlm_config)
        # only the kept text layers are built (lerobot builds them all, then cuts)
        text = {**vlm_cfg["text_config"], "num_hidden_layers": config.num_vlm_layers}
        self.vlm = SmolVLM(SmolVLMConfig(**{**vlm_cfg, "text_config": text}))
        self.num_heads = int(text["num_attention_heads"])
        self.num_kv_heads = int(text.get("num_key_value_heads", self.num_heads))
        self.head_dim = int(text.get("head_dim", int(text["hidden_size"]) // self.num_heads))
        expert_cfg = {
            k: v
            for k, v in text.items()
            if k not in ("model_type", "architectures", "tie_word_embeddings", "vocab_size")
        }
        expert_cfg.update(
            hidden_size=config.expert_width,
            intermediate_size=config.expert_intermediate_size,
            num_hidden_layers=config.expert_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=1,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        expert = LlamaModel(LlamaConfig(**expert_cfg))
        expert.embed_tokens = None
        kv = self.num_kv_heads * self.head_dim
        bias = bool(text.get("attention_bias", False))
        for i, layer in enumerate(expert.layers):
            if not config.expert_has_self_kv(i):
                # cross-attention reads the VLM's keys and values, of the VLM's kv width
                layer.self_attn.k_proj = nn.Linear(kv, kv, bias=bias)
                layer.self_attn.v_proj = nn.Linear(kv, kv, bias=bias)
        self.lm_expert = expert
        self.gradient_checkpointing = False

    @property
    def every(self) -> int:
        """The expert joins VLM layers ``0, every, 2 every, ...``."""
        return self.config.num_vlm_layers // self.config.expert_layers

    @property
    def text_model(self) -> nn.Module:
        return self.vlm.model.text_model

    def expert_layer(self, i: int) -> nn.Module | None:
        """The expert layer that runs beside VLM layer ``i`` (``None``: the expert skips it)."""
        return self.lm_expert.layers[i // self.every] if i % self.every == 0 else None

    def embed_image(self, pixels: Tensor) -> Tensor:
        """``[B, 3, S_h, S_w]`` in ``[-1, 1]`` -> connector tokens ``[B, P, D_vlm]``.

        The patch positions are those of the transformers 4.x SmolVLM that SmolVLA checkpoints
        were trained with (:func:`patch_positions`), not transformers 5's."""
        model = self.vlm.model
        vision = model.vision_model
        emb = vision.embeddings
        x = pixels.to(emb.patch_embedding.weight.dtype)
        h = emb.patch_embedding(x).flatten(2).transpose(1, 2)
        side = emb.num_patches_per_side
        rows, cols = x.shape[-2] // emb.patch_size, x.shape[-1] // emb.patch_size
        h = h + emb.position_embedding(patch_positions(rows, cols, side, x.device))
        h = vision.post_layernorm(vision.encoder(inputs_embeds=h).last_hidden_state)
        return model.connector(h)

    def embed_language(self, tokens: Tensor) -> Tensor:
        return self.text_model.embed_tokens(tokens)

    # -- attention --------------------------------------------------------------------------
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Eager attention of ``q [B, Lq, H, D]`` over ``k, v [B, Lk, Hkv, D]`` with a bool
        ``mask [B, Lq, Lk]``, in float32 -> ``[B, Lq, H * D]``."""
        rep = self.num_heads // self.num_kv_heads
        q = q.float().transpose(1, 2)
        k = k.float().transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5
        scores = torch.where(mask[:, None], scores, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)

    @staticmethod
    def _qkv(layer: nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn = layer.self_attn
        normed = layer.input_layernorm(h)
        shape = (*h.shape[:2], -1, attn.head_dim)
        return (
            attn.q_proj(normed).view(shape),
            attn.k_proj(normed).view(shape),
            attn.v_proj(normed).view(shape),
        )

    @staticmethod
    def _finish(layer: nn.Module, h: Tensor, att: Tensor) -> Tensor:
        """``o_proj``, the residual, then the MLP block with its residual."""
        h = h + layer.self_attn.o_proj(att.to(layer.self_attn.o_proj.weight.dtype))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _layer(
        self,
        i: int,
        hs: list[Tensor | None],
        mask: Tensor,
        positions: Tensor,
        past: tuple[Tensor, Tensor] | None,
    ) -> tuple[list[Tensor | None], tuple[Tensor, Tensor] | None]:
        prefix, suffix = hs
        vlm_layer, exp_layer = self.text_model.layers[i], self.expert_layer(i)
        n_p = prefix.shape[1] if prefix is not None else 0
        # a joint self-attention layer, or every layer of a prefix-only pass
        if self.config.is_self_attn_layer(i) or suffix is None:
            run = [
                (h, layer)
                for h, layer in ((prefix, vlm_layer), (suffix, exp_layer))
                if h is not None and layer is not None
            ]
            parts = [self._qkv(layer, h) for h, layer in run]
            n = sum(h.shape[1] for h, _ in run)
            q = apply_rope(torch.cat([p[0] for p in parts], 1), positions[:, :n])
            k = apply_rope(torch.cat([p[1] for p in parts], 1), positions[:, :n])
            v = torch.cat([p[2] for p in parts], 1)
            kv = (k, v) if suffix is None else None
            if past is not None:
                k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
            att = self._attend(q, k, v, mask[:, :n, : k.shape[1]])
            out, start = [], 0
            for h, layer in ((prefix, vlm_layer), (suffix, exp_layer)):
                if h is None or layer is None:
                    out.append(h)
                    continue
                out.append(self._finish(layer, h, att[:, start : start + h.shape[1]]))
                start += h.shape[1]
            return out, kv
        # cross-attention: the VLM within the prefix, the expert onto the VLM's keys/values
        kv = None
        if prefix is not None:
            q, k, v = self._qkv(vlm_layer, prefix)
            pos = positions[:, :n_p]
            q, k = apply_rope(q, pos), apply_rope(k, pos)
            prefix = self._finish(vlm_layer, prefix, self._attend(q, k, v, mask[:, :n_p, :n_p]))
            kv = (k, v) if suffix is None else None
        else:
            k, v = past
        if exp_layer is None:
            return [prefix, suffix], kv
        attn = exp_layer.self_attn
        normed = exp_layer.input_layernorm(suffix)
        q = attn.q_proj(normed).view(*suffix.shape[:2], -1, attn.head_dim)
        dtype = attn.k_proj.weight.dtype
        k_e = attn.k_proj(k.to(dtype).reshape(*k.shape[:2], -1))
        v_e = attn.v_proj(v.to(dtype).reshape(*v.shape[:2], -1))
        k_e = k_e.view(*k.shape[:2], -1, attn.head_dim)
        v_e = v_e.view(*v.shape[:2], -1, attn.head_dim)
        pos = positions[:, n_p:]
        q = apply_rope(q, pos - pos.min(dim=1, keepdim=True).values)
        n_k = k.shape[1]
        att = self._attend(q, k_e, v_e, mask[:, -suffix.shape[1] :, :n_k])
        return [prefix, self._finish(exp_layer, suffix, att)], kv

    def forward(
        self,
        embeds: list[Tensor | None],
        mask: Tensor,
        positions: Tensor,
        past: list[tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[list[Tensor | None], list[tuple[Tensor, Tensor] | None]]:
        """Run ``[prefix, suffix]`` (either may be ``None``) through all layers.

        Args:
            embeds: prefix ``[B, Np, D_vlm]`` and/or suffix ``[B, Ns, D_expert]`` embeddings.
            mask: ``bool [B, Nq, Nk]`` (keys include the cached prefix of a suffix-only pass).
            positions: rotary positions of the queries ``[B, Nq]``.
            past: per-layer rotated prefix ``(k, v)`` ``[B, Np, Hkv, D]`` of a prefix pass.

        Returns:
            final-normed outputs ``[prefix, suffix]`` and, with a prefix, its per-layer
            ``(k, v)``.
        """
        hs = list(embeds)
        cache = []
        for i in range(self.config.num_vlm_layers):
            layer_past = past[i] if past is not None else None
            if self.gradient_checkpointing and self.training:
                hs, kv = torch.utils.checkpoint.checkpoint(
                    self._layer, i, hs, mask, positions, layer_past, use_reentrant=False
                )
            else:
                hs, kv = self._layer(i, hs, mask, positions, layer_past)
            cache.append(kv)
        norms = (self.text_model.norm, self.lm_expert.norm)
        return [None if h is None else norm(h) for h, norm in zip(hs, norms, strict=True)], cache


# ----------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------
#: The lerobot policy's module prefix in ``model.safetensors``.
_PREFIX = "model."
LORA_TARGETS = (
    r".*(vlm\.model\.text_model|lm_expert)\.layers\.\d+\."
    r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)


@register_policy("smolvla")
class SmolVLAPolicy(FlowMatchingPolicy):
    """SmolVLA as an RL policy (see the module docstring)."""

    config_cls = SmolVLAConfig
    config: SmolVLAConfig
    _rl_heads = ("value_head", "noise_head")

    def __init__(
        self,
        config: SmolVLAConfig,
        tokenizer: Any = None,
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        super().__init__(config)
        ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
        cfg = config
        with torch.device(cfg.device), seeded(cfg.seed):
            self.vlm_with_expert = SmolVLMWithExpert(cfg)
            width = cfg.expert_width
            self.state_proj = nn.Linear(cfg.max_state_dim, cfg.vlm_width)
            self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
            self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)
            self._make_rl_heads(width, cfg.vlm_width)
        if tokenizer is None:
            tokenizer = SmolVLAProcessor.make_tokenizer(cfg, ckpt)
        self.processor = SmolVLAProcessor(cfg, tokenizer)
        if ckpt is not None:
            self._load_weights(ckpt)
        self._finish_init()
        if cfg.gradient_checkpointing:
            self.enable_gradient_checkpointing()

    def lora_root(self) -> nn.Module:
        return self.vlm_with_expert

    def lora_target_modules(self) -> str:
        return LORA_TARGETS

    def enable_gradient_checkpointing(self) -> None:
        self.vlm_with_expert.gradient_checkpointing = True

    # -- embeddings --------------------------------------------------------------------------
    def _prefix(self, inputs: SmolVLAInputs) -> tuple[Tensor, Tensor, Tensor]:
        """Prefix embeddings ``[B, Np, D]`` (images, language, state), pad mask and block
        flags ``[B, Np]`` (the state token starts a block of its own)."""
        vwe = self.vlm_with_expert
        device = self.device
        embs, pads = [], []
        for slot in range(inputs.images.shape[1]):
            img = vwe.embed_image(inputs.images[:, slot].to(device))
            embs.append(img * math.sqrt(img.shape[-1]))
            pads.append(inputs.image_masks[:, slot, None].to(device).expand(-1, img.shape[1]))
        lang = vwe.embed_language(inputs.tokens.to(device))
        embs.append((lang * math.sqrt(lang.shape[-1])).to(embs[0].dtype))
        pads.append(inputs.token_mask.to(device))
        state = self.state_proj(inputs.state.to(device, self.state_proj.weight.dtype))
        embs.append(state[:, None].to(embs[0].dtype))
        pads.append(torch.ones(state.shape[0], 1, dtype=torch.bool, device=device))
        embs, pad = torch.cat(embs, dim=1), torch.cat(pads, dim=1)
        ar = torch.zeros_like(pad, dtype=torch.long)
        ar[:, -1] = 1
        missing = self.config.prefix_length - pad.shape[1]
        if missing > 0:
            embs = F.pad(embs, (0, 0, 0, missing))
            pad = F.pad(pad, (0, missing), value=False)
            ar = F.pad(ar, (0, missing))
        return embs, pad, ar

    def _suffix(self, x: Tensor, t: Tensor) -> Tensor:
        """Action tokens: ``mlp_out(silu(mlp_in([action_in_proj(x), time_emb(t)])))``."""
        cfg = self.config
        dtype = self.action_in_proj.weight.dtype
        actions = self.action_in_proj(x.to(dtype))
        time_emb = posemb_sincos(t, cfg.expert_width, cfg.min_period, cfg.max_period).to(dtype)
        at = torch.cat([actions, time_emb[:, None].expand_as(actions)], dim=-1)
        return self.action_time_mlp_out(F.silu(self.action_time_mlp_in(at)))

    # -- model passes ------------------------------------------------------------------------
    def timesteps(self, device: Any = "cpu") -> Tensor:
        """lerobot's ``t_k = 1 - k / K`` (each rounded once to float32, as its sampling loop
        does; the time embedding's shortest period, 0.004, resolves the last bit) and
        ``t_K = 0``."""
        k = self.config.num_steps
        t = [1.0 + i * (-1.0 / k) for i in range(k)] + [0.0]
        return torch.tensor(t, dtype=torch.float32, device=device)

    def _prefix_pass(self, inputs: SmolVLAInputs) -> dict[str, Any]:
        embs, pad, ar = self._prefix(inputs)
        mask = make_att_2d_masks(pad, ar)
        positions = pad.long().cumsum(1) - 1
        (out, _), cache = self.vlm_with_expert([embs, None], mask, positions)
        return {"pad": pad, "cache": cache, "out": out}

    def _suffix_pass(
        self, inputs: SmolVLAInputs, prefix: dict[str, Any], x: Tensor, t: Tensor
    ) -> Tensor:
        embs = self._suffix(x, t)
        pad_p = prefix["pad"]
        b, n = embs.shape[:2]
        pad_s = torch.ones(b, n, dtype=torch.bool, device=embs.device)
        causal = make_att_2d_masks(pad_s, torch.ones_like(pad_s, dtype=torch.long))
        mask = torch.cat([pad_p[:, None].expand(-1, n, -1), causal], dim=2)
        positions = pad_p.long().sum(1, keepdim=True) + pad_s.long().cumsum(1) - 1
        (_, out), _ = self.vlm_with_expert([None, embs], mask, positions, past=prefix["cache"])
        return out[:, -n:]

    def _joint_pass(self, inputs: SmolVLAInputs, x: Tensor, t: Tensor) -> Tensor:
        prefix_embs, prefix_pad, prefix_ar = self._prefix(inputs)
        embs = self._suffix(x, t)
        pad_s = torch.ones(embs.shape[:2], dtype=torch.bool, device=embs.device)
        pad = torch.cat([prefix_pad, pad_s], dim=1)
        ar = torch.cat([prefix_ar, torch.ones_like(pad_s, dtype=torch.long)], dim=1)
        mask = make_att_2d_masks(pad, ar)
        positions = pad.long().cumsum(1) - 1
        (_, out), _ = self.vlm_with_expert([prefix_embs, embs], mask, positions)
        return out[:, -x.shape[1] :]

    def velocity_from_inputs(self, inputs: SmolVLAInputs, x: Tensor, t: Tensor) -> Tensor:
        """``v_θ(x, t)`` ``float32 [B, H, D]`` for processed inputs (through the KV cache)."""
        prefix = self._prefix_pass(inputs)
        out = self._suffix_pass(inputs, prefix, x.to(self.device), t.to(self.device))
        return self.action_out_proj(out).float()

    @torch.no_grad()
    def denoise_from_inputs(self, inputs: SmolVLAInputs, noise: Tensor) -> Tensor:
        """The ODE from ``noise [B, H, D]`` (``num_steps`` Euler steps, t = 1 -> 0): the
        model-space actions ``[B, H, D]``, as lerobot's ``sample_actions``."""
        prefix = self._prefix_pass(inputs)
        x = noise.to(self.device).float()
        ts = self.timesteps(x.device)
        for k in range(self.config.num_steps):
            t = ts[k].expand(x.shape[0])
            v = self.action_out_proj(self._suffix_pass(inputs, prefix, x, t)).float()
            x = x - (ts[k] - ts[k + 1]) * v
        return x

    @torch.no_grad()
    def denoise(self, obs: Observation, noise: Tensor) -> Tensor:
        """Env actions ``[B, K, A]`` integrated from ``noise [B, H, D]`` (greedy, fixed noise)."""
        x = self.denoise_from_inputs(self.processor(obs, self.device), noise)
        return self.processor.unnormalize_actions(x[:, : self.config.chunk_size].cpu())

    @classmethod
    def statistics_config(
        cls,
        name: str,
        action: Mapping[str, Any],
        state: Mapping[str, Any] | None,
        counts: Mapping[str, int],
    ) -> dict[str, Any]:
        """lerobot's statistics (``mean``, ``std``, ``min``, ``max``, ``q01``, ``q99``) of
        the actions and the state; SmolVLA normalises both by mean and std."""
        keys = ("mean", "std", "min", "max", "q01", "q99")
        stats = {"actions": {k: list(action[k]) for k in keys if k in action}}
        if state is not None:
            stats["state"] = {k: list(state[k]) for k in keys if k in state}
        return {"norm_stats": stats}

    # -- checkpoints -------------------------------------------------------------------------
    def official_state_dict(self) -> dict[str, Tensor]:
        """lerobot's ``SmolVLAPolicy`` state dict (``model.`` prefixed, LoRA merged); the RL
        heads are not part of it."""
        out: dict[str, Tensor] = {}
        for k, v in self.merged_state_dict(self.vlm_with_expert).items():
            out[f"{_PREFIX}vlm_with_expert.{k}"] = v
        for name, module in self.named_children():
            if name in ("vlm_with_expert", *self._rl_heads):
                continue
            for k, v in module.state_dict().items():
                out[f"{_PREFIX}{name}.{k}"] = v
        return out

    def save_pretrained(self, path: str | Path) -> None:
        """A lerobot 0.4 SmolVLA folder, which lerobot's ``SmolVLAPolicy.from_pretrained`` and
        ``PolicyProcessorPipeline.from_pretrained`` read and this package loads back:

        - ``config.json`` (``type: smolvla``, the features, the normalisation mapping and the
          architecture fields) and ``model.safetensors`` (:meth:`official_state_dict`);
        - ``policy_preprocessor.json`` / ``policy_postprocessor.json`` with the normaliser's
          statistics in ``*_normalizer_processor.safetensors`` /
          ``*_unnormalizer_processor.safetensors`` (when the policy has statistics);
        - ``tokenizer/`` (lerobot reads the backbone's tokenizer by ``vlm_model_name``),
          ``rl_heads.safetensors`` (value head, noise net) and with LoRA ``lora_adapter/``;
          lerobot ignores these.
        """
        cfg = self.config
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_safetensors_dir(self.official_state_dict(), path, max_shard_bytes=2**62)
        lerobot_format.write_config(path, cfg)
        if cfg.norm_stats is not None:
            lerobot_format.write_processors(path, cfg)
        self.processor.tokenizer.save_pretrained(str(path / "tokenizer"))
        save_rl_heads(self, path, self._rl_heads)
        if self.has_lora:
            self.save_lora_adapter(path / "lora_adapter")

    @classmethod
    def config_from_dir(cls, path: Path, **overrides: Any) -> SmolVLAConfig:
        """Config from lerobot's ``config.json`` (``type: smolvla``) with the statistics of its
        processor files (or of lerobot < 0.4's buffers), and this package's own section.

        The backbone's architecture comes from ``vlm_config=`` or ``vlm_model_name``
        (:func:`~rlinf_vla.policies.smolvla.config.read_vlm_config`, relative folders looked
        up in the checkpoint first).
        """
        data = json.loads((path / "config.json").read_text())
        if data.get("type", "smolvla") != "smolvla":
            raise ValueError(f"{path}/config.json is a {data['type']!r} policy, not smolvla")
        # a lerobot folder is a full-size policy: the RL heads' sizes are the full preset's
        kwargs = {"preset": "full", **lerobot_format.config_kwargs(data, path)}
        extra = path / lerobot_format.EXTRA_FILE
        if extra.is_file():
            saved = json.loads(extra.read_text())
            kwargs.update({k: v for k, v in saved.items() if k not in NOT_SAVED})
        if overrides.get("vlm_config") is None and "vlm_config" not in kwargs:
            name = overrides.get("vlm_model_name", kwargs.get("vlm_model_name"))
            kwargs["vlm_config"] = read_vlm_config(name, base=path)
        if overrides.get("norm_stats") is None:
            found = find_norm_stats(path)
            if found is not None:
                kwargs["norm_stats"] = found.stats
                if found.normalization is not None:
                    kwargs["normalization"] = found.normalization
        known = set(cls.config_cls.__dataclass_fields__)
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        kwargs.update(overrides)
        kwargs["checkpoint"] = str(path)
        return cls.config_cls.from_kwargs("smolvla", **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> SmolVLAPolicy:
        """Load a lerobot SmolVLA folder, a run's checkpoint, or a Hugging Face model id from
        the local cache (:func:`~rlinf_vla.policies.base.find_checkpoint`)."""
        path = find_checkpoint(path)
        if not any(path.glob("model*.safetensors")):
            raise FileNotFoundError(f"{path} has no model.safetensors (not a SmolVLA checkpoint)")
        return cls(cls.config_from_dir(path, **overrides), checkpoint_dir=path)

    def _load_weights(self, path: Path) -> None:
        raw = load_safetensors_dir(path)
        raw = {k: v for k, v in raw.items() if not k.startswith(LEROBOT_BUFFER_PREFIXES)}
        weights = {k[len(_PREFIX) :] if k.startswith(_PREFIX) else k: v for k, v in raw.items()}
        expected = {
            k: v
            for k, v in self.state_dict().items()
            if not k.startswith(tuple(f"{h}." for h in self._rl_heads))
        }
        check_state_dict(expected, weights, str(path))
        self.load_state_dict(weights, strict=False)
        load_rl_heads(self, path, self._rl_heads)

"""Token-by-token decoding through a Hugging Face Llama model's own modules.

Sampling a VLA's action tokens one at a time calls the language model once per token with a
single new position. Hugging Face's ``LlamaModel.forward`` rebuilds its masks, rotary
embeddings, cache bookkeeping and output records on every such call; on a small model (and on a
large one at batch 1) that machinery, not the arithmetic, is most of a step's time. A
:class:`LlamaStepDecoder` takes over after the prompt's pass: it copies that pass's keys and
values into buffers sized for every token still to come, computes the rotary embeddings of
all the positions to come at once, and then runs each step as the model's own modules in the
order ``LlamaDecoderLayer`` runs them (RMSNorm, ``q/k/v_proj``, RoPE, attention, ``o_proj``,
RMSNorm, MLP, the final norm), so LoRA wrappers and autocast apply as they do in
``forward``. The arithmetic is Hugging Face's; only the order of float operations inside
scaled-dot-product attention may differ (within float rounding). The tests hold it against
``LlamaModel.forward`` with a ``DynamicCache``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LlamaStepDecoder"]


def _cached_kv(cache: Any, layer: int) -> tuple[Tensor, Tensor]:
    """The keys and values ``[B, H_kv, T, d]`` a ``DynamicCache`` holds for ``layer``
    (transformers >= 4.56 keeps them per layer object; earlier releases in two lists)."""
    if hasattr(cache, "layers"):
        entry = cache.layers[layer]
        return entry.keys, entry.values
    return cache.key_cache[layer], cache.value_cache[layer]


class LlamaStepDecoder:
    """Decode ``steps`` more tokens after a prompt pass of a Hugging Face ``LlamaModel``.

    Args:
        model: the ``LlamaModel`` (``LlamaForCausalLM.model``) that ran the prompt.
        cache: the ``DynamicCache`` that pass filled (read once here, not updated).
        mask: the prompt's attention mask ``[B, T]`` (1 = attend; padding anywhere).
        positions: the RoPE positions ``[B, steps]`` of the tokens to come.

    ``step(embeds)`` takes the next token's embeddings ``[B, D]`` and returns the final
    hidden state ``[B, D]`` at its position (what ``forward(...).last_hidden_state[:, -1]``
    gives); at most ``steps`` calls.
    """

    def __init__(self, model: nn.Module, cache: Any, mask: Tensor, positions: Tensor) -> None:
        self.model = model
        self.layers = list(model.layers)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        batch, prompt = mask.shape
        steps = positions.shape[1]
        self.prompt, self.steps = prompt, steps
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        for i in range(len(self.layers)):
            k, v = _cached_kv(cache, i)
            shape = (*k.shape[:2], prompt + steps, k.shape[-1])
            keys = k.new_empty(shape)
            values = v.new_empty(shape)
            keys[:, :, :prompt] = k
            values[:, :, :prompt] = v
            self.keys.append(keys)
            self.values.append(values)
        # Every position to come at once: RoPE's angles are per position, so this is what the
        # per-call computation gives, bit for bit; in the dtype of the token embeddings, which
        # ``forward`` takes them in (it reads only the device and dtype of its first argument).
        self.cos, self.sin = model.rotary_emb(model.embed_tokens.weight, positions)  # [B, steps, d]
        full = torch.cat([mask.bool(), mask.new_ones(batch, steps, dtype=torch.bool)], dim=1)
        # As Hugging Face's SDPA path: no mask at all where no position is padding.
        self.mask = None if bool(full.all()) else full[:, None, None, :]
        self.step_index = 0

    @torch.no_grad()
    def step(self, embeds: Tensor) -> Tensor:
        i = self.step_index
        if i >= self.steps:
            raise RuntimeError(f"LlamaStepDecoder: all {i} steps it was sized for are used")
        t = self.prompt + i  # the new token's place in the keys and values
        cos, sin = self.cos[:, i : i + 1], self.sin[:, i : i + 1]
        mask = None if self.mask is None else self.mask[..., : t + 1]
        x = embeds[:, None, :]
        batch = x.shape[0]
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            keys[:, :, t : t + 1] = k
            values[:, :, t : t + 1] = v
            k_all, v_all = keys[:, :, : t + 1], values[:, :, : t + 1]
            groups = q.shape[1] // k_all.shape[1]
            if groups > 1:
                k_all = k_all.repeat_interleave(groups, dim=1)
                v_all = v_all.repeat_interleave(groups, dim=1)
            o = F.scaled_dot_product_attention(
                q, k_all, v_all, attn_mask=mask, dropout_p=0.0, scale=attn.scaling
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.step_index = i + 1
        return self.model.norm(x)[:, -1]

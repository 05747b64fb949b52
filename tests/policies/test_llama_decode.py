"""``LlamaStepDecoder`` against Hugging Face's own ``LlamaModel.forward``: token by token with
a ``DynamicCache``, and the whole sequence in one pass without any cache."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlinf_vla.policies.base import kv_cache
from rlinf_vla.policies.llama_decode import LlamaStepDecoder

PROMPT, STEPS, DIM = 6, 5, 32


def tiny_llama(kv_heads: int) -> transformers.LlamaModel:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
    )
    return transformers.LlamaForCausalLM(cfg).eval().model


def prompt_mask(padded: bool) -> torch.Tensor:
    """Two rows; with ``padded`` the second pads two positions after its first token, as the
    VLA prompts are padded after BOS."""
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    if padded:
        mask[1, 1:3] = 0
    return mask


def decode(model, embeds, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states ``[B, STEPS, D]`` of the tokens after the prompt, from the decoder and
    from ``forward`` with a ``DynamicCache`` one token at a time."""
    prompt, rest = embeds[:, :PROMPT], embeds[:, PROMPT:]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = positions[:, -1:] + torch.arange(1, STEPS + 1)
    with torch.no_grad():
        cache = transformers.DynamicCache()
        model(
            inputs_embeds=prompt,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **kv_cache(model, cache),
        )
        decoder = LlamaStepDecoder(model, cache, mask, steps)
        ours = torch.stack([decoder.step(rest[:, i]) for i in range(STEPS)], dim=1)
        theirs, full_mask = [], mask
        for i in range(STEPS):
            full_mask = torch.cat([full_mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            out = model(
                inputs_embeds=rest[:, i : i + 1],
                attention_mask=full_mask,
                position_ids=steps[:, i : i + 1],
                use_cache=True,
                **kv_cache(model, cache),
            )
            theirs.append(out.last_hidden_state[:, -1])
    return ours, torch.stack(theirs, dim=1)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_steps_match_forward_with_a_dynamic_cache(kv_heads, padded):
    model = tiny_llama(kv_heads)
    embeds = torch.randn(2, PROMPT + STEPS, DIM, generator=torch.Generator().manual_seed(1))
    ours, theirs = decode(model, embeds, prompt_mask(padded))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_steps_match_one_uncached_pass_over_the_whole_sequence():
    """No cache at all: the decoder's states are the full sequence's at the same positions
    (the padded row's positions skip its padding)."""
    model = tiny_llama(2)
    mask = prompt_mask(padded=True)
    embeds = torch.randn(2, PROMPT + STEPS, DIM, generator=torch.Generator().manual_seed(2))
    ours, _ = decode(model, embeds, mask)
    full_mask = torch.cat([mask, torch.ones(2, STEPS, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(inputs_embeds=embeds, attention_mask=full_mask, position_ids=positions)
    torch.testing.assert_close(ours, out.last_hidden_state[:, PROMPT:], atol=1e-5, rtol=1e-5)


def test_lora_wrapped_projections_take_part():
    """With LoRA injected (non-zero B, so it changes the output) the decoder goes through the
    wrapped projections exactly as ``forward`` does."""
    peft = pytest.importorskip("peft")
    model = tiny_llama(4)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=targets), model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    embeds = torch.randn(2, PROMPT + STEPS, DIM, generator=torch.Generator().manual_seed(3))
    ours, theirs = decode(model, embeds, prompt_mask(padded=True))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    plain, _ = decode(tiny_llama(4), embeds, prompt_mask(padded=True))
    assert (ours - plain).abs().max() > 1e-2  # the adapter did change the states


def test_more_steps_than_sized_for_is_refused():
    model = tiny_llama(4)
    mask = prompt_mask(padded=False)
    embeds = torch.randn(2, PROMPT, DIM)
    with torch.no_grad():
        cache = transformers.DynamicCache()
        model(inputs_embeds=embeds, attention_mask=mask, use_cache=True, **kv_cache(model, cache))
    decoder = LlamaStepDecoder(model, cache, mask, torch.full((2, 1), PROMPT))
    decoder.step(embeds[:, 0])
    with pytest.raises(RuntimeError, match="all 1 steps"):
        decoder.step(embeds[:, 0])

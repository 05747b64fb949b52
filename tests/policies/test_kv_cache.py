"""``kv_cache``: the KV cache reaches a Hugging Face model under the keyword its forward takes."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from rlinf_vla.policies.base import kv_cache


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def test_cached_decoding_matches_the_full_pass_without_warnings() -> None:
    """If the cache went in under a keyword the model ignores, the last token would be decoded
    without its context and its logits would differ from the full pass."""
    model = tiny_llama()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. "past_key_values is deprecated"
        cache = transformers.DynamicCache()
        model(ids[:, :-1], use_cache=True, **kv_cache(model, cache))
        step = model(ids[:, -1:], use_cache=True, **kv_cache(model, cache)).logits[:, -1]
        full = model(ids).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_a_peft_wrapper_gets_its_base_models_keyword() -> None:
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert list(kv_cache(wrapped, None)) == list(kv_cache(model, None))

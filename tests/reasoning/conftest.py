"""A tiny causal LM and a character-level tokenizer, built and saved as a Hugging Face folder."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_tiny_model(
    folder: Path, chat_template: bool = True, seed: int = 0, head_dim: int = 8
) -> Path:
    """A 2-layer Llama (4 query and 2 key/value heads of ``head_dim``) with a character
    tokenizer, saved to ``folder``. vLLM's CPU attention needs ``head_dim`` of 32 or more."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=vocab["<eos>"],
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def math_actor(folder: Path, **algo: Any) -> Any:
    """A ``math-grpo`` actor worker on the model in ``folder`` as rank 0 of 1 on the CPU, built
    in this process (no Ray), with ``algo.group_size=2`` and the other ``algo`` keys given."""
    from rlinf_vla.reasoning.workers import ActorWorker
    from rlinf_vla.runtime.cluster import Device
    from rlinf_vla.runtime.worker import WorkerContext

    actor = ActorWorker.__new__(ActorWorker)
    actor._ctx = WorkerContext("actor", 0, 1, Device(0, 0, "local", "127.0.0.1", 0, "cpu"))
    actor.__init__({"path": str(folder)}, {"group_size": 2, **algo}, seed=0)
    return actor


def small_run_args(model_dir: Path, tmp_path: Path) -> list[str]:
    """``math-grpo`` overrides of a small run on 36 sums (prompts of 2 x 4 responses, 6 new
    tokens) with the model in ``model_dir``, into ``tmp_path / "run"``."""
    data = tmp_path / "train.jsonl"
    rows = [{"q": f"What is {a} + {b}?", "a": str(a + b)} for a in range(6) for b in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        f"model.path={model_dir}",
        f"data.path={data}",
        "data.prompt_field=q",
        "data.answer_field=a",
        "data.eval_size=4",
        "algo.group_size=4",
        "algo.prompts_per_step=2",
        "algo.max_new_tokens=6",
        f"runner.output_dir={tmp_path / 'run'}",
        "runner.logging.tensorboard=false",
    ]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_lm"))

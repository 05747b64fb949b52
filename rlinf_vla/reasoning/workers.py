"""The workers of ``math-grpo``: rollout (sampling), reward (verification) and actor (update).

They are plain :class:`~rlinf_vla.runtime.Worker` subclasses on the same runtime as the
embodied trainer; only what they compute differs. Weights go from actor rank 0 to the
rollout workers through a collective broadcast; gradients are averaged over actor ranks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlinf_vla.algos import kl_divergence
from rlinf_vla.config import from_section
from rlinf_vla.reasoning.config import MathAlgoConfig
from rlinf_vla.reasoning.generation import Response, encode_prompts, sample_responses
from rlinf_vla.reasoning.model import (
    ModelConfig,
    eos_token_ids,
    load_hf_config,
    load_model,
    load_tokenizer,
    make_token_batch,
    response_logprobs,
)
from rlinf_vla.reasoning.reward import score_response
from rlinf_vla.reasoning.scoring import score_sample
from rlinf_vla.reasoning.vllm_backend import VllmSampler, merged_weights
from rlinf_vla.runtime import (
    Worker,
    offload_module,
    offload_optimizer,
    onload_module,
    onload_optimizer,
    resident,
)
from rlinf_vla.training.learner import HasLearner, Learner, Schedule
from rlinf_vla.training.objective import LossSettings, objective


def _setup_threads(cfg: ModelConfig) -> None:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)


def _trainable_state(model: torch.nn.Module, full: bool) -> dict[str, Tensor]:
    """All weights, or only the trainable ones (LoRA adapters), detached on CPU."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if full or k in names}


# --------------------------------------------------------------------------- rollout
class RolloutWorker(Worker):
    """Samples responses with the latest weights (filled by the first :meth:`sync_from`).

    ``max_model_len``: the longest prompt plus response (tokens), for the vLLM engine.
    With ``model.rollout_backend=vllm`` a vLLM engine samples; the Hugging Face model is then
    kept (on CPU) only for LoRA, to merge the adapters it receives into the base weights.
    """

    def __init__(
        self, model: dict[str, Any], seed: int, offload: bool = False, max_model_len: int = 2048
    ) -> None:
        self.cfg = from_section(ModelConfig, model, "model")
        _setup_threads(self.cfg)
        self.tokenizer = load_tokenizer(self.cfg)
        self.vllm: VllmSampler | None = None
        config = load_hf_config(self.cfg)
        self.eos_ids = eos_token_ids(self.tokenizer, config)
        if self.cfg.rollout_backend == "vllm":
            self.model = load_model(self.cfg, weights=False) if self.cfg.lora_rank else None
            self.vllm = VllmSampler(
                config,
                self.tokenizer,
                self.device,
                self.cfg.dtype,
                self.cfg.vllm_kv_cache_gib,
                self.cfg.vllm_gpu_memory_fraction,
                max_model_len,
                self.eos_ids,
                sleep_between_calls=offload,
            )
        else:
            self.model = load_model(self.cfg, weights=False).to(self.device).eval()
        if self.model is not None:
            self.model.requires_grad_(False)
        self.generator = torch.Generator(device=self.device).manual_seed(seed * 7919 + self.rank)
        self.offload_between_steps = offload and self.device.type == "cuda" and self.vllm is None
        self.version = -1

    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def sync_from(self, collective_name: str, version: int) -> None:
        """Receive the actor's weights (all of them, or the LoRA adapters)."""
        state = self.collective(collective_name).broadcast_tensors(None, src=0)
        if self.vllm is not None:
            if self.model is not None:  # LoRA: the adapters (after the first sync) merged in
                self._load(state)
                state = merged_weights(self.model)
            self.vllm.load_weights(state)
            self.version = version
            return
        self._load(state)  # into the model wherever it is (host memory when offloaded)
        self.version = version

    def _load(self, state: dict[str, Tensor]) -> None:
        _, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise RuntimeError(f"weights the rollout model lacks: {unexpected[:5]}")

    def generate(
        self,
        questions: list[str],
        n: int,
        data: dict[str, Any],
        sampling: dict[str, Any],
    ) -> dict[str, Any]:
        """``n`` responses per question.

        Args:
            data: ``system_prompt``, ``prompt_suffix``, ``max_prompt_tokens``.
            sampling: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
                ``stop_strings``.

        Returns:
            ``prompts`` (token ids per question), ``responses`` (``[P][n]`` token-id lists),
            ``texts`` (``[P][n]`` decoded), ``stopped`` (``[P][n]`` ended before the limit),
            ``truncated_prompts``, ``seconds``.
        """
        t0 = time.perf_counter()
        prompts, truncated = encode_prompts(
            self.tokenizer,
            questions,
            data["system_prompt"],
            data["prompt_suffix"],
            data["max_prompt_tokens"],
        )
        sample = self.vllm.sample if self.vllm is not None else self._sample_hf
        with resident(self.model, self.device, enabled=self.offload_between_steps):
            out = sample(
                prompts,
                n,
                sampling["max_new_tokens"],
                sampling["temperature"],
                sampling["top_p"],
                sampling["top_k"],
                tuple(sampling["stop_strings"]),
                self.generator,
            )
        return {
            "prompts": prompts,
            "responses": [[r.tokens for r in group] for group in out],
            "texts": [
                [self.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in group]
                for group in out
            ],
            "stopped": [[r.finish == "stop" for r in group] for group in out],
            "truncated_prompts": truncated,
            "seconds": time.perf_counter() - t0,
        }

    def _sample_hf(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_strings: tuple[str, ...],
        generator: torch.Generator,
    ) -> list[list[Response]]:
        return sample_responses(
            self.model,
            prompts,
            n,
            max_new_tokens,
            self.eos_ids,
            self.tokenizer.pad_token_id,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_strings=stop_strings,
            tokenizer=self.tokenizer,
            generator=generator,
        )

    def rng_state(self) -> Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: Tensor) -> None:
        self.generator.set_state(state)


# --------------------------------------------------------------------------- reward
class RewardWorker(Worker):
    """Scores responses against reference answers with ``math-verify`` (CPU only)."""

    def __init__(self, format_weight: float, fallback_last_number: bool) -> None:
        self.format_weight = format_weight
        self.fallback = fallback_last_number

    def score(
        self, texts: list[str], references: list[str]
    ) -> list[tuple[float, bool, bool, bool]]:
        """``(reward, correct, boxed, parsed)`` per response."""
        out = []
        for text, ref in zip(texts, references, strict=True):
            r = score_response(text, ref, self.format_weight, self.fallback)
            out.append((r.reward, r.correct, r.formatted, r.parsed))
        return out

    def score_samples(
        self, texts: list[str], references: list[str], lengths: list[int], cut: list[bool]
    ) -> list[dict[str, Any]]:
        """:func:`~rlinf_vla.reasoning.scoring.score_sample` of each response, as dicts (what
        the held-out evaluation aggregates, as ``rlinf-vla math-eval`` does)."""
        return [
            score_sample(text, ref, n, c, self.fallback).to_dict()
            for text, ref, n, c in zip(texts, references, lengths, cut, strict=True)
        ]


# --------------------------------------------------------------------------- actor
@dataclass
class Sequence:
    """One response to train on: prompt and response token ids, and per-token advantages
    (PPO: also the per-token value targets and the values at rollout time)."""

    prompt: list[int]
    response: list[int]
    advantages: list[float]
    returns: list[float] | None = None
    values: list[float] | None = None

    @property
    def zero_advantage(self) -> bool:
        return not any(self.advantages)


class ActorWorker(Worker, HasLearner):
    """Holds the trained model, its optimizer and (with a KL term) the frozen reference."""

    def __init__(
        self, model: dict[str, Any], algo: dict[str, Any], seed: int, offload: bool = False
    ) -> None:
        torch.manual_seed(seed)
        self.cfg = from_section(ModelConfig, model, "model")
        self.algo = from_section(MathAlgoConfig, algo, "algo")
        _setup_threads(self.cfg)
        self.model = load_model(self.cfg).to(self.device)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        self.model.train()
        self.reference = None
        if self.algo.kl_coef > 0 and self.cfg.lora_rank == 0:
            self.reference = load_model(self.cfg).to(self.device).eval().requires_grad_(False)
        # PPO's critic: a linear read-out of the last hidden state (float32), trained beside
        # the model at algo.value_lr.
        self.value_head = None
        if self.algo.use_critic:
            self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        trained = torch.nn.ModuleDict({"model": self.model})
        if self.value_head is not None:
            trained["value_head"] = self.value_head
        a = self.algo
        self.learner = Learner(
            trained,
            a.lr,
            second_group=(lambda name: name.startswith("value_head."), a.value_lr),
            betas=tuple(a.betas),
            weight_decay=a.weight_decay,
            max_grad_norm=a.max_grad_norm,
            schedule=Schedule(warmup=a.warmup_steps),
        )
        self.offload_between_steps = offload and self.device.type == "cuda"
        self.synced_once = False

    def _onload(self) -> None:
        """The model, the optimizer state and the reference back on the device (collocated on
        a GPU, they wait in host memory between updates: :meth:`_offload`)."""
        if self.offload_between_steps:
            onload_module(self.model, self.device)
            if self.value_head is not None:
                onload_module(self.value_head, self.device)
            onload_optimizer(self.optimizer, self.device)
            if self.reference is not None:
                onload_module(self.reference, self.device)

    def _offload(self) -> None:
        if self.offload_between_steps:
            offload_module(self.model)
            if self.value_head is not None:
                offload_module(self.value_head)
            offload_optimizer(self.optimizer)
            if self.reference is not None:
                offload_module(self.reference)

    def parameter_counts(self) -> dict[str, int]:
        """``total`` and ``trained`` parameters of the model (for the run's header)."""
        from rlinf_vla.run.loop import parameter_counts

        return parameter_counts(self.model)

    # ----------------------------------------------------------------- weights
    def join_data_parallel(self, collective_name: str) -> None:
        self.learner.join_data_parallel(self.collective(collective_name))

    def sync_to(self, collective_name: str, version: int) -> int:
        """Broadcast the weights (LoRA: the adapters, after a first full sync) to the rollout."""
        full = not self.synced_once or self.cfg.lora_rank == 0
        self.collective(collective_name).broadcast_tensors(
            _trainable_state(self.model, full), src=0
        )
        self.synced_once = True
        return version

    # ----------------------------------------------------------------- log-probs
    def _logprobs(self, model: torch.nn.Module, seqs: list[Sequence], pad_id: int) -> Tensor:
        batch = make_token_batch([s.prompt for s in seqs], [s.response for s in seqs], pad_id)
        return response_logprobs(model, batch, self.cfg.logprob_chunk_tokens, self._temperature)

    @property
    def _temperature(self) -> float:
        return self.algo.temperature if self.algo.temperature > 0 else 1.0

    @torch.no_grad()
    def _no_grad_logprobs(self, seqs: list[Sequence], pad_id: int, reference: bool) -> list[Tensor]:
        position = {id(s): i for i, s in enumerate(seqs)}
        out: list[Tensor] = [torch.empty(0)] * len(seqs)
        for micro in _micro_batches(seqs, self.algo.micro_batch_size):
            if reference:
                if self.reference is not None:
                    lp = self._logprobs(self.reference, micro, pad_id)
                else:  # LoRA: the reference is the base model without its adapters
                    with self.model.disable_adapter():
                        lp = self._logprobs(self.model, micro, pad_id)
            else:
                lp = self._logprobs(self.model, micro, pad_id)
            for i, s in enumerate(micro):
                out[position[id(s)]] = lp[i, : len(s.response)].cpu()
        return out

    def kl_to_reference(self, seqs: list[Sequence], pad_id: int) -> list[list[float]]:
        """Per-token KL estimates (``algo.kl_estimator``) of each response between the current
        policy and the frozen reference (REINFORCE++ folds them into the reward)."""
        self._onload()  # for the update that follows, which offloads again
        current = self._no_grad_logprobs(seqs, pad_id, reference=False)
        ref = self._no_grad_logprobs(seqs, pad_id, reference=True)
        return [
            kl_divergence(c, r, self.algo.kl_estimator).tolist()
            for c, r in zip(current, ref, strict=True)
        ]

    @torch.no_grad()
    def token_values(self, seqs: list[Sequence], pad_id: int) -> list[list[float]]:
        """PPO: the value head's estimate before each response token (the critic's values at
        rollout time, for GAE)."""
        self._onload()  # for the update that follows, which offloads again
        position = {id(s): i for i, s in enumerate(seqs)}
        out: list[list[float]] = [[] for _ in seqs]
        for micro in _micro_batches(seqs, self.algo.micro_batch_size):
            batch = make_token_batch([s.prompt for s in micro], [s.response for s in micro], pad_id)
            _, values = response_logprobs(
                self.model, batch, self.cfg.logprob_chunk_tokens, self._temperature, self.value_head
            )
            for i, s in enumerate(micro):
                out[position[id(s)]] = values[i, : len(s.response)].cpu().tolist()
        return out

    # ----------------------------------------------------------------- update

    def train(
        self,
        minibatches: list[list[Sequence]],
        denominators: list[float],
        active: list[bool],
        pad_id: int,
        step: int,
    ) -> dict[str, float]:
        """One optimizer step per minibatch, ``algo.update_epochs`` times.

        Args:
            minibatches: this rank's share of each minibatch.
            denominators: per minibatch, the aggregation's normaliser over all ranks (valid
                tokens for ``token-mean``, responses otherwise), so that micro-batches and
                ranks add up to exactly the loss of the whole minibatch.
            active: per minibatch, whether any rank has a response with a non-zero gradient
                (with ``skip_zero_advantage``); an inactive minibatch makes no optimizer step.
            pad_id: the tokenizer's padding id.
            step: the training step (for the learning-rate warm-up).
        """
        a = self.algo
        self._onload()
        lr = self.learner.set_lr(step)  # warm-up only: no decay
        settings = LossSettings.of(a)
        timings = {"logprob_s": 0.0, "train_s": 0.0}
        t0 = time.perf_counter()
        need_kl = settings.kl_coef > 0
        flat = [s for mb in minibatches for s in mb]
        old = None if a.on_policy else self._no_grad_logprobs(flat, pad_id, reference=False)
        ref = self._no_grad_logprobs(flat, pad_id, reference=True) if need_kl else None
        timings["logprob_s"] = time.perf_counter() - t0
        index = {id(s): i for i, s in enumerate(flat)}
        skip = a.skip_zero_advantage and not need_kl and not settings.value_coef
        sums: dict[str, float] = {}
        grad_norms, skipped, updates, skipped_seqs, measured = [], 0, 0, 0, 0
        t1 = time.perf_counter()
        for _ in range(a.update_epochs):
            for mb, counts, live in zip(minibatches, denominators, active, strict=True):
                todo = [s for s in mb if not (skip and s.zero_advantage)]
                skipped_seqs += len(mb) - len(todo)
                if skip and not live:
                    continue
                self.learner.zero_grad()
                for micro in _micro_batches(todo, a.micro_batch_size):
                    batch = make_token_batch(
                        [s.prompt for s in micro], [s.response for s in micro], pad_id
                    )
                    mask = batch.response_mask.to(self.device)
                    out = response_logprobs(
                        self.model,
                        batch,
                        self.cfg.logprob_chunk_tokens,
                        self._temperature,
                        self.value_head,
                    )
                    logprob, values = out if self.value_head is not None else (out, None)

                    def padded(rows: list[Any], mask: Tensor = mask) -> Tensor:
                        return _pad(rows, mask.shape).to(self.device)

                    loss, metrics = objective(
                        settings,
                        counts,
                        logprob=logprob,
                        old_logprob=logprob.detach()
                        if old is None
                        else padded([old[index[id(s)]] for s in micro]),
                        advantages=padded([s.advantages for s in micro]),
                        mask=mask,
                        values=values,
                        old_values=None if values is None else padded([s.values for s in micro]),
                        returns=None if values is None else padded([s.returns for s in micro]),
                        ref_logprob=None
                        if ref is None
                        else padded([ref[index[id(s)]] for s in micro]),
                    )
                    self.learner.backward(loss)
                    for k, v in metrics.items():  # shares of the minibatch's values
                        sums[k] = sums.get(k, 0.0) + v
                measured += 1
                norm = self.learner.step()
                if math.isfinite(norm):
                    updates += 1
                    grad_norms.append(norm)
                else:
                    skipped += 1
        timings["train_s"] = time.perf_counter() - t1
        self._offload()
        # this rank's share of each minibatch's value, summed over the ranks by the caller
        out = {f"train/{k}": v / measured for k, v in sums.items()} if measured else {}
        out.update(
            {
                "train/lr": lr,
                "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
                "train/updates": float(updates),
                "train/skipped_updates": float(skipped),
                "train/nan_streak": float(self.nan_streak),
                "train/skipped_zero_advantage": float(skipped_seqs),
                "time/logprob_s": timings["logprob_s"],
                "time/train_s": timings["train_s"],
            }
        )
        return out

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: str) -> None:
        """Rank 0: the model as a Hugging Face folder (``<path>/model``, usable as
        ``model.path``; LoRA: the adapter) and the optimizer state (identical on every rank:
        the ranks apply the same averaged gradients); every rank: its RNG state."""
        folder = Path(path)
        state: dict[str, Any] = {"rng": torch.get_rng_state()}
        if self.rank == 0:
            self.model.save_pretrained(folder / "model")
            load_tokenizer(self.cfg).save_pretrained(folder / "model")
            state.update(self.learner.state_dict())
            if self.value_head is not None:  # PPO's critic
                state["value_head"] = {k: v.cpu() for k, v in self.value_head.state_dict().items()}
        torch.save(state, folder / f"actor_{self.rank}.pt")

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote."""
        folder = Path(path)
        if self.cfg.lora_rank > 0:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(
                self.model, load_file(folder / "model" / "adapter_model.safetensors")
            )
        else:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(folder / "model")
            self.model.load_state_dict(saved.state_dict())
        shared = torch.load(folder / "actor_0.pt", weights_only=False)
        if self.value_head is not None:
            if "value_head" not in shared:
                raise RuntimeError(
                    f"{folder} holds no value head: it was written by a run without a critic "
                    "(resume it with the algorithm it was trained with)"
                )
            self.value_head.load_state_dict(shared["value_head"])
        self.learner.load_state_dict(shared)
        own = folder / f"actor_{self.rank}.pt"
        if own.exists():
            torch.set_rng_state(torch.load(own, weights_only=False)["rng"])


def _micro_batches(seqs: list[Sequence], size: int) -> list[list[Sequence]]:
    """Micro-batches of ``size`` responses, grouped by length (less padding)."""
    ordered = sorted(seqs, key=lambda s: len(s.prompt) + len(s.response))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _pad(rows: list[Any], shape: torch.Size) -> Tensor:
    """Right-pad per-response token values (lists or tensors) into a ``[B, L]`` float tensor."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        r = torch.as_tensor(r, dtype=torch.float32)
        out[i, : r.numel()] = r
    return out

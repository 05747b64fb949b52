"""Sampling ``n`` responses per prompt with a KV cache, dropping finished rows as they end.

:func:`sample_responses` prefills each prompt once, repeats its KV cache ``n`` times, then
decodes token by token. A row that emitted an end-of-sequence token or a stop string leaves
the batch (its cache rows are removed), so the cost of a step follows the rows still running,
not the longest one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from rlinf_vla.policies.base import kv_cache

Finish = Literal["stop", "length"]


@dataclass
class Response:
    """One sampled response: its token ids (with the end token, if any) and why it ended."""

    tokens: list[int]
    finish: Finish


def encode_prompts(
    tokenizer: Any,
    questions: list[str],
    system_prompt: str,
    suffix: str,
    max_tokens: int,
) -> tuple[list[list[int]], int]:
    """Chat-formatted prompt token ids, questions truncated (from the left) to ``max_tokens``.

    Tokenizers without a chat template get ``system_prompt``, a blank line and the question.

    Returns:
        ``(ids per prompt, number of truncated prompts)``.
    """

    def render(question: str) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": question + suffix})
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        else:
            text = (system_prompt + "\n\n" if system_prompt else "") + question + suffix + "\n"
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out, truncated = [], 0
    for q in questions:
        ids = render(q)
        if len(ids) > max_tokens:
            truncated += 1
            q_ids = tokenizer(q, add_special_tokens=False)["input_ids"]
            keep = max(1, len(q_ids) - (len(ids) - max_tokens))
            while len(ids) > max_tokens and keep > 0:
                ids = render(tokenizer.decode(q_ids[-keep:]))
                keep -= max(1, len(ids) - max_tokens)
            ids = ids[-max_tokens:]
        out.append(ids)
    return out, truncated


def _sample(
    logits: Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
    groups: list[tuple[torch.Generator, Tensor]] | None = None,
) -> Tensor:
    """``[A, V]`` logits -> ``[A]`` token ids (greedy when ``temperature == 0``).

    ``groups``: ``(generator, rows)`` pairs; the tokens of ``rows`` are drawn from their own
    generator (instead of ``generator``), so that they do not depend on the other rows."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if groups is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for gen, rows in groups:
        out[rows] = torch.multinomial(probs[rows], 1, generator=gen).squeeze(-1)
    return out


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_strings: tuple[str, ...] = (),
    tokenizer: Any = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> list[list[Response]]:
    """``n`` responses for each prompt.

    Args:
        model: a causal LM (Hugging Face interface, ``DynamicCache``).
        prompts: ``P`` token-id lists.
        n: responses per prompt (a GRPO group).
        eos_ids: tokens that end a response (kept as its last token).
        stop_strings: a response also ends once its decoded tail contains one of these
            (needs ``tokenizer``).
        temperature: 0 for greedy decoding.
        generator: one generator for every draw, or one per prompt: then prompt ``i``'s
            responses are drawn from ``generator[i]`` alone and are the same whichever prompts
            are sampled beside it (up to the rounding of the batched forward pass).

    Returns:
        ``[P][n]`` responses; rows of prompt ``i`` are ``i*n ... i*n + n - 1``.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    P, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((P, width), pad_id, dtype=torch.long)
    mask = torch.zeros((P, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **kv_cache(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
    if n > 1:
        cache.batch_repeat_interleave(n)
    mask = mask.repeat_interleave(n, dim=0)
    next_pos = positions[:, -1].repeat_interleave(n) + 1
    rows = list(range(P * n))  # active row -> response index
    tokens: list[list[int]] = [[] for _ in range(P * n)]
    finish: list[Finish] = ["length"] * (P * n)
    max_stop = max((len(s) for s in stop_strings), default=0)
    per_prompt = isinstance(generator, list)
    if per_prompt and len(generator) != P:
        raise ValueError(f"{len(generator)} generators for {P} prompts")
    for step in range(max_new_tokens):
        groups = _prompt_rows(rows, n, generator, device) if per_prompt else None
        chosen = _sample(
            logits, temperature, top_p, top_k, None if per_prompt else generator, groups
        )
        keep = []
        for a, tok in enumerate(chosen.tolist()):
            r = rows[a]
            tokens[r].append(tok)
            done = tok in eos_ids
            if not done and stop_strings:
                tail = tokenizer.decode(tokens[r][-(max_stop + 4) :])
                done = any(s in tail for s in stop_strings)
            if done:
                finish[r] = "stop"
            else:
                keep.append(a)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(rows):
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            mask, next_pos, chosen = mask[idx], next_pos[idx], chosen[idx]
            rows = [rows[a] for a in keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        out = model(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            **kv_cache(model, cache),
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    return [[Response(tokens[i * n + j], finish[i * n + j]) for j in range(n)] for i in range(P)]


def _prompt_rows(
    rows: list[int], n: int, generators: list[torch.Generator], device: torch.device
) -> list[tuple[torch.Generator, Tensor]]:
    """The active rows of each prompt (response ``r`` belongs to prompt ``r // n``) with that
    prompt's generator."""
    by_prompt: dict[int, list[int]] = {}
    for a, r in enumerate(rows):
        by_prompt.setdefault(r // n, []).append(a)
    return [(generators[i], torch.tensor(active, device=device)) for i, active in by_prompt.items()]

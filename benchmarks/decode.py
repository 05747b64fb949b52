"""OpenVLA's ``act`` with the static decoder against the same ``act`` decoding each token with
Hugging Face's ``LlamaModel.forward`` and a ``DynamicCache``; prints a table and writes JSON.

    python benchmarks/decode.py                       # tiny preset, CPU, 1 torch thread
    python benchmarks/decode.py --chunk-sizes 1 2 --batches 1 4 8 --threads 2

Both calls do the whole of ``act`` (the image and prompt pass, ``K * A`` sampled tokens, the
re-scoring pass of ``exact_logprob``, the actions); they differ only in how each token after
the first is decoded: :class:`~rlinf_vla.policies.llama_decode.LlamaStepDecoder` (what
``act`` runs) or one ``forward`` per token with the mask grown by one column, as
``transformers`` generation does (the baseline, in this file). They are timed in turn, call
after call in the same process, so a drift of the machine's speed reaches both alike; the
table gives each one's median and their ratio. Before timing, both decode the same greedy
tokens (checked). Tiny preset, 64 px images, float32; the benchmark workers compute with one
torch thread on a 2-core machine, hence ``--threads 1`` by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from rlinf_vla.policies import make_policy
from rlinf_vla.policies.base import kv_cache
from rlinf_vla.policies.heads import categorical_logprob_entropy
from rlinf_vla.types import Observation


@torch.no_grad()
def act_with_forward_per_token(policy: Any, obs: Observation, greedy: bool = False) -> torch.Tensor:
    """``policy.act(obs)``'s work with each token after the first decoded by one
    ``LlamaModel.forward`` on a ``DynamicCache``; returns the action tokens ``[B, K, A]``."""
    from transformers import DynamicCache

    prefix = policy._prefix(obs)
    embeds, mask, positions = prefix
    cache = kv_cache(policy.vla.language_model.model, DynamicCache())
    hidden = policy._lm(embeds, mask, positions, use_cache=True, **cache).last_hidden_state[:, -1]
    policy._value(hidden, obs)
    position = positions[:, -1:]
    n = policy.num_action_tokens
    tokens = []
    for i in range(n):
        logits = policy.action_logits(hidden)
        probs = torch.softmax(logits, -1)
        index = logits.argmax(-1) if greedy else torch.multinomial(probs, 1).squeeze(-1)
        categorical_logprob_entropy(logits, index)
        token = policy.processor.action_tokenizer.from_index(index)
        tokens.append(token)
        if i + 1 < n:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = position + 1
            out = policy._lm(
                policy.vla.embed_tokens(token[:, None]), mask, position, use_cache=True, **cache
            )
            hidden = out.last_hidden_state[:, -1]
    ids = policy._shape_tokens(torch.stack(tokens, dim=1))
    if policy.config.exact_logprob:
        policy._score(prefix, ids, obs)
    policy.processor.tokens_to_actions(ids.cpu())
    return ids


def observation(batch: int, size: int = 64) -> Observation:
    g = torch.Generator().manual_seed(batch)
    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=g)
    return Observation({"main": images}, None, ["pick up the red cube"] * batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=40, help="timed calls of each, in turn")
    parser.add_argument("--output", type=Path, default=Path("runs/decode.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print("chunk  batch  tokens  forward/token ms  static ms   x")
    for chunk in args.chunk_sizes:
        policy = make_policy("openvla", preset="tiny", chunk_size=chunk, seed=0, device="cpu")
        policy.eval()
        for batch in args.batches:
            obs = observation(batch)
            ours = policy.act(obs, greedy=True).replay["action_tokens"]
            theirs = act_with_forward_per_token(policy, obs, greedy=True)
            if not torch.equal(ours, theirs):
                raise SystemExit(f"chunk {chunk}, batch {batch}: greedy tokens differ")
            base, static = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                act_with_forward_per_token(policy, obs)
                t1 = time.perf_counter()
                policy.act(obs)
                t2 = time.perf_counter()
                base.append(t1 - t0)
                static.append(t2 - t1)
            row = {
                "chunk_size": chunk,
                "batch": batch,
                "tokens": policy.num_action_tokens,
                "forward_per_token_ms": 1e3 * statistics.median(base),
                "static_ms": 1e3 * statistics.median(static),
            }
            row["speedup"] = row["forward_per_token_ms"] / row["static_ms"]
            rows.append(row)
            print(
                f"{chunk:5d}  {batch:5d}  {row['tokens']:6d}  {row['forward_per_token_ms']:16.1f}"
                f"  {row['static_ms']:9.1f}  {row['speedup']:.2f}",
                flush=True,
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "load_avg": list(os.getloadavg()),
    }
    args.output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

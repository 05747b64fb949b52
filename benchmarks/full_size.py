"""The published policy sizes on one GPU: ``act``, its repeated step against the memory-bandwidth
bound, the LoRA update step and checkpoint save/load. Prints tables and writes JSON.

    python benchmarks/full_size.py                                   # all four families (CUDA)
    python benchmarks/full_size.py --families openvla --batches 1 8
    python benchmarks/full_size.py --preset tiny --device cpu --batches 1 2 --update-batches 2

Random weights at the official dimensions (OpenVLA-7B, OpenVLA-OFT-7B with its L1 head, π0 and
π0.5 at 3B), bfloat16 on CUDA (``--preset tiny --device cpu`` runs the same code on the tiny
configs in float32: a check of the script, not a figure). Each family runs in a subprocess of its
own, so one family's memory never counts in the next. Per family:

- **build**: seconds to build the policy on the device, parameters, weight bytes.
- **act** at each batch (default 1, 8, 32, 64, 128): median latency of ``policy.act(obs)`` with
  the observation in host memory, as a rollout worker receives it from the env workers;
  ``actions/s = B K / latency``; ``torch.cuda.max_memory_allocated`` during the calls;
  ``inputs`` is the part of a call spent turning images and instructions into model inputs.
- **step**, the part of ``act`` repeated per action: OpenVLA's token step (one language-model
  pass of one token over the KV cache, the restricted logits and the sample: 7 per action), the
  π0/π0.5 denoising step (the action expert over the cached prefix: 10 per chunk). OpenVLA-OFT
  decodes the chunk in one parallel pass: its step is the whole ``act``. ``bound`` is the time
  to read that part's weights once from GPU memory at the bandwidth of a device copy measured
  in the same run (for OFT the larger of that and its FLOPs at the measured bf16 matmul rate);
  ``ratio = measured / bound``.
- **update**: a LoRA adapter (rank ``--lora-rank`` on the family's default targets, the
  language backbone; the heads outside it train fully) is added, then one update step is timed
  at each of ``--update-batches``: ``evaluate`` of the sampled actions, the clipped PPO loss
  with a value loss, backward and AdamW. Seconds and peak memory.
- **checkpoint**: ``save_pretrained`` of the LoRA policy (official layout; the LoRA merged into
  the weights file, the adapter beside it) and ``make_policy(checkpoint=...)`` back onto the
  device: seconds and GB on disk (``--no-checkpoint`` skips it).

Results go to ``benchmarks/results/full_size.json`` (rewritten after every family).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The families' inputs and chunk sizes are benchmarks/policies.py's.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from policies import CHUNK, FAMILIES, INPUTS, TINY_CHUNK

GIB = 2**30


def obs_batch(name: str, batch: int, size: int, seed: int = 0) -> Any:
    """A host-memory observation of ``batch`` envs: random ``size`` px images, state in [-1, 1]."""
    import torch

    from rlinf_vla.types import Observation

    cameras, state_dim = INPUTS[name]
    g = torch.Generator().manual_seed(seed)
    images = {
        k: torch.randint(0, 256, (batch, size, size, 3), generator=g, dtype=torch.uint8)
        for k in cameras
    }
    state = None if state_dim is None else torch.rand(batch, state_dim, generator=g) * 2 - 1
    return Observation(
        images=images, state=state, instruction=["put the bowl on the plate"] * batch
    )


class Timer:
    """Wall-clock seconds of a callable, the device synchronised around it."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        self._sync = torch.cuda.synchronize if self.cuda else (lambda: None)

    def __call__(self, fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        self._sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - t)
        return times


def _ms(times: list[float]) -> float:
    return round(1000 * statistics.median(times), 3)


def param_bytes(module: Any, skip: tuple[str, ...] = ()) -> int:
    """Bytes of ``module``'s parameters, leaving out names containing any of ``skip``."""
    return sum(
        p.numel() * p.element_size()
        for n, p in module.named_parameters()
        if not any(s in n for s in skip)
    )


def peak_mib(device: str) -> float | None:
    import torch

    if device.startswith("cuda"):
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return None


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------------------------
# The device: copy bandwidth and bf16 matmul rate
# ----------------------------------------------------------------------------------------------
def device_rates(device: str) -> dict[str, Any]:
    """Memory bandwidth of a device copy (bytes read + written per second) and the bf16 matmul
    rate of an 8192^3 product (a quarter of that size on CPU)."""
    import torch

    timer = Timer(device)
    n = (2 * GIB) if device.startswith("cuda") else (256 * 2**20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = _ms(timer(lambda: dst.copy_(src), repeats=10, warmup=3)) / 1000
    src = dst = None  # the memory back before the matmul
    m = 8192 if device.startswith("cuda") else 1024
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    mm = _ms(timer(lambda: a @ b, repeats=10, warmup=3)) / 1000
    out = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "copy_bandwidth_gbs": round(2 * n / copy / 1e9, 1),
        "matmul_tflops": round(2 * m**3 / mm / 1e12, 1),
    }
    if device.startswith("cuda"):
        out["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    return out


# ----------------------------------------------------------------------------------------------
# One family
# ----------------------------------------------------------------------------------------------
def build(args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch

    from rlinf_vla.policies import make_policy

    name, preset = args["family"], args["preset"]
    kw: dict[str, Any] = {
        "preset": preset,
        "device": args["device"],
        "chunk_size": (CHUNK if preset == "full" else TINY_CHUNK)[name],
        "seed": 0,
    }
    if name.startswith("pi0") and preset == "full":
        kw["num_steps"] = 10  # openpi's inference default
    if name == "openvla_oft":
        kw["action_dim"] = 7
    timer = Timer(args["device"])
    t0 = time.perf_counter()
    policy = make_policy(name, **kw)
    timer._sync()
    build_s = time.perf_counter() - t0
    policy.eval()
    info = {
        "build_s": round(build_s, 2),
        "params_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 1),
        "weights_gib": round(param_bytes(policy) / GIB, 2),
        "dtype": str(policy.config.torch_dtype).replace("torch.", ""),
        "chunk": policy.config.chunk_size,
    }
    torch.manual_seed(0)
    return policy, info


def model_inputs(policy: Any, obs: Any) -> Any:
    """The family's input transforms, the way ``act`` runs them (images to pixel values,
    instructions to ids, state), results on the policy's device."""
    device = policy.device
    if hasattr(policy, "paligemma_with_expert"):
        inputs = policy.processor(obs, device)
        return inputs.images.to(device), inputs.tokens.to(device)
    pixels = policy.processor.pixel_values(obs, device)
    prompts = policy.processor.prompts(obs.instruction, device)
    return pixels, prompts.input_ids


def measure_act(policy: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    name, device = args["family"], args["device"]
    timer = Timer(device)
    size = 224 if args["preset"] == "full" else 64
    rows = []
    for batch in sorted(args["batches"]):
        obs = obs_batch(name, batch, size)
        try:
            reset_peak(device)
            times = timer(lambda obs=obs: policy.act(obs), args["repeats"], args["warmup"])
            inputs = timer(lambda obs=obs: model_inputs(policy, obs), args["repeats"], 1)
        except Exception as e:  # an OOM at a large batch ends the sweep, not the family
            rows.append({"batch": batch, "error": _short(e)})
            _free(device)
            break
        row = {
            "batch": batch,
            "act_ms": _ms(times),
            "act_ms_min": round(1000 * min(times), 3),
            "actions_per_s": round(batch * policy.config.chunk_size / statistics.median(times), 1),
            "inputs_ms": _ms(inputs),
            "peak_mib": peak_mib(device),
        }
        rows.append(row)
        print(f"  act B={batch}: {row}", flush=True)
    return rows


def measure_step(policy: Any, args: dict[str, Any], rates: dict[str, Any]) -> dict[str, Any]:
    """The repeated step of ``act`` at each batch of ``--step-batches``, and its bound."""
    import torch

    name, device = args["family"], args["device"]
    timer = Timer(device)
    size = 224 if args["preset"] == "full" else 64
    bandwidth = rates["copy_bandwidth_gbs"] * 1e9
    out: dict[str, Any] = {}
    with torch.no_grad():
        if name == "openvla":
            from transformers import DynamicCache

            from rlinf_vla.policies.base import kv_cache

            lm = policy.vla.language_model
            # A token step reads every language-model weight but the embedding table (one row).
            nbytes = param_bytes(lm, skip=("embed_tokens",))
            out.update(part="language model token step", weights_gib=round(nbytes / GIB, 2))
            rows = []
            for batch in args["step_batches"]:
                obs = obs_batch(name, batch, size)
                embeds, mask, positions = policy._prefix(obs)
                cache = kv_cache(lm.model, DynamicCache())
                hidden = policy._lm(embeds, mask, positions, use_cache=True, **cache)
                state = {
                    "hidden": hidden.last_hidden_state[:, -1],
                    "mask": mask,
                    "position": positions[:, -1:],
                }

                def token_step(state: dict[str, Any] = state, cache: Any = cache) -> None:
                    # The body of OpenVLAPolicy._act's decoding loop.
                    logits = policy.action_logits(state["hidden"])
                    index = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)
                    token = policy.processor.action_tokenizer.from_index(index)
                    m = state["mask"]
                    state["mask"] = torch.cat([m, m.new_ones(m.shape[0], 1)], dim=1)
                    state["position"] = state["position"] + 1
                    o = policy._lm(
                        policy.vla.embed_tokens(token[:, None]),
                        state["mask"],
                        state["position"],
                        use_cache=True,
                        **cache,
                    )
                    state["hidden"] = o.last_hidden_state[:, -1]

                times = timer(token_step, repeats=6, warmup=1)  # 7 tokens: one action
                rows.append({"batch": batch, "step_ms": _ms(times)})
            bound = nbytes / bandwidth
        elif name in ("pi0", "pi05"):
            expert = policy.paligemma_with_expert.gemma_expert
            heads = [policy.action_in_proj, policy.action_out_proj]
            for extra in ("time_mlp_in", "time_mlp_out", "action_time_mlp_in", "state_proj"):
                if hasattr(policy, extra):
                    heads.append(getattr(policy, extra))
            if hasattr(policy, "action_time_mlp_out"):
                heads.append(policy.action_time_mlp_out)
            nbytes = param_bytes(expert) + sum(param_bytes(h) for h in heads)
            out.update(part="action expert denoising step", weights_gib=round(nbytes / GIB, 3))
            cfg = policy.config
            rows = []
            for batch in args["step_batches"]:
                obs = obs_batch(name, batch, size)
                inputs = policy.processor(obs, policy.device)
                prefix = policy._prefix_pass(inputs)
                x = torch.randn(batch, cfg.action_horizon, cfg.max_action_dim, device=policy.device)
                ks = torch.zeros(batch, dtype=torch.long, device=policy.device)

                def denoise_step(
                    inputs: Any = inputs, prefix: Any = prefix, x: Any = x, ks: Any = ks
                ) -> None:
                    policy._transition(inputs, prefix, x, ks, ks == 0)

                times = timer(denoise_step, repeats=max(args["repeats"], 5), warmup=1)
                rows.append({"batch": batch, "step_ms": _ms(times)})
            bound = nbytes / bandwidth
        else:  # openvla_oft: one parallel pass is the whole act
            lm = policy.vla.language_model
            seen: dict[str, int] = {}

            def count_tokens(_m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
                seen["tokens"] = int(kwargs["inputs_embeds"].shape[1])

            handle = lm.model.register_forward_pre_hook(count_tokens, with_kwargs=True)
            obs = obs_batch(name, 1, size)
            policy.act(obs)
            handle.remove()
            nbytes = param_bytes(policy, skip=("embed_tokens",))
            llm_params = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
            vision = policy.vla.vision_backbone
            patches = vision.num_patches * len(policy.config.image_keys)
            flops = (
                2 * llm_params * seen["tokens"]
                + 2 * sum(p.numel() for p in vision.parameters()) * patches
            )
            out.update(
                part="whole act (one parallel pass)",
                weights_gib=round(nbytes / GIB, 2),
                tokens=seen["tokens"],
                tflop=round(flops / 1e12, 2),
            )
            rows = []
            for batch in args["step_batches"]:
                obs = obs_batch(name, batch, size)
                times = timer(lambda obs=obs: policy.act(obs), repeats=args["repeats"], warmup=1)
                rows.append({"batch": batch, "step_ms": _ms(times)})
            bound = max(nbytes / bandwidth, flops / (rates["matmul_tflops"] * 1e12))
    for r in rows:
        r["bound_ms"] = round(1000 * bound * (r["batch"] if name == "openvla_oft" else 1), 3)
        r["ratio"] = round(r["step_ms"] / r["bound_ms"], 2)
    out["rows"] = rows
    print(f"  step: {out}", flush=True)
    return out


def measure_update(policy: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Add LoRA, then time one PPO update step (evaluate, loss, backward, AdamW)."""
    import torch

    name, device = args["family"], args["device"]
    timer = Timer(device)
    size = 224 if args["preset"] == "full" else 64
    policy.config = policy.config.replace(lora_rank=args["lora_rank"], lora_alpha=args["lora_rank"])
    policy._add_lora()
    if args["grad_ckpt"]:
        policy.enable_gradient_checkpointing()
    policy.train()
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    out: dict[str, Any] = {
        "lora_rank": args["lora_rank"],
        "trainable_m": round(sum(p.numel() for p in trainable) / 1e6, 2),
        "gradient_checkpointing": args["grad_ckpt"],
        "rows": [],
    }
    for batch in args["update_batches"]:
        obs = obs_batch(name, batch, size, seed=1)
        try:
            with torch.no_grad():
                sampled = policy.act(obs)
            advantages = torch.randn(sampled.logprob.shape, device=sampled.logprob.device)

            def step(obs: Any = obs, sampled: Any = sampled, adv: Any = advantages) -> None:
                ev = policy.evaluate(obs, sampled.replay)
                ratio = torch.exp(ev.logprob - sampled.logprob)
                clipped = torch.clamp(ratio, 0.8, 1.28)
                loss = -torch.min(ratio * adv, clipped * adv).mean()
                if ev.value is not None:
                    loss = (
                        loss + 0.5 * (ev.value - adv.reshape(adv.shape[0], -1)[:, 0]).pow(2).mean()
                    )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            reset_peak(device)
            times = timer(step, repeats=max(2, args["repeats"] // 2), warmup=1)
            row = {
                "batch": batch,
                "update_s": round(statistics.median(times), 3),
                "peak_mib": peak_mib(device),
            }
        except Exception as e:
            row = {"batch": batch, "error": _short(e)}
            optimizer.zero_grad(set_to_none=True)
            _free(device)
        out["rows"].append(row)
        print(f"  update: {row}", flush=True)
    policy.eval()
    return out


def measure_checkpoint(policy: Any, args: dict[str, Any]) -> dict[str, Any]:
    from rlinf_vla.policies import make_policy

    timer = Timer(args["device"])
    root = Path(tempfile.mkdtemp(prefix="full_size_", dir=args["scratch"]))
    try:
        path = root / "ckpt"
        t0 = time.perf_counter()
        policy.save_pretrained(path)
        save_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        _free(args["device"])
        t0 = time.perf_counter()
        loaded = make_policy(args["family"], checkpoint=str(path), device=args["device"])
        timer._sync()
        load_s = time.perf_counter() - t0
        del loaded
        out = {
            "save_s": round(save_s, 2),
            "load_s": round(load_s, 2),
            "disk_gb": round(size / 1e9, 2),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"  checkpoint: {out}", flush=True)
    return out


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_family(args: dict[str, Any], queue: Any) -> None:
    """Child process: every measurement of one family; partial results survive an error."""
    import torch

    torch.set_grad_enabled(True)
    result: dict[str, Any] = {"family": args["family"]}
    try:
        print(f"{args['family']}: building ...", flush=True)
        policy, info = build(args)
        result.update(info)
        print(f"  built: {info}", flush=True)
        result["act"] = measure_act(policy, args)
        if args["step_batches"]:
            result["step"] = measure_step(policy, args, args["rates"])
        _free(args["device"])
        if args["update_batches"]:
            result["update"] = measure_update(policy, args)
            _free(args["device"])
        if args["checkpoint"]:
            result["checkpoint"] = measure_checkpoint(policy, args)
    except Exception as e:
        result["error"] = _short(e)
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], flush=True)
    queue.put(result)


def _in_child(target: Callable[..., None], args: Any, timeout: float) -> Any:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(args, queue))
    proc.start()
    try:
        return queue.get(timeout=timeout)
    except queue_mod.Empty:
        return {"error": f"no result within {timeout:.0f} s (timed out or crashed)"}
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _rates_child(device: str, queue: Any) -> None:
    queue.put(device_rates(device))


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------
def table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    rows = [r for r in rows if r]
    if not rows:
        return
    cols = [c for c in cols if any(c in r for r in rows)]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print(f"\n{title}")
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def section_rows(fams: list[dict[str, Any]], section: str, key: str) -> list[dict[str, Any]]:
    """One row per entry of ``family[section]["rows"]``, with the family and ``section[key]``."""
    return [
        {"family": f["family"], key: f[section][key], **r}
        for f in fams
        if section in f
        for r in f[section]["rows"]
    ]


def print_tables(result: dict[str, Any]) -> None:
    fams = result["families"]
    table(
        "build",
        [
            {
                "family": f["family"],
                **{
                    k: f.get(k)
                    for k in ("params_m", "weights_gib", "dtype", "build_s", "error")
                    if k in f
                },
            }
            for f in fams
        ],
        ["family", "params_m", "weights_gib", "dtype", "build_s", "error"],
    )
    table(
        "act (observation in host memory)",
        [
            {"family": f["family"], "chunk": f.get("chunk"), **r}
            for f in fams
            for r in f.get("act", [])
        ],
        [
            "family",
            "batch",
            "chunk",
            "act_ms",
            "act_ms_min",
            "actions_per_s",
            "inputs_ms",
            "peak_mib",
            "error",
        ],
    )
    table(
        "repeated step vs. the bound",
        section_rows(fams, "step", "part"),
        ["family", "part", "batch", "step_ms", "bound_ms", "ratio"],
    )
    table(
        "LoRA update step",
        section_rows(fams, "update", "trainable_m"),
        ["family", "trainable_m", "batch", "update_s", "peak_mib", "error"],
    )
    table(
        "checkpoint",
        [{"family": f["family"], **f["checkpoint"]} for f in fams if "checkpoint" in f],
        ["family", "save_s", "load_s", "disk_gb"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--preset", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    parser.add_argument("--step-batches", nargs="*", type=int, default=[1, 32])
    parser.add_argument("--update-batches", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per family")
    parser.add_argument("--scratch", default=None, help="folder for checkpoints (default: tmp)")
    parser.add_argument("--output", default="benchmarks/results/full_size.json")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.preset == "full" and not device.startswith("cuda"):
        parser.error("the full preset needs a CUDA device (use --preset tiny --device cpu)")
    rates = _in_child(_rates_child, device, 300)
    print(f"device: {rates}", flush=True)
    result: dict[str, Any] = {
        "benchmark": "full_size",
        "preset": args.preset,
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "device": rates,
        "families": [],
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for fam in args.families:
        child = {
            "family": fam,
            "preset": args.preset,
            "device": device,
            "batches": args.batches,
            "step_batches": args.step_batches,
            "update_batches": args.update_batches,
            "lora_rank": args.lora_rank,
            "grad_ckpt": args.grad_ckpt,
            "checkpoint": not args.no_checkpoint,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rates": rates,
            "scratch": args.scratch,
        }
        res = _in_child(run_family, child, args.timeout)
        res.setdefault("family", fam)
        result["families"].append(res)
        out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"\nwrote {out}")
    return 0 if not any("error" in f for f in result["families"]) else 1


if __name__ == "__main__":
    sys.exit(main())

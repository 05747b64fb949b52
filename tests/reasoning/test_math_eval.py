"""`rlinf-vla math-eval`: the metrics against hand arithmetic on stored responses, resuming,
config errors, and one run on the bundled SmolLM2 model."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlinf_vla import cli
from rlinf_vla.config import ConfigError
from rlinf_vla.reasoning.scoring import mean_interval, pass_at_k, pass_ks, score_sample, summarize
from tests.reasoning.conftest import build_tiny_model

DATA = Path(__file__).parent / "data"
Z = 1.959963984540054


# --------------------------------------------------------------------------- metrics
def _stored() -> list[list[dict]]:
    """The fixture's responses scored with the verifier: 4 problems x 4 responses."""
    problems = []
    for line in (DATA / "stored_responses.jsonl").read_text().splitlines():
        row = json.loads(line)
        problems.append(
            [
                score_sample(r["text"], row["answer"], r["length"], r["cut"]).to_dict()
                for r in row["responses"]
            ]
        )
    return problems


def test_avg_and_pass_at_k_with_intervals_match_hand_arithmetic() -> None:
    problems = _stored()
    # correct per problem: "6": \boxed{6}, "answer is 6" (not \boxed{7}, "5") -> 2;
    # "1/2": \frac{1}{2}, 0.5, 0.5 (not 2) -> 3; "12": none -> 0; "9": all four (9.0 too) -> 4
    assert [sum(s["correct"] for s in p) for p in problems] == [2, 3, 0, 4]
    m = summarize(problems)
    assert m["problems"] == 4 and m["samples_per_problem"] == 4
    # avg@4 = (2/4 + 3/4 + 0/4 + 4/4) / 4 = 2.25 / 4
    assert m["avg@4"]["value"] == pytest.approx(0.5625)
    # deviations from 0.5625: -0.0625, 0.1875, -0.5625, 0.4375; squares sum to 0.546875
    s = math.sqrt(0.546875 / 3)  # 0.42696
    half = Z * s / 2  # / sqrt(4): 0.41841
    assert m["avg@4"]["ci95"] == pytest.approx([0.5625 - half, 0.5625 + half])
    assert m["avg@4"]["ci95"] == pytest.approx([0.14409, 0.98091], abs=1e-5)
    assert m["pass@1"]["value"] == pytest.approx(0.5625)  # pass@1 is avg@k
    # pass@2 = 1 - C(4-c, 2) / C(4, 2), C(4, 2) = 6: c=2: 1 - 1/6; c=3: 1 - 0; c=0: 1 - 6/6;
    # c=4: 1  ->  (5/6 + 1 + 0 + 1) / 4 = 17/24
    assert m["pass@2"]["value"] == pytest.approx(17 / 24)
    # pass@4: 1 unless every sample is wrong -> (1 + 1 + 0 + 1) / 4; the values 1, 1, 0, 1
    # have s = sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5, so 0.75 +- Z * 0.25, clipped at 1
    assert m["pass@4"]["value"] == pytest.approx(0.75)
    assert m["pass@4"]["ci95"] == pytest.approx([0.75 - Z * 0.25, 1.0])
    assert set(k for k in m if k.startswith("pass@")) == {"pass@1", "pass@2", "pass@4"}
    # boxed: 2 + 3 + 1 + 4 of 16 ("\boxed{1" is unclosed, read as the last number);
    # no answer: "no idea"; cut at the limit: one; lengths (24 + 24 + 28 + 21) / 16
    assert m["boxed_rate"] == pytest.approx(10 / 16)
    assert m["unparseable_rate"] == pytest.approx(1 / 16)
    assert m["cut_at_limit_rate"] == pytest.approx(1 / 16)
    assert m["mean_length"] == pytest.approx(97 / 16)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample() -> None:
    # Independently: enumerate every k-subset of n samples, c of them correct.
    for n, c in [(5, 1), (6, 2), (8, 3), (4, 0), (3, 3)]:
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            share = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(share), (n, c, k)
    assert pass_at_k(5, 1, 2) == pytest.approx(1 - 6 / 10)  # 1 - C(4,2)/C(5,2)
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    assert mean_interval([0.25]) == {"value": 0.25, "ci95": None}  # one problem: no interval
    with pytest.raises(ValueError, match="same number"):
        summarize([[{"correct": True}], []])


def test_math_grpo_evaluation_is_avg_at_1_of_the_same_scoring() -> None:
    """The trainer's held-out evaluation scores with RewardWorker.score_samples and
    aggregates with scoring.summarize; the metric names stay."""
    from rlinf_vla.reasoning.data import Problem
    from rlinf_vla.reasoning.trainer import MathGrpoRunner
    from rlinf_vla.reasoning.workers import RewardWorker

    texts = ["\\boxed{4}", "the answer is 9", "\\boxed{5}", "no idea", "\\boxed{7"]
    held = [Problem(f"q{i}", a) for i, a in enumerate(["4", "9", "6", "1", "7"])]
    worker = RewardWorker(0.0, True)

    def generate(problems, n, greedy):
        assert n == 1 and greedy
        rows = [texts[held.index(p)] for p in problems]
        return {
            "texts": [[t] for t in rows],
            "stopped": [[not t.endswith("7")] for t in rows],  # the unclosed one hit the limit
            "responses": [[[0] * len(t)] for t in rows],
        }

    fake = SimpleNamespace(
        job=SimpleNamespace(runner=SimpleNamespace(eval_batch_size=2)),
        rollout=SimpleNamespace(world_size=1),
        held_out=held,
        _generate=generate,
        reward=SimpleNamespace(scatter=lambda method, *items: [getattr(worker, method)(*items)]),
    )
    m = MathGrpoRunner.evaluate(fake)
    # right: "4" (boxed), "9" (phrase), "7" (last number of the cut "\boxed{7") -> 3 of 5
    assert m["eval/accuracy"] == pytest.approx(3 / 5)
    assert m["eval/boxed_rate"] == pytest.approx(2 / 5)  # \boxed{4}, \boxed{5}
    assert m["eval/unparseable_rate"] == pytest.approx(1 / 5)  # "no idea"
    assert m["eval/cut_at_limit_rate"] == pytest.approx(1 / 5)
    assert m["eval/response_length"] == pytest.approx(sum(map(len, texts)) / 5)


# --------------------------------------------------------------------------- the command
def _problems_file(tmp_path: Path, n: int = 6, name: str = "problems.jsonl") -> Path:
    path = tmp_path / name
    rows = [{"q": f"What is {i} + {i}?", "a": str(2 * i), "name": f"sum-{i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "math-eval",
        f"model.path={model}",
        f"data.path={data}",
        "data.prompt_field=q",
        "data.answer_field=a",
        "data.id_field=name",
        "sampling.k=2",
        "sampling.temperature=1.0",
        "sampling.top_p=1.0",
        "sampling.max_new_tokens=6",
        f"eval.output_dir={out}",
        *extra,
    ]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]


def test_resume_skips_done_problems_and_refuses_other_settings(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    data = _problems_file(tmp_path)
    out = tmp_path / "out"
    args = _args(tiny_model_dir, data, out, "eval.batch_size=2")
    assert cli.main(args) == 0
    first = _records(out)
    summary = (out / "summary.json").read_bytes()
    assert [r["index"] for r in first] == list(range(6))
    assert [r["id"] for r in first] == [f"sum-{i}" for i in range(6)]
    assert all(len(r["samples"]) == 2 for r in first)
    assert "6 problems x 2 samples, 0 already in" in capsys.readouterr().err

    # A run stopped after 3 problems, in the middle of writing the 4th line.
    lines = (out / "problems.jsonl").read_text().splitlines(keepends=True)
    (out / "problems.jsonl").write_text("".join(lines[:3]) + lines[3][:20])
    (out / "summary.json").unlink()
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "3 already in" in err and "3 to run" in err
    assert "math-eval: 6/6 problems  avg@2" in err  # the progress line
    # Each problem's samples come from its own seed: the resumed run samples them as the
    # uninterrupted one did, and the summary is the same file.
    assert _records(out) == first
    assert (out / "summary.json").read_bytes() == summary

    # Everything done: nothing is loaded, the same summary again.
    import rlinf_vla.reasoning.model as model_module

    def refuse(*a, **k):
        raise AssertionError("a finished evaluation loaded a model")

    monkeypatch.setattr(model_module, "load_model", refuse)
    monkeypatch.setattr(model_module, "load_tokenizer", refuse)
    assert cli.main(args) == 0
    assert "6 already in" in capsys.readouterr().err
    assert (out / "summary.json").read_bytes() == summary
    monkeypatch.undo()

    # Other problems beside it change nothing either (batch of 1 against batches of 2).
    other = tmp_path / "batch1"
    assert cli.main(_args(tiny_model_dir, data, other, "eval.batch_size=1")) == 0
    assert [r["samples"] for r in _records(other)] == [r["samples"] for r in first]
    capsys.readouterr()

    # Other settings into the same folder: refused, each differing setting named.
    changed = _args(
        tiny_model_dir, data, out, "sampling.temperature=0.7", "sampling.k=3", "data.limit=4"
    )
    assert cli.main(changed) == 2
    err = capsys.readouterr().err
    assert "holds results made with other settings" in err
    for key in ("sampling.temperature (1.0 there, 0.7 now)", "sampling.k (2 there, 3 now)"):
        assert key in err
    assert "data.limit (null there, 4 now)" in err
    assert "sampling.seed" not in err and "sampling.top_p" not in err
    data.write_text(data.read_text().replace('"8"', '"9"'))  # the file's content changed
    other_model = build_tiny_model(tmp_path / "other_model", seed=1)
    assert cli.main(_args(other_model, data, out)) == 2
    err = capsys.readouterr().err
    assert "data.sha256" in err and "model.path" in err and "sampling" not in err
    assert _records(out) == first  # nothing was written


def test_config_errors_name_every_key_before_any_model_loads(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    import rlinf_vla.reasoning.model as model_module

    def refuse(*a, **k):
        raise AssertionError("an invalid config loaded a model")

    monkeypatch.setattr(model_module, "load_model", refuse)
    monkeypatch.setattr(model_module, "load_tokenizer", refuse)
    data = _problems_file(tmp_path)
    out = tmp_path / "out"

    def fails(*extra: str, model: Path | str = tiny_model_dir) -> str:
        assert cli.main(_args(model, data, out, *extra)) == 2
        return capsys.readouterr().err

    err = fails(
        "sampling.k=0",
        "sampling.top_p=1.5",
        "eval.batch_size=0",
        "data.max_prompt_tokens=2",
        "model.rollout_backend=sglang",
    )
    for problem in (
        "sampling.k must be >= 1, got 0",
        "sampling.top_p must be in (0, 1], got 1.5",
        "eval.batch_size must be >= 1, got 0",
        "data.max_prompt_tokens must be >= 8, got 2",
        "model.rollout_backend: 'sglang' is not one of ['hf', 'vllm']",
    ):
        assert problem in err, problem
    assert "4 problems" in err  # one line per section: model, data, sampling, eval
    err = fails("sampling.temprature=0.5", "eval.ouput_dir=x")
    assert "unknown config key: sampling.temprature (did you mean sampling.temperature?)" in err
    assert "unknown config key: eval.ouput_dir (did you mean eval.output_dir?)" in err
    err = fails("+model.lora_rank=4")
    assert "model.lora_rank: not used by math-eval" in err and "model.{path, gguf_file" in err
    assert "sampling.k=2 with sampling.temperature=0" in fails("sampling.temperature=0")
    assert "data.path: 'missing.jsonl' is not a file" in fails("data.path=missing.jsonl")
    assert "data.path is required" in fails("data.path=null")
    assert "lacks the field(s) ['title']" in fails("data.id_field=title")
    (tmp_path / "p.csv").write_text("q,a\n")
    assert "unknown file type '.csv' (known: .jsonl, .json, .parquet)" in fails(
        f"data.path={tmp_path / 'p.csv'}"
    )
    assert "is neither a model folder nor a .gguf file, nor a hub id" in fails(
        model=tmp_path / "no_model"
    )
    assert "is neither a model folder" in fails(model="nobody/no-such-model")
    assert not out.exists()  # nothing was written


def test_a_hub_id_in_the_local_cache_is_its_snapshot_folder(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    import shutil

    import huggingface_hub.constants

    from rlinf_vla.reasoning.model import ModelConfig

    # The cache layout of huggingface_hub: refs/main names the snapshot of the commit.
    repo = tmp_path / "hub" / "models--someone--tiny-lm"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert ModelConfig(path="someone/tiny-lm").source() == (
        str(repo / "snapshots" / commit),
        None,
    )
    with pytest.raises(ConfigError, match="nor a hub id"):
        ModelConfig(path="someone/other-lm").source()


@pytest.mark.slow
def test_smollm2_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The bundled SmolLM2-135M-Instruct (GGUF, de-quantised on load), 2 problems x 2
    samples of at most 16 tokens."""
    from rlinf_vla.reasoning.model import ModelConfig

    try:
        ModelConfig().source()
    except ConfigError as e:
        pytest.skip(f"the bundled model is not installed: {e}")
    out = tmp_path / "out"
    code = cli.main(
        [
            "math-eval",
            f"data.path={DATA / 'tiny.jsonl'}",
            "data.limit=2",
            "sampling.k=2",
            "sampling.max_new_tokens=16",
            f"eval.output_dir={out}",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    table = captured.out
    assert "SmolLM2-135M-Instruct.Q4_1.gguf on tiny.jsonl: 2 problems x 2 samples" in table
    for row in ("avg@2", "pass@1", "pass@2", "boxed answers", "cut at limit"):
        assert f"  {row} " in table, row
    assert "math-eval: 2/2 problems  avg@2" in captured.err
    records = _records(out)
    wanted = [json.loads(line) for line in (DATA / "tiny.jsonl").read_text().splitlines()[:2]]
    assert [(r["prompt"], r["answer"]) for r in records] == [
        (w["prompt"], w["answer"]) for w in wanted
    ]
    samples = [s for r in records for s in r["samples"]]
    assert len(samples) == 4 and all(1 <= s["length"] <= 16 for s in samples)
    assert all(s["length"] == 16 for s in samples if s["cut"])
    assert all(s["response"] for s in samples)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["problems_done"] == 2
    m = summary["metrics"]
    assert m["avg@2"]["value"] == pytest.approx(sum(r["correct"] for r in records) / 4)
    assert m["cut_at_limit_rate"] == pytest.approx(sum(s["cut"] for s in samples) / 4)
    assert m["boxed_rate"] == pytest.approx(sum(s["boxed"] for s in samples) / 4)

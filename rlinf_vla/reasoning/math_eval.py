"""``rlinf-vla math-eval``: avg@k and pass@k of a math model on a problems file (docs/reasoning.md).

Each problem gets ``sampling.k`` responses, scored by math-grpo's verifier and aggregated by
:mod:`~rlinf_vla.reasoning.scoring`. The output folder holds::

    settings.json    what the results depend on (model, data file and its hash, sampling,
                     scoring); a later run into the folder must match it
    problems.jsonl   one line per finished problem (appended, flushed, fsync-ed)
    summary.json     the metrics with their 95 % intervals (rewritten from problems.jsonl)

A problem's samples are drawn from its own seed (``sampling.seed`` and its index in the
file), so they do not depend on which problems were sampled before or beside it: a resumed
run samples the missing problems as an uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from rlinf_vla.config import (
    ConfigError,
    SectionErrors,
    check_sections,
    device_problem,
    from_section,
)
from rlinf_vla.reasoning.data import (
    DEFAULT_SYSTEM_PROMPT,
    FILE_TYPES,
    Problem,
    read_problems,
)
from rlinf_vla.reasoning.generation import Response
from rlinf_vla.reasoning.model import ModelConfig
from rlinf_vla.reasoning.scoring import score_sample, summarize

SETTINGS_FILE = "settings.json"
PROBLEMS_FILE = "problems.jsonl"
SUMMARY_FILE = "summary.json"
INTERVAL = (
    "normal 95% interval over problems: mean +- 1.959964 * s / sqrt(N), s the sample standard "
    "deviation (N - 1) of the per-problem values, clipped to [0, 1]; none for N = 1"
)

#: the ``model`` keys an evaluation uses (the others train: LoRA, gradient checkpointing...)
MODEL_KEYS = (
    "path",
    "gguf_file",
    "dtype",
    "num_threads",
    "rollout_backend",
    "vllm_kv_cache_gib",
    "vllm_gpu_memory_fraction",
)


@dataclass
class EvalDataConfig:
    """The ``data`` section of ``rlinf-vla math-eval``.

    Attributes:
        path: the problems: a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file.
        prompt_field, answer_field: the field names of the question and the reference answer.
        id_field: a field naming each problem, copied into ``problems.jsonl`` (``None``: the
            problems are known by their row index only).
        system_prompt: the chat template's system message (``""``: none).
        prompt_suffix: appended to every question.
        max_prompt_tokens: longer prompts are cut from the left of the question (and counted).
        limit: evaluate only the first N problems of the file (``None``: all).
    """

    path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    id_field: str | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    prompt_suffix: str = ""
    max_prompt_tokens: int = 1024
    limit: int | None = None

    def __post_init__(self) -> None:
        bad = []
        if self.max_prompt_tokens < 8:
            bad.append(f"data.max_prompt_tokens must be >= 8, got {self.max_prompt_tokens}")
        if self.limit is not None and self.limit < 1:
            bad.append(f"data.limit must be >= 1 or null, got {self.limit}")
        if not self.path:
            bad.append("data.path is required: a .jsonl, .json or .parquet file of problems")
        elif not Path(self.path).is_file():
            bad.append(f"data.path: {self.path!r} is not a file")
        elif Path(self.path).suffix not in FILE_TYPES:
            bad.append(
                f"data.path: unknown file type {Path(self.path).suffix!r} "
                f"(known: {', '.join(FILE_TYPES)})"
            )
        else:
            try:
                self.read()
            except (ValueError, OSError) as e:
                bad.append(f"data.path: {e}")
        if bad:
            raise ConfigError("; ".join(bad))

    def read(self) -> list[Problem]:
        """The problems to evaluate (the first ``limit`` of the file)."""
        problems = read_problems(self.path, self.prompt_field, self.answer_field, self.id_field)
        return problems[: self.limit]


@dataclass
class SamplingConfig:
    """The ``sampling`` section.

    Attributes:
        k: responses sampled per problem (avg@k, pass@k for k' up to k).
        temperature: ``0`` for greedy decoding (then ``k`` must be 1).
        top_p, top_k: nucleus and top-k sampling (``top_k=0``: off).
        max_new_tokens: the length limit of a response; responses that reach it are counted
            (``cut_at_limit_rate``) and scored as they are.
        seed: problem ``i``'s samples are drawn from a generator seeded with ``(seed, i)``.
        stop_strings: a response also ends once it contains one of these.
    """

    k: int = 4
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 1024
    seed: int = 0
    stop_strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [
            f"sampling.{key} must be >= {low}, got {getattr(self, key)}"
            for key, low in (("k", 1), ("max_new_tokens", 1), ("top_k", 0), ("seed", 0))
            if getattr(self, key) < low
        ]
        if self.temperature < 0:
            bad.append(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad.append(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and self.k > 1:
            bad.append(
                f"sampling.k={self.k} with sampling.temperature=0: greedy decoding gives k "
                "identical responses; sample (temperature > 0) or set sampling.k=1"
            )
        if bad:
            raise ConfigError("; ".join(bad))


@dataclass
class MathEvalConfig:
    """The ``eval`` section.

    Attributes:
        output_dir: the results folder (``None``: ``runs/math-eval-<data file>-<timestamp>``);
            run again into it to resume.
        batch_size: problems sampled together (their ``k`` responses each in one batch).
        device: ``auto`` (``cuda`` when available), ``cpu``, ``cuda`` or ``cuda:N``.
        fallback_last_number: an answer without ``\\boxed{}`` or an "answer is" phrase is read
            from the last number of the response (as ``algo.fallback_last_number``).
        save_responses: keep each response's text in ``problems.jsonl``.
        progress: a progress line on stderr.
    """

    output_dir: str | None = None
    batch_size: int = 8
    device: str = "auto"
    fallback_last_number: bool = True
    save_responses: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        bad = (
            [] if self.batch_size >= 1 else [f"eval.batch_size must be >= 1, got {self.batch_size}"]
        )
        problem = device_problem(self.device, "eval.device")
        if problem:
            bad.append(problem)
        if bad:
            raise ConfigError("; ".join(bad))


@dataclass
class MathEvalJob:
    """A validated ``rlinf-vla math-eval`` job."""

    SECTIONS: ClassVar[dict[str, type]] = {
        "model": ModelConfig,
        "data": EvalDataConfig,
        "sampling": SamplingConfig,
        "eval": MathEvalConfig,
    }

    model: ModelConfig
    data: EvalDataConfig
    sampling: SamplingConfig
    eval: MathEvalConfig
    problems: list[Problem]
    output_dir: Path
    data_sha256: str
    raw: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """What the results depend on; a run into a folder that holds results must match it."""
        folder, gguf = self.model.source()
        d = self.data
        return {
            "model": {
                "path": str(Path(folder, gguf or "").resolve()),
                "dtype": self.model.dtype,
                "rollout_backend": self.model.rollout_backend,
            },
            "data": {
                "path": str(Path(d.path).resolve()),
                "sha256": self.data_sha256,
                **{k: getattr(d, k) for k in ("prompt_field", "answer_field", "id_field")},
                **{k: getattr(d, k) for k in ("system_prompt", "prompt_suffix")},
                "max_prompt_tokens": d.max_prompt_tokens,
                "limit": d.limit,
            },
            "sampling": asdict(self.sampling),
            "eval": {"fallback_last_number": self.eval.fallback_last_number},
        }


def validate(cfg: Any) -> MathEvalJob:
    """Typed sections and their checks for a composed ``math_eval`` config, and, when
    ``eval.output_dir`` holds results, that they were made with the same settings. Loads no
    model (the data file is read)."""
    from omegaconf import OmegaConf

    check_sections(cfg, MathEvalJob.SECTIONS)
    errors = SectionErrors()
    training = sorted(set(cfg["model"]) - set(MODEL_KEYS))
    if training:
        errors.add(
            f"{', '.join('model.' + k for k in training)}: not used by math-eval (training "
            f"settings); it takes model.{{{', '.join(MODEL_KEYS)}}}"
        )
    built = {
        name: errors.build(lambda c=cls, name=name: from_section(c, cfg[name], name))
        for name, cls in MathEvalJob.SECTIONS.items()
    }
    if built["model"] is not None:
        errors.build(built["model"].source)  # the weights exist
    errors.raise_any()
    data: EvalDataConfig = built["data"]
    ev: MathEvalConfig = built["eval"]
    output = Path(ev.output_dir) if ev.output_dir else _default_folder(data.path)
    job = MathEvalJob(
        **built,
        problems=data.read(),
        output_dir=output,
        data_sha256=hashlib.sha256(Path(data.path).read_bytes()).hexdigest(),
        raw=OmegaConf.to_container(cfg, resolve=True),
    )
    check_settings(output, job.settings())
    return job


def _default_folder(data_path: str) -> Path:
    from datetime import datetime

    return Path("runs") / f"math-eval-{Path(data_path).stem}-{datetime.now():%Y%m%d-%H%M%S}"


# --------------------------------------------------------------------------- the folder
def check_settings(folder: Path, settings: dict[str, Any]) -> None:
    """Refuse a folder whose results were made with other settings.

    Raises:
        ConfigError: naming each differing setting with its value there and now.
    """
    path = folder / SETTINGS_FILE
    if not path.exists():
        return
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(settings))  # as it reads back
    diff = [f"{key} ({_short(a)} there, {_short(b)} now)" for key, a, b in _differences(old, new)]
    if diff:
        raise ConfigError(
            f"eval.output_dir: {folder} holds results made with other settings, differing "
            f"in: {'; '.join(diff)}. Use another eval.output_dir, or the settings it was made with"
        )


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ProblemLog:
    """``problems.jsonl`` of a results folder: one record per finished problem, by index.

    A torn last line (a process killed while writing it) is dropped, as is a line that is not
    a record (named in a warning); their problems are sampled again.
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / PROBLEMS_FILE
        self.records: dict[int, dict[str, Any]] = {}
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        kept, dropped = [], []
        for n, line in enumerate(lines[:-1], start=1):  # after the last newline: incomplete
            try:
                record = json.loads(line)
                self.records[int(record["index"])] = record
                kept.append(line)
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    dropped.append(n)
        if dropped:
            print(
                f"math-eval: {self.path}: line(s) {dropped} are not problem records; dropped "
                "(their problems are sampled again)",
                file=sys.stderr,
            )
        if dropped or lines[-1]:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in kept))
            os.replace(tmp, self.path)

    def __contains__(self, index: int) -> bool:
        return index in self.records

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` durably (flush and fsync) and remember it."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[int(record["index"])] = record


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- sampling
def problem_seed(seed: int, index: int) -> int:
    """The seed of problem ``index``'s samples: independent streams for every
    ``(seed, index)`` (``numpy.random.SeedSequence``), in ``[0, 2**31)``."""
    import numpy as np

    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0]) & 0x7FFFFFFF


class HfBackend:
    """This package's KV-cached sampler on the Hugging Face model (``rollout_backend=hf``)."""

    def __init__(self, job: MathEvalJob, tokenizer: Any, device: torch.device):
        from rlinf_vla.reasoning.model import eos_token_ids, load_model

        self.model = load_model(job.model).to(device).eval().requires_grad_(False)
        self.eos = eos_token_ids(tokenizer, self.model.config)
        self.tokenizer, self.device, self.s = tokenizer, device, job.sampling

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> list[list[Response]]:
        from rlinf_vla.reasoning.generation import sample_responses

        s = self.s
        return sample_responses(
            self.model,
            prompts,
            s.k,
            s.max_new_tokens,
            self.eos,
            self.tokenizer.pad_token_id,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_strings=tuple(s.stop_strings),
            tokenizer=self.tokenizer,
            generator=[torch.Generator(self.device).manual_seed(x) for x in seeds],
        )

    def close(self) -> None:
        del self.model


class VllmBackend:
    """A vLLM engine in this process (``rollout_backend=vllm``), each problem's request
    seeded with its own seed."""

    def __init__(self, job: MathEvalJob, tokenizer: Any, device: torch.device):
        from rlinf_vla.reasoning.model import eos_token_ids, load_hf_config, load_model
        from rlinf_vla.reasoning.vllm_backend import VllmSampler, merged_weights

        m = job.model
        config = load_hf_config(m)
        longest = job.data.max_prompt_tokens + job.sampling.max_new_tokens
        # the engine refuses a length beyond the model's context; a response that reaches the
        # context's end stops there and counts as cut at the limit
        context = getattr(config, "max_position_embeddings", None)
        self.sampler = VllmSampler(
            config,
            tokenizer,
            device,
            m.dtype,
            m.vllm_kv_cache_gib,
            m.vllm_gpu_memory_fraction,
            min(longest, context) if context else longest,
            eos_token_ids(tokenizer, config),
        )
        # the weights as transformers loads them (GGUF files de-quantised)
        self.sampler.load_weights(merged_weights(load_model(m)))
        self.s = job.sampling

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> list[list[Response]]:
        s = self.s
        return self.sampler.sample(
            prompts,
            s.k,
            s.max_new_tokens,
            s.temperature,
            s.top_p,
            s.top_k,
            tuple(s.stop_strings),
            None,
            seeds=seeds,
        )

    def close(self) -> None:
        self.sampler.close()


#: ``model.rollout_backend`` -> the sampler math-eval runs
BACKENDS: dict[str, type] = {"hf": HfBackend, "vllm": VllmBackend}


# --------------------------------------------------------------------------- the run
class _Progress:
    """``math-eval: done/total problems  avg@k x.xxx  ...`` on stderr (one line, rewritten in
    place on a terminal)."""

    def __init__(self, enabled: bool, total: int, k: int) -> None:
        self.enabled, self.total, self.k = enabled, total, k
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()

    def show(self, records: dict[int, dict[str, Any]], new: int) -> None:
        if not self.enabled:
            return
        done = len(records)
        avg = sum(r["correct"] / self.k for r in records.values()) / max(1, done)
        elapsed = time.monotonic() - self.start
        per = f"  {elapsed / new:.1f} s/problem" if new else ""
        line = f"math-eval: {done}/{self.total} problems  avg@{self.k} {avg:.3f}{per}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def _record(
    index: int,
    problem: Problem,
    texts: list[str],
    responses: list[Response],
    job: MathEvalJob,
) -> dict[str, Any]:
    samples = []
    for text, r in zip(texts, responses, strict=True):
        scored = score_sample(
            text, problem.answer, len(r.tokens), r.finish == "length", job.eval.fallback_last_number
        ).to_dict()
        if job.eval.save_responses:
            scored["response"] = text
        samples.append(scored)
    return {
        "index": index,
        "id": problem.id if problem.id is not None else str(index),
        "prompt": problem.question,
        "answer": problem.answer,
        "correct": sum(s["correct"] for s in samples),
        "samples": samples,
    }


def summary(job: MathEvalJob, log: ProblemLog) -> dict[str, Any]:
    """``summary.json`` from the recorded problems (in file order)."""
    records = [log.records[i] for i in range(len(job.problems)) if i in log]
    metrics = summarize([r["samples"] for r in records]) if records else {}
    metrics.pop("problems", None)
    metrics.pop("samples_per_problem", None)
    return {
        "complete": len(records) == len(job.problems),
        "problems": len(job.problems),
        "problems_done": len(records),
        "samples_per_problem": job.sampling.k,
        "metrics": metrics,
        "interval": INTERVAL,
        "settings": job.settings(),
    }


def render_table(job: MathEvalJob, result: dict[str, Any]) -> str:
    """The table printed at the end: the metric, its value and its 95 % interval."""
    s, m = job.sampling, result["metrics"]
    folder, gguf = job.model.source()
    model = gguf or Path(folder).name
    head = (
        f"math-eval: {model} on {Path(job.data.path).name}: {result['problems_done']} problems "
        f"x {s.k} samples (temperature {s.temperature:g}, top_p {s.top_p:g}, up to "
        f"{s.max_new_tokens} new tokens, {job.model.rollout_backend} backend)"
    )
    rows = [("metric", "value", "95% interval")]
    for key in [f"avg@{s.k}", *(k for k in m if k.startswith("pass@"))]:
        v = m[key]
        ci = v["ci95"]
        rows.append(
            (
                key,
                f"{100 * v['value']:.1f}%",
                f"[{100 * ci[0]:.1f}%, {100 * ci[1]:.1f}%]" if ci else "-",
            )
        )
    rows += [
        ("boxed answers", f"{100 * m['boxed_rate']:.1f}%", ""),
        ("no answer", f"{100 * m['unparseable_rate']:.1f}%", ""),
        ("cut at limit", f"{100 * m['cut_at_limit_rate']:.1f}%", ""),
        ("mean length", f"{m['mean_length']:.1f} tok", ""),
    ]
    lines = [head, ""]
    lines += [f"  {a:<14} {b:>9}   {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def run(job: MathEvalJob) -> dict[str, Any]:
    """Sample and score the problems not yet in ``job.output_dir``, write the reports, print
    the table; returns the content of ``summary.json``."""
    from rlinf_vla.runtime import torch_threads

    out = job.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if not (out / SETTINGS_FILE).exists():
        _write_atomic(out / SETTINGS_FILE, json.dumps(job.settings(), indent=2) + "\n")
    log = ProblemLog(out)
    todo = [i for i in range(len(job.problems)) if i not in log]
    total = len(job.problems)
    print(
        f"math-eval: {total} problems x {job.sampling.k} samples, {total - len(todo)} already "
        f"in {out}, {len(todo)} to run",
        file=sys.stderr,
    )
    if todo:
        try:
            with torch_threads(job.model.num_threads):
                _sample_and_score(job, todo, log)
        except BaseException:
            result = summary(job, log)
            _write_atomic(out / SUMMARY_FILE, json.dumps(result, indent=2) + "\n")
            print(
                f"math-eval: stopped with {result['problems_done']} of {total} problems recorded "
                f"in {out}; the same command with eval.output_dir={out} runs the others",
                file=sys.stderr,
            )
            raise
    result = summary(job, log)
    _write_atomic(out / SUMMARY_FILE, json.dumps(result, indent=2) + "\n")
    print(render_table(job, result))
    print(f"results: {out} ({SUMMARY_FILE}, {PROBLEMS_FILE})", file=sys.stderr)
    return result


def _sample_and_score(job: MathEvalJob, todo: list[int], log: ProblemLog) -> None:
    from rlinf_vla.reasoning.generation import encode_prompts
    from rlinf_vla.reasoning.model import load_tokenizer

    ev, d = job.eval, job.data
    device = torch.device(
        ev.device if ev.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    tokenizer = load_tokenizer(job.model)
    backend = BACKENDS[job.model.rollout_backend](job, tokenizer, device)
    progress = _Progress(ev.progress, len(job.problems), job.sampling.k)
    truncated = 0
    try:
        for start in range(0, len(todo), ev.batch_size):
            batch = todo[start : start + ev.batch_size]
            prompts, cut = encode_prompts(
                tokenizer,
                [job.problems[i].question for i in batch],
                d.system_prompt,
                d.prompt_suffix,
                d.max_prompt_tokens,
            )
            truncated += cut
            seeds = [problem_seed(job.sampling.seed, i) for i in batch]
            groups = backend.sample(prompts, seeds)
            for i, group in zip(batch, groups, strict=True):
                texts = [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in group]
                log.append(_record(i, job.problems[i], texts, group, job))
            progress.show(log.records, start + len(batch))
    finally:
        progress.end()
        backend.close()
    if truncated:
        print(
            f"math-eval: {truncated} prompt(s) were longer than data.max_prompt_tokens="
            f"{d.max_prompt_tokens} and were cut from the left",
            file=sys.stderr,
        )

"""Math problems: loaded from JSONL / JSON / Parquet, or generated offline with ``reasoning-gym``.

A :class:`Problem` is a question and its reference answer. :func:`load_problems` returns the
train and held-out splits of the ``data`` section; :class:`PromptSampler` walks the train split
in shuffled epochs. Turning a question into model input (chat template, length limit) is the
rollout worker's job (it holds the tokenizer), see ``generation.encode_prompts``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlinf_vla.config import ConfigError

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math assistant. Think briefly, then give the final answer as "
    "\\boxed{answer}."
)


def _default_tasks() -> dict[str, dict[str, Any]]:
    return {
        "basic_arithmetic": {
            "weight": 0.7,
            "min_terms": 2,
            "max_terms": 2,
            "max_digits": 2,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
        "leg_counting": {"weight": 0.3, "min_animals": 1, "max_animals": 2, "max_instances": 3},
    }


@dataclass
class DataConfig:
    """The ``data`` section.

    Attributes:
        source: ``reasoning_gym`` (generate problems offline) or ``file`` (read ``path``);
            ``None``: ``file`` when ``path`` is set, else ``reasoning_gym``.
        path: a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file (``file``).
        eval_path: an optional separate held-out file; without it the last ``eval_size`` rows
            of the shuffled ``path`` are held out.
        prompt_field, answer_field: the field names of the question and the answer.
        tasks: ``reasoning_gym`` dataset name -> its config keys plus ``weight`` (the share of
            the generated problems).
        train_size, eval_size: problems in the train and held-out splits.
        seed: generation and shuffling seed (the held-out split never overlaps the train one).
        system_prompt: the chat template's system message (``""``: none).
        prompt_suffix: appended to every question.
        max_prompt_tokens: longer prompts are truncated (from the left of the question) and
            counted in ``rollout/truncated_prompts``.
    """

    source: Literal["reasoning_gym", "file"] | None = None
    path: str | None = None
    eval_path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    tasks: dict[str, dict[str, Any]] = field(default_factory=_default_tasks)
    train_size: int = 4000
    eval_size: int = 100
    seed: int = 0
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    prompt_suffix: str = ""
    max_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = "file" if self.path else "reasoning_gym"
        if self.source == "file":
            if not self.path:
                raise ConfigError("data.path is required with data.source=file")
            for key in ("path", "eval_path"):
                value = getattr(self, key)
                if value and not Path(value).is_file():
                    raise ConfigError(f"data.{key}: {value!r} is not a file")
                if value and Path(value).suffix not in _READERS:
                    raise ConfigError(
                        f"data.{key}: unknown file type {Path(value).suffix!r} "
                        f"(known: {', '.join(_READERS)})"
                    )
            self._check_files()
        elif not self.tasks:
            raise ConfigError("data.tasks is empty: name at least one reasoning_gym dataset")
        else:
            bad = [
                f"data.tasks.{name}.weight must be a number >= 0, got {spec.get('weight')!r}"
                for name, spec in self.tasks.items()
                if not isinstance(spec.get("weight", 1.0), int | float)
                or isinstance(spec.get("weight", 1.0), bool)
                or not spec.get("weight", 1.0) >= 0
            ]
            if not bad and not sum(float(s.get("weight", 1.0)) for s in self.tasks.values()) > 0:
                bad = ["data.tasks: every weight is 0; give at least one task a weight > 0"]
            if bad:
                raise ConfigError("; ".join(bad))
        if self.eval_size < 1 or self.train_size < 1 or self.max_prompt_tokens < 8:
            raise ConfigError(
                "data.train_size and data.eval_size must be >= 1, data.max_prompt_tokens >= 8"
            )

    def _check_files(self) -> None:
        """Read the data files now, so that a malformed or empty one (or one without the
        configured fields) fails before anything starts, naming its key."""
        counts = {}
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value:
                try:
                    counts[key] = len(read_problems(value, self.prompt_field, self.answer_field))
                except (ValueError, OSError) as e:
                    raise ConfigError(f"data.{key}: {e}") from None
        if not self.eval_path and counts["path"] < 2:
            raise ConfigError(
                f"data.path: {self.path} has {counts['path']} row(s); the held-out split needs "
                "at least 2 (or set data.eval_path)"
            )


@dataclass(frozen=True)
class Problem:
    """A question and its reference answer (as text); ``id``: the file's name for it, if the
    file has an id field and it was asked for."""

    question: str
    answer: str
    id: str | None = None


# --------------------------------------------------------------------------- files
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {e}") from None
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of objects")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
#: the file types :func:`read_problems` reads, by suffix
FILE_TYPES = tuple(_READERS)


def read_problems(
    path: str | Path, prompt_field: str, answer_field: str, id_field: str | None = None
) -> list[Problem]:
    """Problems of a JSONL / JSON / Parquet file (``id_field``: also read each row's id).

    Raises:
        ValueError: the file is not of its type, is not UTF-8 text, has no rows, a row that is
            not an object, or a row without the configured fields (named, with the fields it
            has; a null value counts as missing).
    """
    path = Path(path)
    try:
        rows = _READERS[path.suffix](path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} is not an object: {str(row)[:80]!r}")
        fields = (prompt_field, answer_field, *([id_field] if id_field else []))
        missing = [f for f in fields if row.get(f) is None]
        if missing:
            raise ValueError(
                f"{path}: row {i} lacks the field(s) {missing} (set data.prompt_field / "
                f"data.answer_field{' / data.id_field' if id_field else ''}; the row has: "
                f"{', '.join(sorted(row))})"
            )
    return [
        Problem(str(r[prompt_field]), str(r[answer_field]), str(r[id_field]) if id_field else None)
        for r in rows
    ]


# --------------------------------------------------------------------------- reasoning_gym
def generate_problems(tasks: dict[str, dict[str, Any]], size: int, seed: int) -> list[Problem]:
    """``size`` problems from ``reasoning_gym`` datasets, split by their ``weight``s."""
    import reasoning_gym

    weights = {name: float(spec.get("weight", 1.0)) for name, spec in tasks.items()}
    total = sum(weights.values())
    names = list(tasks)
    counts = {n: int(size * weights[n] / total) for n in names}
    counts[names[0]] += size - sum(counts.values())
    problems: list[Problem] = []
    for k, name in enumerate(names):
        if counts[name] == 0:
            continue
        kwargs = {key: v for key, v in tasks[name].items() if key != "weight"}
        try:
            dataset = reasoning_gym.create_dataset(
                name, size=counts[name], seed=seed * 1000 + k, **kwargs
            )
        except (KeyError, ValueError, TypeError, AssertionError) as e:
            raise ValueError(f"data.tasks.{name}: {e}") from None
        problems.extend(Problem(str(x["question"]), str(x["answer"])) for x in dataset)
    random.Random(seed).shuffle(problems)
    return problems


def load_problems(cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    """The ``(train, held_out)`` problems of a data config; the two never share a question."""
    if cfg.source == "file":
        problems = read_problems(cfg.path, cfg.prompt_field, cfg.answer_field)
        random.Random(cfg.seed).shuffle(problems)
        if cfg.eval_path:
            held = read_problems(cfg.eval_path, cfg.prompt_field, cfg.answer_field)
            return problems[: cfg.train_size], held[: cfg.eval_size]
        if len(problems) < 2:
            raise ValueError(f"{cfg.path}: need at least 2 rows for a train/held-out split")
        n_eval = min(cfg.eval_size, len(problems) // 2)
        return problems[:-n_eval][: cfg.train_size], problems[-n_eval:]
    # Generate extra so that held-out questions equal to train ones can be dropped.
    problems = generate_problems(cfg.tasks, cfg.train_size + 2 * cfg.eval_size, cfg.seed)
    held = problems[: cfg.eval_size]
    seen = {p.question for p in held}
    train = [p for p in problems[cfg.eval_size :] if p.question not in seen][: cfg.train_size]
    return train, held


class PromptSampler:
    """Draws problems from a list in shuffled epochs (every problem once per epoch)."""

    def __init__(self, problems: list[Problem], seed: int) -> None:
        if not problems:
            raise ValueError("no training problems")
        self.problems, self.rng = problems, random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0

    def sample(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.problems)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.problems[self.order.pop()])
        return out

"""Verifier rewards for math answers: extraction, verification with ``math-verify``, shaping.

A response is scored in three parts (:func:`score_response`):

    correct   1 if the extracted answer equals the reference (``math_verify.verify``), else 0
    format    1 if the answer is in ``\\boxed{...}``, else 0           (weighted by format_weight)
    overlong  DAPO's soft overlong penalty on the response length      (``algos.overlong_penalty``,
              added by the trainer, which knows the lengths)

Extraction (:func:`extract_answer`) looks, in order, for the last ``\\boxed{...}``, then a
"final answer is X" / "answer: X" phrase, then (optionally) the last number of the text. A
response with none of them is *unparseable*: it scores 0 and is counted.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Literal

Source = Literal["boxed", "phrase", "last_number", "none"]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"
_PHRASE = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:|=)?\s*[:=]?\s*\$?\s*(" + _NUMBER + r")",
    re.IGNORECASE,
)
_LAST_NUMBER = re.compile(_NUMBER)


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    if depth:  # unclosed (e.g. the response was cut at the length limit)
        return None
    return text[i : j - 1].strip()


def extract_answer(text: str, fallback_last_number: bool = True) -> tuple[str | None, Source]:
    """The final answer of a response and where it was found.

    Returns:
        ``(answer, source)``; ``(None, "none")`` when the response has no answer.
    """
    boxed = _last_boxed(text)
    if boxed:
        return boxed, "boxed"
    phrases = _PHRASE.findall(text)
    if phrases:
        return phrases[-1].replace(",", ""), "phrase"
    if fallback_last_number:
        numbers = _LAST_NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", ""), "last_number"
    return None, "none"


def _parse(answer: str) -> list:
    """``math_verify.parse`` of a bare answer; no ``signal.alarm`` off the main thread."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return parse(
        f"\\boxed{{{answer}}}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )


def answers_match(answer: str, reference: str) -> bool:
    """Whether ``answer`` equals ``reference`` mathematically (``math_verify.verify``).

    ``"0.5"``, ``"1/2"`` and ``"\\frac{1}{2}"`` match each other; an answer that
    ``math-verify`` cannot parse matches nothing.
    """
    from math_verify import verify

    gold, pred = _parse(reference), _parse(answer)
    if not gold or not pred:
        return False
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(verify(gold, pred, timeout_seconds=timeout))


@dataclass(frozen=True)
class RewardResult:
    """The score of one response.

    Attributes:
        reward: ``correct + format_weight * formatted`` (the overlong penalty comes later).
        correct: the answer matched the reference.
        formatted: the answer was boxed.
        parsed: an answer was found at all.
        answer: the extracted answer (``None`` when unparseable).
    """

    reward: float
    correct: bool
    formatted: bool
    parsed: bool
    answer: str | None


def score_response(
    text: str, reference: str, format_weight: float = 0.0, fallback_last_number: bool = True
) -> RewardResult:
    """Score one response against its reference answer (see the module docstring)."""
    answer, source = extract_answer(text, fallback_last_number)
    correct = answer is not None and answers_match(answer, reference)
    formatted = source == "boxed"
    return RewardResult(
        reward=float(correct) + format_weight * float(formatted),
        correct=correct,
        formatted=formatted,
        parsed=answer is not None,
        answer=answer,
    )

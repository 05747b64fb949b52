"""Answer extraction and verification on hand-written responses."""

import pytest

from rlinf_vla.reasoning.reward import answers_match, extract_answer, score_response


@pytest.mark.parametrize(
    ("text", "answer", "source"),
    [
        ("so we get \\boxed{42}.", "42", "boxed"),
        ("first \\boxed{1}, corrected: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
        ("The final answer is 1,234.", "1234", "phrase"),
        ("Answer: -7", "-7", "phrase"),
        ("3 + 4 = 7, and 7 * 2 = 14", "14", "last_number"),
        ("I do not know.", None, "none"),
        ("cut off at the limit \\boxed{12", "12", "last_number"),
    ],
)
def test_extraction(text, answer, source):
    assert extract_answer(text) == (answer, source)


def test_no_number_fallback_leaves_plain_text_unparseable():
    assert extract_answer("3 + 4 = 7", fallback_last_number=False) == (None, "none")


def test_equivalent_forms_match_and_wrong_ones_do_not():
    assert answers_match("0.5", "1/2")
    assert answers_match("\\frac{1}{2}", "0.5")
    assert not answers_match("0.25", "1/2")
    assert not answers_match("banana", "3")


def test_scores():
    right = score_response("... \\boxed{18}", "18", format_weight=0.1)
    assert (right.reward, right.correct, right.formatted, right.parsed) == (1.1, True, True, True)
    plain = score_response("it is 18", "18", format_weight=0.1)
    assert (plain.reward, plain.correct, plain.formatted) == (1.0, True, False)
    wrong = score_response("\\boxed{17}", "18", format_weight=0.1)
    assert wrong.reward == pytest.approx(0.1) and not wrong.correct
    none = score_response("no idea", "18")
    assert (none.reward, none.parsed, none.answer) == (0.0, False, None)

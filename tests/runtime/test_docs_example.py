"""The example in docs/runtime.md runs and prints what the page says."""

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).parents[2] / "docs" / "runtime.md"


@pytest.mark.ray
def test_two_groups_through_a_channel_example():
    text = DOC.read_text()
    code = re.search(r"## Example.*?```python\n(.*?)```", text, re.S).group(1)
    expected = re.search(r"print\(last_actions\)\s+# (.*)", code).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_runtime_example"})
    assert out.getvalue().strip().splitlines()[-1] == expected == "[9, 13]"


def test_the_same_example_in_one_process():
    """The local version of the example: the page's worker classes, run without Ray."""
    text = DOC.read_text()
    example = re.search(r"## Example.*?```python\n(.*?)```", text, re.S).group(1)
    classes = example[: example.index("with Cluster")]
    local = re.search(r"## One process.*?```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(classes + local, str(DOC), "exec"), {"__name__": "docs_runtime_local"})
    assert out.getvalue().strip().splitlines()[-1] == "[9, 13]"

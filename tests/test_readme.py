"""README.md's Python example prints what README says it prints: the code and the output are
read from README itself, so the two cannot drift apart."""

import contextlib
import io
import re
from pathlib import Path

import pytest

from tinyllm.entrypoints import llm as llm_module

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> tuple[str, str]:
    """The first ```python block under "## Use it" and the ```text block after it."""
    section = README.read_text().split("## Use it", 1)[1]
    m = re.search(r"```python\n(.*?)```.*?```text\n(.*?)```", section, re.DOTALL)
    assert m, "README's Use it section lost its example or its output"
    return m.group(1), m.group(2)


def test_readme_example_prints_what_readme_shows(default_llm, monkeypatch):
    code, shown = _example()
    assert "LLM()" in code and "Paris" in shown
    # The session's default model stands in for `LLM()`, so no second copy loads: the same
    # file and sampling defaults (README's output was recorded from `LLM()` itself).
    assert default_llm.default_sampling == {"max_tokens": 512, "temperature": 0.0}
    monkeypatch.setattr(llm_module, "LLM", lambda *args, **kwargs: default_llm)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {})
    assert printed.getvalue() == shown

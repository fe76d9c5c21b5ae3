"""Every pointer into docs/ resolves: each `docs/X.md` named in README, the docs, the code, the
tests and the benchmarks exists, each `docs/X.md, "Section"` names a heading of that page (the
heading itself, or its start up to a word's end: "Weight formats" for "Weight formats: ..."),
and each `](#anchor)` link inside a page names one of its headings."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = ("*.py", "*.cpp", "*.md", "*.toml")

# `docs/X.md`, then optionally `, "Section"` (or 'Section'); a section name may wrap lines.
REFERENCE = re.compile(r"docs/([A-Za-z0-9_]+\.md)(?:,\s*([\"'])(.+?)\2)?")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
ANCHOR_LINK = re.compile(r"\]\(#([^)]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _files() -> list[Path]:
    files = [ROOT / "README.md", *DOCS.glob("*.md")]
    for folder in ("tinyllm", "tests", "benchmarks"):
        for pattern in SOURCES:
            files += (ROOT / folder).rglob(pattern)
    return sorted(set(files) - {Path(__file__).resolve()})  # this file's examples are no pointers


def _joined(path: Path) -> str:
    """The file's text as one line: each line stripped of indentation and comment markers, so
    a reference that wraps, in a comment, docstring or paragraph, reads as it is written."""
    lines = (
        line.strip().removeprefix("//").removeprefix("#") for line in path.read_text().split("\n")
    )
    return " ".join(line.strip() for line in lines)


def _headings(page: str) -> list[str]:
    """A page's headings, outside code blocks."""
    text = FENCE.sub("", (DOCS / page).read_text())
    return [h.strip() for h in HEADING.findall(text)]


def _names(heading: str, name: str) -> bool:
    return heading == name or (heading.startswith(name) and not heading[len(name)].isalnum())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _references() -> list[tuple[str, str, str | None]]:
    refs = []
    for path in _files():
        for m in REFERENCE.finditer(_joined(path)):
            refs.append((str(path.relative_to(ROOT)), m.group(1), m.group(3)))
    return refs


def test_the_scan_finds_the_references_it_checks():
    refs = _references()
    assert any(where == "README.md" and section for where, _, section in refs)
    assert any(where.startswith("tinyllm/") and section for where, _, section in refs)


@pytest.mark.parametrize("where,page,section", _references())
def test_a_docs_reference_names_a_page_and_section_that_exist(where, page, section):
    assert (DOCS / page).is_file(), f"{where} points at docs/{page}, which does not exist"
    if section is not None:
        headings = _headings(page)
        assert any(_names(h, section) for h in headings), (
            f'{where} points at docs/{page}, "{section}", which names none of its headings'
        )


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_a_pages_anchor_links_name_its_headings(page):
    slugs = {_slug(h) for h in _headings(page)}
    for anchor in ANCHOR_LINK.findall((DOCS / page).read_text()):
        assert anchor in slugs, f"docs/{page} links to #{anchor}, which is none of its headings"

"""The user documentation holds together: the README stays short, every relative link reaches a
file of the repository, the README's results name each operator page once, and the architecture
page describes structure only (its run records live on docs/testing.md and the operator pages).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
OPERATOR_PAGES = REPO_ROOT / "docs" / "operators"
MAX_README_LINES = 250
MAX_README_CELL = 150

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...
DATED_TABLE_ROW = re.compile(r"^\s*\|.*\b\d{4}-\d{2}-\d{2}\b")


def documentation_files() -> list[Path]:
    """README, CHANGELOG and the pages under docs/ (not the raw records of docs/results/)."""
    pages = [path for path in (REPO_ROOT / "docs").rglob("*.md")
             if "results" not in path.relative_to(REPO_ROOT / "docs").parts[:1]]
    return [README, REPO_ROOT / "CHANGELOG.md", *sorted(pages)]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def relative_targets(text: str) -> list[str]:
    """The file part of every relative Markdown link in ``text`` (in-page ``#...`` links and
    links with a scheme left out)."""
    targets = []
    for target in LINK.findall(prose(text)):
        path = target.split("#", 1)[0]
        if path and not EXTERNAL.match(target):
            targets.append(path)
    return targets


def broken_links(page: Path, text: str) -> list[str]:
    """Relative link targets of ``page`` that are no file or directory of the repository."""
    broken = []
    for target in relative_targets(text):
        resolved = (page.parent / target).resolve()
        inside = resolved == REPO_ROOT or REPO_ROOT in resolved.parents
        if not (inside and resolved.exists()):
            broken.append(target)
    return broken


def section(text: str, title: str) -> list[str]:
    """The lines of the level-2 section ``title`` of a Markdown text, up to the next one."""
    lines = prose(text).splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def operator_links(line: str) -> list[str]:
    """Operator pages (``docs/operators/<name>.md``) a README line links to."""
    return [target for target in relative_targets(line)
            if re.fullmatch(r"docs/operators/[\w-]+\.md", target)]


def results_problems(readme: str, pages: list[str]) -> list[str]:
    """How the README's results section departs from one list line per operator page, each
    linking to its page only."""
    items = [line for line in section(readme, "Results") if line.lstrip().startswith(("- ", "* "))]
    problems = [f"line links {len(links)} operator pages: {line}"
                for line in items for links in [operator_links(line)] if len(links) != 1]
    linked = [link for line in items for link in operator_links(line)]
    problems += [f"{page}: {linked.count(page)} lines" for page in pages if linked.count(page) != 1]
    problems += [f"{link}: not an operator page" for link in sorted(set(linked) - set(pages))]
    return problems


def readme_long_cells(readme: str) -> list[str]:
    """Table cells of the README longer than :data:`MAX_README_CELL` characters."""
    return [cell.strip() for line in readme.splitlines() if line.lstrip().startswith("|")
            for cell in line.strip().strip("|").split("|") if len(cell.strip()) > MAX_README_CELL]


def operator_pages() -> list[str]:
    return sorted(f"docs/operators/{path.name}" for path in OPERATOR_PAGES.glob("*.md"))


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_table_cells_are_short():
    assert readme_long_cells(README.read_text(encoding="utf-8")) == []


def test_the_pages_searched_include_readme_changelog_and_docs_but_not_records():
    files = [path.relative_to(REPO_ROOT).as_posix() for path in documentation_files()]
    assert {"README.md", "CHANGELOG.md", "docs/architecture.md"} <= set(files)
    assert any(path.startswith("docs/operators/") for path in files)
    assert not any(path.startswith("docs/results/") for path in files)


def test_every_relative_link_resolves():
    broken = {path.relative_to(REPO_ROOT).as_posix(): found
              for path in documentation_files()
              for found in [broken_links(path, path.read_text(encoding="utf-8"))] if found}
    assert broken == {}


def test_readme_results_name_each_operator_page_once():
    pages = operator_pages()
    assert pages, "docs/operators/ holds one page per operator"
    assert results_problems(README.read_text(encoding="utf-8"), pages) == []


def test_architecture_holds_no_dated_table_rows():
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    dated = [line for line in text.splitlines() if DATED_TABLE_ROW.match(line)]
    assert dated == []


# The checks above on samples that break each property, so that none of them passes vacuously.

def test_a_missing_file_is_a_broken_link_and_code_is_not_a_link():
    page = REPO_ROOT / "docs" / "page.md"
    text = ("[ok](architecture.md#layers) [up](../README.md) [gone](nowhere.md#x) [web](https://x.y)"
            " [here](#top) `[code](missing.md)`\n```\n[block](missing_too.md)\n```\n")
    assert broken_links(page, text) == ["nowhere.md"]
    assert broken_links(page, "[outside](../../elsewhere)") == ["../../elsewhere"]


def test_results_section_problems_are_found():
    pages = ["docs/operators/a.md", "docs/operators/b.md"]
    good = "## Results\n\n- [a](docs/operators/a.md): x\n- [b](docs/operators/b.md): y\n## Next\n"
    assert results_problems(good, pages) == []
    missing = "## Results\n- [a](docs/operators/a.md): x\n## Next\n- [b](docs/operators/b.md)\n"
    assert results_problems(missing, pages) == ["docs/operators/b.md: 0 lines"]
    twice = good.replace("- [b](docs/operators/b.md): y", "- [a](docs/operators/a.md) and "
                         "[b](docs/operators/b.md)")
    assert any("links 2 operator pages" in problem for problem in results_problems(twice, pages))


def test_long_cells_and_dated_rows_are_found():
    assert readme_long_cells(f"| a | {'x' * (MAX_README_CELL + 1)} |\n| b | c |") != []
    assert DATED_TABLE_ROW.match("| run | 10.5 | 2026-11-30 | abc1234 |")
    assert not DATED_TABLE_ROW.match("| change | upstream object | why |")


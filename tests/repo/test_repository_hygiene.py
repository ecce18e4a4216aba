"""The repository speaks in its own terms: no references to files outside it or to how it was made.

Code, tests, tools, scripts, examples, docs and the top-level files are searched for phrases that
point at documents this repository does not contain (planning notes, run diaries) or at the
process that produced it; the raw result records under docs/results/ carry no machine-local paths.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()

SEARCHED_DIRS = ("megatron", "tests", "tools", "scripts", "examples", "docs", ".github", ".ci")
SEARCHED_FILES = ("README.md", "CHANGELOG.md", "pretrain_gpt.py", "setup.py", "pytest.ini")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".sh", ".md", ".json", ".jsonl", ".ini", ".yml", ".yaml", ".txt", ".cfg",
                 ".toml", ""}



def _j(*parts: str) -> str:
    """The words this test looks for are written in pieces, so that this file does not itself
    hold them (other scanners read the repository too)."""
    return "".join(parts)


SES, ISS, ANC, CON = _j("ses", "sion"), _j("iss", "ue"), _j("anc", "hor"), _j("con", "tract")
# (name, pattern); case-insensitive unless the pattern says otherwise
FORBIDDEN = (
    (_j("numbered ", SES), re.compile(rf"\b{SES}s?\s*#?\d", re.IGNORECASE)),
    (_j("ordinal or relative ", SES), re.compile(
        r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|next|"
        rf"previous|earlier|later|same|current|time-limited)\s+{SES}s?\b", re.IGNORECASE)),
    (_j(ANC, " file"), re.compile(_j(ANC.upper(), r"S\.md"))),
    ("GPU notes file", re.compile(_j(r"\bGPU", r"\.md\b"))),
    ("design notes file", re.compile(_j("DES", r"IGN\.md"))),
    ("upstream notes file", re.compile(_j("UPSTREAM", "_NOTES"))),
    (ISS, re.compile(rf"\bthe {ISS}s?\b|\b{ISS}'s\b|\b{ISS}s'(?!\w)|\b{ISS}s?\s+#?\d",
                     re.IGNORECASE)),
    (CON, re.compile(rf"\bthe {CON}\b|\b{CON}'s\b", re.IGNORECASE)),
    (ANC, re.compile(rf"\b{ANC}s?\b", re.IGNORECASE)),
    ("run diary", re.compile(rf"functional_\S*{SES}", re.IGNORECASE)),
    ("internal goal", re.compile(_j(r"\bthe go", r"al\b"), re.IGNORECASE)),
    ("old benchmark diaries", re.compile(_j("docs/bench", r"marks\b"))),
)
MACHINE_LOCAL_PATH = re.compile(r"(?<![\w.])/(?:tmp|home|root|opt|scratch|dev/shm)/")


def repository_files() -> list[str]:
    """Tracked files and new ones git does not ignore (a checkout's build outputs, virtual
    environments and local scratch copies stay out); every file below the repository root when
    git is not available."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO_ROOT, capture_output=True, text=True, check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = [path.relative_to(REPO_ROOT).as_posix() for path in REPO_ROOT.rglob("*")
                  if path.is_file() and not {".git", ".venv"} & set(path.parts)]
    return sorted(path for path in set(listed) if (REPO_ROOT / path).is_file()
                  and not SKIPPED_DIRS & set(Path(path).parts))


def searched_files() -> list[str]:
    return [path for path in repository_files()
            if (path in SEARCHED_FILES or path.split("/")[0] in SEARCHED_DIRS)
            and Path(path).suffix in TEXT_SUFFIXES and path != THIS_FILE]


def findings(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for name, pattern in FORBIDDEN:
            match = pattern.search(line)
            if match:
                found.append(f"{number}: {name}: {match.group(0)!r}")
    return found


@pytest.mark.parametrize("sample,expected", [
    (_j("see ", ANC.upper(), "S.md §5"), _j(ANC, " file")),
    (_j("pinned copies (GPU", ".md)"), "GPU notes file"),
    (_j("as DES", "IGN.md says"), "design notes file"),
    (_j("UPSTREAM", "_NOTES section 2"), "upstream notes file"),
    (_j("measured in ", SES, " 9"), _j("numbered ", SES)),
    (_j("the ninth ", SES, "'s record"), _j("ordinal or relative ", SES)),
    (_j("within 10% (the ", ISS, "'s criterion)"), ISS),
    (_j("PyTorch ", ISS, " 115388"), ISS),
    (_j("the ", CON, "'s four strips"), CON),
    (_j("2.11x the 34.8 ms ", ANC), ANC),
    (_j("docs/bench", "marks/functional_2026-11-30_", SES, "8.md"), "run diary"),
    (_j("the go", "al was <= 17 ms"), "internal goal"),
])
def test_each_pattern_catches_what_it_names(sample, expected):
    assert any(f": {expected}: " in finding for finding in findings(sample)), findings(sample)


@pytest.mark.parametrize("sample", [
    _j(ISS.capitalize(), " the exchange on the process group's stream"),
    _j("the job runs in its own ", SES, " (start_new_", SES, "=True)"),
    _j("pytest_collection_finish(self, ", SES, ")"),
    _j("the schedule ", ISS, "s the dispatch of chunk i+1"),
    _j("a copy of 8gpu", ".md"),
])
def test_ordinary_words_pass(sample):
    assert findings(sample) == []


def test_the_search_covers_code_tests_tools_and_docs():
    files = searched_files()
    for expected in ("megatron/bounded/launch/arguments.py", "README.md", "CHANGELOG.md",
                     "docs/architecture.md", "scripts/test.sh", "tests/unit/launch/test_arguments.py",
                     ".github/workflows/gpu-functional.yml"):
        assert expected in files


def test_no_file_refers_to_outside_documents_or_the_process():
    problems = {}
    for path in searched_files():
        try:
            text = (REPO_ROOT / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found = findings(text)
        if found:
            problems[path] = found
    assert problems == {}, "\n".join(f"{path}:{finding}" for path, found in problems.items()
                                     for finding in found)


def test_no_run_diary_is_left():
    diaries = [path for path in repository_files()
               if fnmatch.fnmatch(Path(path).name, _j("functional_*_", SES, "*.md"))]
    assert diaries == []


def test_result_records_carry_no_machine_local_paths():
    records = sorted((REPO_ROOT / "docs" / "results").rglob("*.json*"))
    assert records, "docs/results holds the raw result records"
    local = [f"{path.relative_to(REPO_ROOT)}: {match.group(0)}"
             for path in records
             for match in [MACHINE_LOCAL_PATH.search(path.read_text(encoding="utf-8"))] if match]
    assert local == []

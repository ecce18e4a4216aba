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

# (name, pattern); case-insensitive unless the pattern says otherwise
FORBIDDEN = (
    ("numbered session", re.compile(r"\bsessions?\s*#?\d", re.IGNORECASE)),
    ("ordinal or relative session", re.compile(
        r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|next|"
        r"previous|earlier|later|same|current|time-limited)\s+sessions?\b", re.IGNORECASE)),
    ("anchor file", re.compile(r"ANCHORS\.md")),
    ("GPU notes file", re.compile(r"\bGPU\.md\b")),
    ("design notes file", re.compile(r"DESIGN\.md")),
    ("upstream notes file", re.compile(r"UPSTREAM_NOTES")),
    ("issue", re.compile(r"\bthe issues?\b|\bissue's\b|\bissues'(?!\w)|\bissues?\s+#?\d",
                         re.IGNORECASE)),
    ("contract", re.compile(r"\bthe contract\b|\bcontract's\b", re.IGNORECASE)),
    ("anchor", re.compile(r"\banchors?\b", re.IGNORECASE)),
    ("run diary", re.compile(r"functional_\S*session", re.IGNORECASE)),
    ("internal goal", re.compile(r"\bthe goal\b", re.IGNORECASE)),
    ("old benchmark diaries", re.compile(r"docs/benchmarks\b")),
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
    ("see ANCHORS.md §5", "anchor file"),
    ("pinned copies (GPU.md)", "GPU notes file"),
    ("as DESIGN.md says", "design notes file"),
    ("UPSTREAM_NOTES section 2", "upstream notes file"),
    ("measured in session 9", "numbered session"),
    ("the ninth session's record", "ordinal or relative session"),
    ("within 10% (the issue's criterion)", "issue"),
    ("PyTorch issue 115388", "issue"),
    ("the contract's four strips", "contract"),
    ("2.11x the 34.8 ms anchor", "anchor"),
    ("docs/benchmarks/functional_2026-11-30_session8.md", "run diary"),
    ("the goal was <= 17 ms", "internal goal"),
])
def test_each_pattern_catches_what_it_names(sample, expected):
    assert any(f": {expected}: " in finding for finding in findings(sample)), findings(sample)


@pytest.mark.parametrize("sample", [
    "Issue the exchange on the process group's stream",
    "the job runs in its own session (start_new_session=True)",
    "pytest_collection_finish(self, session)",
    "the schedule issues the dispatch of chunk i+1",
    "a copy of 8gpu.md",
])
def test_ordinary_words_pass(sample):
    assert findings(sample) == []


def test_the_search_covers_code_tests_tools_and_docs():
    files = searched_files()
    for expected in ("megatron/bounded/arguments.py", "README.md", "CHANGELOG.md",
                     "docs/architecture.md", "scripts/test.sh", "tests/unit/test_arguments.py",
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
               if fnmatch.fnmatch(Path(path).name, "functional_*_session*.md")]
    assert diaries == []


def test_result_records_carry_no_machine_local_paths():
    records = sorted((REPO_ROOT / "docs" / "results").rglob("*.json*"))
    assert records, "docs/results holds the raw result records"
    local = [f"{path.relative_to(REPO_ROOT)}: {match.group(0)}"
             for path in records
             for match in [MACHINE_LOCAL_PATH.search(path.read_text(encoding="utf-8"))] if match]
    assert local == []

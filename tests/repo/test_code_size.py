"""Code size of the package: no module over 700 lines, no function or method over 80 lines.

A function may run longer only when the line right above its ``def`` (or above its first
decorator) is a comment ``# long: <reason>`` that says why splitting it would hurt. Sizes are read
with ``ast``: a function's lines run from its ``def`` to its last line, docstring included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "megatron" / "bounded"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
# A reason must follow the marker: "# long:" alone does not excuse a function.
LONG_MARKER = re.compile(r"^\s*#\s*long:\s*\S")


def long_functions(source: str, path: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function or method of ``source`` over ``limit``
    lines whose ``def`` (or first decorator) has no ``# long:`` reason on the line above."""
    lines = source.splitlines()
    offenders = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= limit:
            continue
        first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
        above = lines[first - 2] if first >= 2 else ""
        if not LONG_MARKER.match(above):
            offenders.append((node.lineno, f"{path}:{node.lineno} {node.name} ({length} lines)"))
    return [text for _, text in sorted(offenders)]


def package_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def test_no_module_over_the_line_limit():
    offenders = []
    for path in package_files():
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > MAX_MODULE_LINES:
            offenders.append(f"{path.relative_to(REPO_ROOT)} ({count} lines)")
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(offenders)


def test_no_function_over_the_line_limit():
    offenders = []
    for path in package_files():
        offenders += long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT)))
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines without a '# long:' reason:\n" + "\n".join(
        offenders
    )


def _function(name: str, body_lines: int, above: str = "", decorator: str = "") -> str:
    head = ([above] if above else []) + ([decorator] if decorator else []) + [f"def {name}():"]
    return "\n".join(head + ["    x = 0"] * body_lines + ["    return x", ""])


def test_the_finder_reports_a_long_function_and_accepts_a_stated_reason():
    source = "\n".join(
        [
            "import functools",
            _function("short", 10),
            _function("too_long", 85),
            _function("excused", 85, above="# long: one backward whose steps share many locals"),
            _function("bare_marker", 85, above="# long:"),
            _function("decorated", 85, above="# long: reason above the decorator", decorator="@functools.cache"),
            _function("reason_below_decorator", 85, decorator="@functools.cache"),
            "class Holder:",
            "    def method(self):",
            *(["        y = 1"] * 85),
            "        return y",
        ]
    )
    found = long_functions(source, "synthetic.py")
    names = [entry.split()[1] for entry in found]
    assert names == ["too_long", "bare_marker", "reason_below_decorator", "method"]
    too_long_line = source.splitlines().index("def too_long():") + 1
    assert found[0] == f"synthetic.py:{too_long_line} too_long (87 lines)"
    # The limit is inclusive: a function of exactly the limit's length passes.
    assert long_functions(_function("edge", 78), "edge.py") == []
    assert long_functions(_function("edge", 79), "edge.py") == ["edge.py:1 edge (81 lines)"]

#!/usr/bin/env python
"""Write the two tables of run-time changes to upstream in docs/architecture.md from their
registry: the patches (``megatron.bounded.upstream.patches.PATCHES``: one row per patch with its
kind, the upstream attribute it replaces and that attribute's line in the supported megatron-core
release, why, when it can be removed and the upstream issue or pull request where one is known)
and the changes of single objects (``megatron.bounded.object_changes.OBJECT_CHANGES``: the same,
with what is changed and where this package applies it).

    python tools/patch_table.py

Each table is the text between its two marker comments; the rest of the page is kept.
tests/unit/upstream/test_patch_table.py fails while the page's tables differ from the registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from megatron.bounded.object_changes import OBJECT_CHANGES, ObjectChange
from megatron.bounded.upstream.patches import PATCHES, Patch

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BEGIN = ("<!-- patch table: written by `python tools/patch_table.py` from "
         "megatron/bounded/upstream/patches.py; edit the registry, not the table -->")
END = "<!-- end of the patch table -->"
OBJECT_BEGIN = ("<!-- object change table: written by `python tools/patch_table.py` from "
                "megatron/bounded/object_changes.py; edit the registry, not the table -->")
OBJECT_END = "<!-- end of the object change table -->"


def markdown_table(patches: Iterable[Patch]) -> str:
    lines = ["| patch | kind | replaces | at | why | removable | upstream issue or fix |",
             "|---|---|---|---|---|---|---|"]
    for patch in patches:
        lines.append(f"| `{patch.name}` | {patch.kind.value} | `{patch.attribute}` | "
                     f"`{patch.location}` | {patch.why} | {patch.removable_when} | "
                     f"{patch.upstream_link} |")
    return "\n".join(lines)


def object_change_table(changes: Iterable[ObjectChange]) -> str:
    lines = ["| change | kind | what | upstream, at | applied in | why | removable | "
             "upstream issue or fix |",
             "|---|---|---|---|---|---|---|---|"]
    for change in changes:
        qualname = change.upstream.split(":")[1]
        lines.append(f"| `{change.name}` | {change.kind.value} | {change.change} | "
                     f"`{qualname}`, `{change.location}` | `{change.applied_in}` | {change.why} | "
                     f"{change.removable_when} | {change.upstream_link} |")
    return "\n".join(lines)


def with_table(page: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``page`` with ``table`` in place of whatever the markers ``begin`` and ``end`` enclose."""
    before, found_begin, rest = page.partition(begin + "\n")
    _, found_end, after = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the page has no '{begin}' line followed by an '{end}' line")
    return f"{before}{begin}\n{table}\n{end}{after}"


def with_tables(page: str) -> str:
    """``page`` with both tables written from the registry."""
    page = with_table(page, markdown_table(PATCHES))
    return with_table(page, object_change_table(OBJECT_CHANGES), OBJECT_BEGIN, OBJECT_END)


if __name__ == "__main__":
    PAGE.write_text(with_tables(PAGE.read_text()))

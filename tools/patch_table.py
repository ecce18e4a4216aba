#!/usr/bin/env python
"""Write the patch table of docs/architecture.md from the registry of run-time patches of
upstream (``megatron.bounded.upstream.patches.PATCHES``): one row per patch with its kind, the
upstream attribute it replaces and that attribute's line in the supported megatron-core release,
why, when it can be removed and the upstream issue or pull request where one is known.

    python tools/patch_table.py

The table is the text between the page's two marker comments; the rest of the page is kept.
tests/unit/test_patch_table.py fails while the page's table differs from the registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from megatron.bounded.upstream.patches import PATCHES, Patch

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BEGIN = ("<!-- patch table: written by `python tools/patch_table.py` from "
         "megatron/bounded/upstream/patches.py; edit the registry, not the table -->")
END = "<!-- end of the patch table -->"


def markdown_table(patches: Iterable[Patch]) -> str:
    lines = ["| patch | kind | replaces | at | why | removable | upstream issue or fix |",
             "|---|---|---|---|---|---|---|"]
    for patch in patches:
        lines.append(f"| `{patch.name}` | {patch.kind.value} | `{patch.attribute}` | "
                     f"`{patch.location}` | {patch.why} | {patch.removable_when} | "
                     f"{patch.upstream_link} |")
    return "\n".join(lines)


def with_table(page: str, table: str) -> str:
    """``page`` with ``table`` in place of whatever its markers enclose."""
    before, begin, rest = page.partition(BEGIN + "\n")
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the page has no '{BEGIN}' line followed by an '{END}' line")
    return f"{before}{BEGIN}\n{table}\n{END}{after}"


if __name__ == "__main__":
    PAGE.write_text(with_table(PAGE.read_text(), markdown_table(PATCHES)))

"""docs/architecture.md's tables of run-time changes are the ones tools/patch_table.py writes
from the registry (the patches and the changes of single objects)."""

from __future__ import annotations

import pytest

from megatron.bounded.object_changes import OBJECT_CHANGES
from megatron.bounded.upstream.patches import PATCHES
from tests.tool_modules import load_tool


def test_architecture_page_holds_the_tables_of_the_registry():
    tool = load_tool("patch_table.py")
    page = tool.PAGE.read_text()
    assert tool.with_tables(page) == page, (
        "docs/architecture.md's tables of run-time changes differ from "
        "megatron/bounded/upstream/patches.py or megatron/bounded/object_changes.py; rewrite "
        "them with: python tools/patch_table.py"
    )


def test_every_entry_has_its_row():
    tool = load_tool("patch_table.py")
    page = tool.PAGE.read_text()
    patch_rows = page.split(tool.BEGIN)[1].split(tool.END)[0]
    object_rows = page.split(tool.OBJECT_BEGIN)[1].split(tool.OBJECT_END)[0]
    assert all(f"| `{patch.name}` |" in patch_rows for patch in PATCHES)
    assert all(f"| `{change.name}` |" in object_rows for change in OBJECT_CHANGES)


def test_a_page_without_the_markers_is_refused():
    tool = load_tool("patch_table.py")
    with pytest.raises(ValueError, match="end of the patch table"):
        tool.with_table(f"# Page\n{tool.BEGIN}\nno end marker\n", "| table |")
    with pytest.raises(ValueError, match="end of the object change table"):
        tool.with_tables(f"# Page\n{tool.BEGIN}\n{tool.END}\n{tool.OBJECT_BEGIN}\nno end\n")

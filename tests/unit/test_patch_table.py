"""docs/architecture.md's patch table is the one tools/patch_table.py writes from the registry."""

from __future__ import annotations

import pytest

from megatron.bounded.upstream.patches import PATCHES
from tests.tool_modules import load_tool


def test_architecture_page_holds_the_patch_table_of_the_registry():
    tool = load_tool("patch_table.py")
    page = tool.PAGE.read_text()
    assert tool.with_table(page, tool.markdown_table(PATCHES)) == page, (
        "docs/architecture.md's patch table differs from megatron/bounded/upstream/patches.py; "
        "rewrite it with: python tools/patch_table.py"
    )


def test_a_page_without_the_markers_is_refused():
    tool = load_tool("patch_table.py")
    with pytest.raises(ValueError, match="end of the patch table"):
        tool.with_table(f"# Page\n{tool.BEGIN}\nno end marker\n", "| table |")

"""The package's import layers: no import cycle among megatron.bounded's modules, and no lower
layer imports the command-line layer (megatron.bounded.launch.arguments and the launch-time modules
beside it).

Imports are read from the source with ``ast`` (module-level and inside functions alike), so a cycle
that only a lazy import hides is found too. Also: each operator default that the flags and the
config share is the operator module's own constant.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron.bounded"
PACKAGE_DIR = REPO_ROOT / "megatron" / "bounded"
COMMAND_LINE = "megatron.bounded.launch.arguments"
# The command-line layer: arguments.py and the launch-time modules that work on the command line
# the way it does (expanding flags, describing the parsed run). Only pretrain_gpt.py, tools and
# each other import them; every other module of the package is a lower layer.
COMMAND_LINE_LAYER = (COMMAND_LINE, "megatron.bounded.launch.fast_path", "megatron.bounded.launch.run_summary")


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` = the package)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path, is_package: bool) -> set[str]:
    """Every dotted name an import statement of the file names, relative imports resolved; for
    ``from X import Y`` both X and X.Y (the caller keeps those that are modules)."""
    names = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                source = ".".join(parent + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges module -> package modules it imports (a name resolves to the longest module prefix)."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in imported_names(module, path, path.name == "__init__.py"):
            if not (name == PACKAGE or name.startswith(PACKAGE + ".")):
                continue
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


@pytest.fixture(scope="module")
def graph():
    return import_graph(package_modules())


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_imports_are_resolved_to_package_modules(graph):
    # sanity: the walk sees both module-level and function-level imports
    assert "megatron.bounded.moe.backend" in graph["megatron.bounded.launch.arguments"]
    assert "megatron.bounded.attention.core" in graph["megatron.bounded.launch.arguments"]  # lazy import
    assert "megatron.bounded.kernels.collectives" in graph["megatron.bounded.attention.context_parallel"]
    assert "megatron.bounded" in graph["megatron.bounded.upstream.patches"]  # from megatron.bounded import X


def test_no_import_cycle_among_the_package_modules(graph):
    assert import_cycles(graph) == []


def test_lower_layers_never_import_the_command_line_layer(graph):
    importers = sorted(
        f"{module} -> {target}"
        for module, edges in graph.items() if module not in COMMAND_LINE_LAYER
        for target in edges if target in COMMAND_LINE_LAYER
    )
    assert importers == [], f"lower layers import the command-line layer: {importers}"
    # the config layer in particular (it runs the same checks as the flags, from their homes)
    assert COMMAND_LINE not in graph["megatron.bounded.model.config"]


def test_context_parallel_attention_does_not_import_the_moe_dispatcher(graph):
    assert "megatron.bounded.moe.dispatch.token_dispatcher" not in graph["megatron.bounded.attention.context_parallel"]


def test_the_moe_checks_have_one_home():
    homes = []
    for module, path in package_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        homes += [module for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "check_moe_capacity_and_paged_stash"]
    assert homes == ["megatron.bounded.moe.backend"]


def test_shared_defaults_are_the_operator_modules_constants():
    import argparse

    from megatron.bounded.launch.arguments import add_bounded_args
    from megatron.bounded.moe import pipelined_llep
    from megatron.bounded.optimizer import offload_stream_adamw
    from megatron.bounded.model.config import BoundedTransformerConfig

    # operator knobs parse to None and get their declared default when the operator resolves them
    args = add_bounded_args(argparse.ArgumentParser()).parse_args(
        ["--pipelined-llep", "--offload-stream-optimizer"])
    from megatron.bounded.optimizer.distributed import OFFLOAD_STREAM_KNOBS

    pipelined_llep.LLEP_KNOBS.resolve(args)
    OFFLOAD_STREAM_KNOBS.resolve(args)
    defaults = vars(args)
    fields = BoundedTransformerConfig.__dataclass_fields__
    assert defaults["pipelined_llep_max_chunks"] == pipelined_llep.DEFAULT_MAX_CHUNKS
    assert fields["pipelined_llep_max_chunks"].default == pipelined_llep.DEFAULT_MAX_CHUNKS
    assert defaults["llep_min_spill_tokens"] == pipelined_llep.DEFAULT_MIN_SPILL_TOKENS
    assert fields["llep_min_spill_tokens"].default == pipelined_llep.DEFAULT_MIN_SPILL_TOKENS
    assert defaults["offload_stream_bucket_numel"] == offload_stream_adamw.DEFAULT_BUCKET_NUMEL
    assert defaults["offload_stream_slots"] == offload_stream_adamw.DEFAULT_NUM_SLOTS
    init = offload_stream_adamw.OffloadStreamAdamW.__init__.__defaults__
    assert offload_stream_adamw.DEFAULT_BUCKET_NUMEL in init and offload_stream_adamw.DEFAULT_NUM_SLOTS in init
    # written once: the files that take these defaults name the constants, not the numbers
    for path, constants in (
        ("megatron/bounded/launch/arguments.py", ("DEFAULT_MAX_CHUNKS", "DEFAULT_MIN_SPILL_TOKENS",
                                           "DEFAULT_BUCKET_NUMEL", "DEFAULT_NUM_SLOTS")),
        ("megatron/bounded/model/config.py", ("DEFAULT_MAX_CHUNKS", "DEFAULT_MIN_SPILL_TOKENS")),
    ):
        text = (REPO_ROOT / path).read_text(encoding="utf-8")
        assert all(name in text for name in constants), path
        assert "100_000_000" not in text and "default=10," not in text, path

"""The package's import layers: no import cycle among megatron.bounded's modules, and every import
goes down the layers stated in :data:`LAYERS` (a subpackage may import its own modules and those
of lower layers only; packages on one layer do not import each other).

Imports are read from the source with ``ast`` (module-level and inside functions alike), so an
import that only a lazy import hides is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron.bounded"
PACKAGE_DIR = REPO_ROOT / "megatron" / "bounded"
# The subpackages of megatron.bounded from the top layer down. "" is the package itself
# (__init__: the version) with settings.py, the bottom of every layer.
LAYERS = (
    ("launch",),  # the command line: imported only by pretrain_gpt.py and tools/
    ("upstream",),  # run-time patches of megatron-core, binding our classes into it
    ("budget", "model", "offload", "convert"),  # the memory budget; the model config and specs;
    # API alias; Hugging Face conversion
    ("registry",),  # the operator registry: every bounded feature's settings, terms and wiring
    ("activations",),  # SCO, chunked recompute and chunked attention: bounds on activations
    ("attention", "moe", "loss", "optimizer", "training", "data"),  # the operators, the run's
    # records and its checks of the checkpoint and the data
    ("kernels",),  # Triton support, collectives, row gathers shared by the operators
    ("", "settings"),
)


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


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, subpackage) of a package module."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    package = rest.split(".")[0]
    for index, packages in enumerate(LAYERS):
        if package in packages:
            return index, package
    raise AssertionError(f"{module} is in no layer of LAYERS: add its subpackage")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that do not go down the layers (or stay in their subpackage)."""
    found = []
    for module, edges in graph.items():
        layer, package = layer_of(module)
        for target in edges:
            target_layer, target_package = layer_of(target)
            if target_package != package and target_layer <= layer:
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_imports_are_resolved_to_package_modules(graph):
    # sanity: the walk sees both module-level and function-level imports
    assert "megatron.bounded.moe.backend" in graph["megatron.bounded.launch.arguments"]
    assert "megatron.bounded.attention.core" in graph["megatron.bounded.launch.arguments"]  # lazy
    assert "megatron.bounded.kernels.collectives" in graph["megatron.bounded.attention.context_parallel"]
    assert "megatron.bounded" in graph["megatron.bounded.upstream.patches"]  # from megatron.bounded import X


def test_no_import_cycle_among_the_package_modules(graph):
    assert import_cycles(graph) == []


def test_every_import_goes_down_the_layers(graph):
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_import_that_runs_back_up():
    lower, upper = "megatron.bounded.kernels.collectives", "megatron.bounded.moe.backend"
    sibling = "megatron.bounded.loss.ring_dtp"
    assert upward_imports({lower: {upper}}) == [f"{lower} -> {upper}"]
    assert upward_imports({sibling: {upper}}) == [f"{sibling} -> {upper}"]  # same layer
    assert upward_imports({upper: {lower}, sibling: {"megatron.bounded.loss.strip_softmax"}}) == []


def test_every_subpackage_is_in_a_layer():
    for module in package_modules():
        layer_of(module)


def test_context_parallel_attention_does_not_import_the_moe_dispatcher(graph):
    assert "megatron.bounded.moe.dispatch.token_dispatcher" not in graph[
        "megatron.bounded.attention.context_parallel"]


def test_the_moe_checks_have_one_home():
    homes = []
    for module, path in package_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        homes += [module for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "check_moe_capacity_and_paged_stash"]
    assert homes == ["megatron.bounded.moe.backend"]

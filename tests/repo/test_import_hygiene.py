"""The package's import layers: no import cycle among megatron.bounded's modules, and every import
goes down the layers stated in :data:`LAYERS` (a subpackage may import its own modules and those
of lower layers only; packages on one layer do not import each other); and no module takes a
private name (one leading underscore) from another.

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
# (__init__: the version) with settings.py, units.py and object_changes.py, the bottom of every
# layer.
LAYERS = (
    ("launch",),  # the command line: imported only by pretrain_gpt.py and tools/
    ("upstream",),  # run-time patches of megatron-core, binding our classes into it
    ("budget", "model", "convert"),  # the memory budget; the model config and specs; Hugging
    # Face conversion
    ("registry",),  # the operator registry: every bounded feature's settings, terms and wiring
    ("activations",),  # SCO, chunked recompute and chunked attention: bounds on activations
    ("attention", "moe", "loss", "optimizer", "training", "data"),  # the operators, the run's
    # records and its checks of the checkpoint and the data
    ("kernels",),  # Triton support, collectives, row gathers shared by the operators
    ("", "settings", "units", "object_changes"),
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


def import_source(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` of ``module`` reads, a relative import resolved."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        parent = base[: len(base) - (node.level - 1)]
        return ".".join(parent + ([node.module] if node.module else []))
    return node.module or ""


def imported_names(module: str, path: Path, is_package: bool) -> set[str]:
    """Every dotted name an import statement of the file names, relative imports resolved; for
    ``from X import Y`` both X and X.Y (the caller keeps those that are modules)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = import_source(node, module, is_package)
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


def private_imports(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``module -> name`` for each private name (one leading underscore) the file takes from
    another module of the package: ``from X import _name``, or ``X._name`` on a module it
    imported (``import X``, ``import X as m``, ``from P import X``)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound, named = {}, set()  # local name -> the dotted name it is bound to; every name taken
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            source = import_source(node, module, is_package)
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                named.add(f"{source}.{alias.name}")
    for node in ast.walk(tree):
        attributes = []
        while isinstance(node, ast.Attribute):
            attributes.append(node.attr)
            node = node.value
        if attributes and isinstance(node, ast.Name) and node.id in bound:
            named.add(".".join([bound[node.id], *reversed(attributes)]))
    found = []
    for name in named:
        owner, _, last = name.rpartition(".")
        if last.startswith("_") and not last.startswith("__") and owner in modules \
                and owner != module:
            found.append(f"{module} -> {name}")
    return sorted(found)


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
    assert upward_imports({upper: {lower}, sibling: {"megatron.bounded.loss.ring_dtp.kernels"}}) == []


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


def test_no_module_imports_a_private_name_of_another():
    modules = package_modules()
    assert [found for module, path in modules.items()
            for found in private_imports(module, path, modules)] == []


def test_the_private_name_check_finds_private_imports_and_attributes(tmp_path):
    budget = "megatron.bounded.budget"
    module = f"{budget}.phases"
    modules = {name: Path() for name in (budget, f"{budget}.config", f"{budget}.widths", module)}
    path = tmp_path / "phases.py"
    path.write_text(
        "import torch\n"
        "import megatron.bounded.budget.config\n"
        "from megatron.bounded.budget import widths as W\n"
        "from megatron.bounded.budget.config import GiB, _as_config\n"
        "from megatron.bounded.budget.phases import _own\n"
        "from .widths import _token_widths\n"
        "def f(cfg):\n"
        "    return (W._moe_rows(cfg), W.parameter_counts(cfg), torch._C, _own,\n"
        "            megatron.bounded.budget.config._stage_layers(cfg))\n",
        encoding="utf-8")
    assert private_imports(module, path, modules) == [
        f"{module} -> {budget}.config._as_config",
        f"{module} -> {budget}.config._stage_layers",
        f"{module} -> {budget}.widths._moe_rows",
        f"{module} -> {budget}.widths._token_widths",
    ]

"""Each flag's value is read in few places: its settings class's module, the config modules, the
memory budget (which composes the operators' formulas) and at most one module that uses it.

A module reads a field when it accesses an attribute of that name or calls ``getattr`` /
``hasattr`` with it as a string. The flags are the fields of every settings class of the run
(``RUN_SETTINGS``: the registry's operators, the budget's, the progress log's and the
manifest's).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron.bounded.launch.arguments import RUN_SETTINGS

PACKAGE = Path(__file__).resolve().parents[2] / "megatron" / "bounded"
CONFIG_MODULES = ("megatron.bounded.model.config", "megatron.bounded.budget.config")
BUDGET_PACKAGE = "megatron.bounded.budget."
# the user commands (tools/ runs them) run, like pretrain_gpt.py, the launch's code on the flags
# and print what it chose; neither is a user of a flag
COMMANDS_PACKAGE = "megatron.bounded.launch.commands."

# Fields more than one module reads beyond those above, each with why.
ALLOWED = {
    "pipelined_llep": "the switch: the MoE backend's choice (moe.backend) and the layer that "
                      "runs it (pipelined_llep.layer); the MoE layer's attribute of that name "
                      "holds the layer",
    "pipelined_llep_max_chunks": "pipelined_moe's default cap is the flag's default",
    "chunked_recompute_tokens": "the switch of the chunked recompute: the layer spec chooses "
                                "the layer, the chunked attention and core attention refuse "
                                "what its chunks cannot run",
    "offload_stream_optimizer": "the switch: the Transformer Engine choices and the start-up line",
    "bounded_moe_backend": "PipelinedLLEP refuses the upstream backend; the start-up line",
    "hbm_gb": "the planner's command line and the GPU's memory set on the settings",
    "ring_dtp": "the switch: the model config hooks the sharded output layer in "
                "(launch.model_config, as pretrain_gpt.py builds it); the start-up line",
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parents[1]).with_suffix("").parts)


def names_read(tree: ast.AST) -> set:
    """Attribute names accessed and names ``getattr``/``hasattr`` is given as strings."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return names


def readers() -> dict:
    """``{module: names it reads}`` of every module of the package."""
    return {module_name(path): names_read(ast.parse(path.read_text(), str(path)))
            for path in sorted(PACKAGE.rglob("*.py"))}


def users(field: str, home: str, reads: dict) -> list:
    """The modules that read ``field`` other than its settings module, the config modules, the
    budget and the user commands."""
    return sorted(module for module, names in reads.items()
                  if field in names and module != home and module not in CONFIG_MODULES
                  and not module.startswith((BUDGET_PACKAGE, COMMANDS_PACKAGE)))


def flags() -> list:
    return [(field.name, settings.__module__) for settings in RUN_SETTINGS.values()
            for field in dataclasses.fields(settings)]


def test_the_scan_sees_reads():
    tree = ast.parse("a.b_c\ngetattr(x, 'd_e', None)\nf(g_h=1)\n")
    assert names_read(tree) == {"b_c", "d_e"}
    reads = readers()
    assert "pipelined_llep_token_budget" in reads["megatron.bounded.moe.pipelined_llep.layer"]
    assert "megatron.bounded.budget.widths" in reads  # the budget is scanned, then set aside


def test_each_flag_has_at_most_one_user():
    reads = readers()
    offenders = {}
    for field, home in flags():
        found = users(field, home, reads)
        if len(found) > 1 and field not in ALLOWED:
            offenders[field] = found
    for field, modules in offenders.items():
        print(f"{field}: read by {', '.join(modules)}")
    assert not offenders


def test_the_allowlist_is_needed():
    """An allowed field that one module reads (or none) leaves the list."""
    reads = readers()
    homes = dict(flags())
    assert set(ALLOWED) <= set(homes)
    unneeded = [field for field in ALLOWED if len(users(field, homes[field], reads)) <= 1]
    assert not unneeded, f"no longer read by several modules: {unneeded}"


def test_the_two_knobs_have_one_user():
    reads = readers()
    homes = dict(flags())
    assert users("pipelined_llep_token_budget", homes["pipelined_llep_token_budget"], reads) \
        == ["megatron.bounded.moe.pipelined_llep.layer"]
    assert users("chunked_recompute_keep_attention",
                 homes["chunked_recompute_keep_attention"], reads) \
        == ["megatron.bounded.activations.chunked_recompute"]

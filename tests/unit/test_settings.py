"""Each operator's flags are the fields of one settings dataclass in its module.

Every flag of the megatron-bounded group is generated from a field (no hand-written flag, default
or help text elsewhere), knobs given without their operator are refused, the model config inherits
the fields of the settings that reach the model, and the memory budget reads the settings objects,
never this project's flags from ``args``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from megatron.bounded.launch.arguments import GROUP_TITLE, RUN_SETTINGS, RunSettings, add_bounded_args
from megatron.bounded.model.config import MODEL_SETTINGS, BoundedTransformerConfig
from megatron.bounded.settings import BoundedArgumentError, Settings, flag_name, knob

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "megatron" / "bounded"
FIELDS = {f.name: (cls, f) for cls in RUN_SETTINGS.values() for f in dataclasses.fields(cls)}


def our_group(parser: argparse.ArgumentParser):
    (group,) = [g for g in parser._action_groups if g.title == GROUP_TITLE]
    return group


def test_every_bounded_flag_is_a_settings_field_with_its_default_and_help():
    parser = add_bounded_args(argparse.ArgumentParser())
    actions = our_group(parser)._group_actions
    assert sorted(action.dest for action in actions) == sorted(FIELDS)  # one flag per field, no other
    for action in actions:
        cls, field = FIELDS[action.dest]
        assert action.help.startswith(field.metadata["help"])
        assert "\n" not in action.help and len(field.metadata["help"]) <= 200, action.dest
        expected = flag_name(("no_" if field.default is True else "") + field.name)
        assert action.option_strings == [expected]
        # an operator's knob parses to None (so it can be refused alone); the rest to the default
        knob_of_switch = cls.SWITCH is not None and field.name != cls.SWITCH and field.type != "bool"
        assert parser.get_default(action.dest) == (None if knob_of_switch else field.default)


def test_no_flag_is_added_by_hand_in_the_package():
    """Only settings.py adds flags of pretrain_gpt.py; the user commands (launch/commands/, the
    tools) parse options of their own."""
    commands = PACKAGE_DIR / "launch" / "commands"
    makers = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if commands in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "add_argument":
                makers.append(str(path.relative_to(REPO_ROOT)))
    assert sorted(set(makers)) == ["megatron/bounded/settings.py"]


def test_each_settings_class_lives_in_its_operators_module():
    homes = {name: cls.__module__ for name, cls in RUN_SETTINGS.items()}
    assert homes == {
        "moe_backend": "megatron.bounded.moe.backend",
        "pipelined_llep": "megatron.bounded.moe.pipelined_llep.settings",
        "chunked_recompute": "megatron.bounded.activations.chunked_recompute",
        "chunked_attention": "megatron.bounded.activations.chunked_attention",
        "sco": "megatron.bounded.activations.sco",
        "ring_dtp": "megatron.bounded.loss.ring_dtp.output",
        "offload_stream": "megatron.bounded.optimizer.distributed",
        "budget": "megatron.bounded.budget.config",
        "progress": "megatron.bounded.training.progress",
        "checkpoint_manifest": "megatron.bounded.training.checkpoint_manifest",
    }
    assert [f.name for f in dataclasses.fields(RunSettings)] == list(RUN_SETTINGS)


def test_the_model_config_inherits_the_model_settings_fields():
    config_fields = {f.name: f for f in dataclasses.fields(BoundedTransformerConfig)}
    for cls in MODEL_SETTINGS:
        for field in dataclasses.fields(cls):
            assert config_fields[field.name].default == field.default
    config = BoundedTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert config.pipelined_llep_max_chunks == 10 and config.bounded_moe_backend == "auto"


def test_knobs_without_their_operator_are_refused_and_defaults_filled():
    @dataclasses.dataclass(frozen=True)
    class Demo(Settings):
        SWITCH = "demo"
        demo: bool = knob(False, "Turn the demo on.")
        demo_size: int = knob(4, "Size.")

    parser = argparse.ArgumentParser()
    Demo.add_arguments(parser)
    with pytest.raises(BoundedArgumentError, match="--demo-size has no effect without --demo"):
        Demo.from_args(parser.parse_args(["--demo-size", "8"]))
    assert Demo.from_args(parser.parse_args(["--demo"])) == Demo(demo=True, demo_size=4)
    assert Demo.from_args(parser.parse_args(["--demo", "--demo-size", "8"])).to_flags() == [
        "--demo", "--demo-size", "8"]


def _reads_of_bounded_flags_from_args(path: Path) -> list[str]:
    """``args.<flag>`` and ``getattr(args, "<flag>")`` of this project's flags in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "args" and node.attr in FIELDS):
            found.append(f"{path.name}:{node.lineno} args.{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "_get") and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in FIELDS):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(args, {node.args[1].value!r})")
    return found


def test_the_budget_reads_settings_objects_not_our_flags_from_args(tmp_path):
    from megatron.bounded.budget.planner import GROUPS

    reads = [read for path in sorted((PACKAGE_DIR / "budget").glob("*.py"))
             if path.name != "planner.py" for read in _reads_of_bounded_flags_from_args(path)]
    assert reads == []
    # the planner chooses flags (``args`` attributes) for the knobs left open: it reads from
    # ``args`` only the flags it plans (given ones are constraints) and the GPU's memory that
    # launch.planning sets on them, never another of our flags
    planned = {name for names in GROUPS.values() for name in names} | {"hbm_gb"}
    planner_reads = {read.split(" ", 1)[1] for read in
                     _reads_of_bounded_flags_from_args(PACKAGE_DIR / "budget" / "planner.py")}
    read_names = {read.split("'")[1] if "'" in read else read.split(".", 1)[1]
                  for read in planner_reads}
    assert read_names <= planned, sorted(read_names - planned)
    # the scan finds such a read
    probe = tmp_path / "probe.py"
    probe.write_text("def f(args):\n    return args.ring_dtp, getattr(args, 'hbm_gb', None)\n")
    assert _reads_of_bounded_flags_from_args(probe) == [
        "probe.py:2 args.ring_dtp", "probe.py:2 getattr(args, 'hbm_gb')"]


def test_a_config_built_in_code_meets_the_rules_of_the_flags():
    """The model config runs each inherited settings class's check_values: the rule and the
    message of the flag, not a copy."""
    dense = dict(num_layers=1, hidden_size=16, num_attention_heads=2, transformer_impl="local",
                 add_bias_linear=False)
    moe = dict(dense, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8,
               bounded_moe_backend="torch")
    assert BoundedTransformerConfig(**moe, pipelined_llep=True,
                                    pipelined_llep_token_budget=4).pipelined_llep_token_budget == 4
    for bad in (dict(), dict(pipelined_llep_token_budget=0)):
        with pytest.raises(BoundedArgumentError,
                           match="--pipelined-llep needs --pipelined-llep-token-budget C > 0"):
            BoundedTransformerConfig(**moe, pipelined_llep=True, **bad)
    with pytest.raises(BoundedArgumentError, match="--pipelined-llep-max-chunks must be >= 1"):
        BoundedTransformerConfig(**moe, pipelined_llep=True, pipelined_llep_token_budget=4,
                                 pipelined_llep_max_chunks=0)
    with pytest.raises(BoundedArgumentError, match="--chunked-recompute-keep-attention gpu keeps "
                       "what the chunked attention sublayer saves: add --chunked-recompute-attention"):
        BoundedTransformerConfig(**dense, chunked_recompute_keep_attention="gpu")
    chunked = dict(dense, recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1, chunked_recompute_tokens=8,
                   chunked_recompute_attention=True, attention_dropout=0.0)
    assert BoundedTransformerConfig(**chunked, chunked_recompute_keep_attention="host") \
        .chunked_recompute_keep_attention == "host"
    with pytest.raises(BoundedArgumentError, match="auto is resolved by pretrain_gpt.py's"):
        BoundedTransformerConfig(**chunked, chunked_recompute_keep_attention="auto")
    # a placement of the flags is accepted on the settings, where auto is resolved
    from megatron.bounded.activations.chunked_attention import ChunkedAttentionSettings

    ChunkedAttentionSettings(chunked_recompute_attention=True,
                             chunked_recompute_keep_attention="auto").check_values()

"""Every run-time patch of upstream and every change of single upstream objects: its target
exists, its provenance is recorded (the upstream line checked against the installed release), each
object change is applied by exactly the code its entry names, the version guard works, behaviour."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from megatron.bounded import UPSTREAM_VERSION, object_changes
from megatron.bounded.upstream import patches
from megatron.bounded.upstream.arguments import (
    PLANNING_DEVICE_ARCH,
    escape_help_percent_signs,
    validate_grouped_gemm_without_a_gpu,
)
from megatron.bounded.upstream.layers import fused_rotary_embedding
from megatron.bounded.upstream.optimizer import (
    allocate_torch_adam_state_at_construction,
    initialize_torch_adam_state_before_first_step,
    multi_tensor_fallback,
    separate_adam_step_counters_after_load,
    skip_unsaved_optimizer_states,
)
from megatron.bounded.upstream.training_loop import report_needed_capacity_factor
from tests.conftest import requires_cuda


def test_installed_upstream_is_the_supported_release():
    assert patches.installed_upstream_version() == UPSTREAM_VERSION


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_every_patch_target_exists(patch):
    assert callable(patch.target())


def _assert_provenance(entry) -> None:
    """A patch's or an object change's kind, why, removal condition and upstream link."""
    assert isinstance(entry.kind, patches.PatchKind)
    # one sentence: a full stop at the end and none before a following word
    assert entry.why.endswith(".") and not re.search(r"\.\s", entry.why)
    assert entry.removable_when.startswith("when ")
    assert entry.upstream_link == "" or entry.upstream_link.startswith("https://github.com/")


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_every_patch_records_its_provenance(patch):
    _assert_provenance(patch)


def _defined_in(obj, path: Path) -> bool:
    try:
        return Path(inspect.getsourcefile(obj)).resolve() == path
    except TypeError:  # a builtin (Apex's or TE's compiled kernel) has no source file
        return False


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_every_patch_location_is_the_upstream_line_it_changes(patch):
    """``location`` is the file of the patched module in the installed release and, there, the
    def of the original (where that module defines it) or a statement binding its name."""
    import megatron.core

    site_packages = Path(megatron.core.__file__).resolve().parents[2]
    relative_path, line = patch.location.rsplit(":", 1)
    path, line = site_packages / relative_path, int(line)
    assert path.is_file(), f"{patch.location} is not a file of the installed megatron-core"
    assert Path(importlib.import_module(patch.module).__file__).resolve() == path
    original = inspect.unwrap(patch.target())  # the replacements wrap the original
    name = patch.attribute.split(".")[-1]
    if _defined_in(original, path):
        assert inspect.getsourcelines(original)[1] == line, f"{patch.attribute} is not at {line}"
    else:
        statement = path.read_text().splitlines()[line - 1]
        binds_name = rf"^\s*({re.escape(name)}\s*(=|,|$)|from\s.+\simport\s.*\b{re.escape(name)}\b)"
        assert re.search(binds_name, statement), f"line {line} does not bind {name}: {statement!r}"


def _object_change_location_error(change) -> str:
    """Why ``change.location`` is not the def of ``change.upstream`` in the installed release
    ("" when it is)."""
    import megatron.core

    site_packages = Path(megatron.core.__file__).resolve().parents[2]
    relative_path, line = change.location.rsplit(":", 1)
    module, qualname = change.upstream.split(":")
    original = importlib.import_module(module)
    for part in qualname.split("."):
        original = getattr(original, part)
    original = inspect.unwrap(original)  # a patched method: upstream's def
    source = Path(inspect.getsourcefile(original)).resolve()
    if source != site_packages / relative_path:
        return f"{change.upstream} is defined in {source}, not {relative_path}"
    found = inspect.getsourcelines(original)[1]
    return "" if found == int(line) else f"{change.upstream} is at line {found}, not {line}"


@pytest.mark.parametrize("change", object_changes.OBJECT_CHANGES, ids=lambda c: c.name)
def test_every_object_change_records_its_provenance(change):
    _assert_provenance(change)
    assert _object_change_location_error(change) == ""


def test_a_wrong_object_change_location_fails():
    change = object_changes.object_change("moe-layer-built-with-allgather-dispatcher")
    path, line = change.location.rsplit(":", 1)
    moved = dataclasses.replace(change, location=f"{path}:{int(line) + 1}")
    assert "not " in _object_change_location_error(moved)
    elsewhere = dataclasses.replace(change, location=f"megatron/core/transformer/attention.py:{line}")
    assert "not megatron/core/transformer/attention.py" in _object_change_location_error(elsewhere)


def test_object_change_names_are_unique_and_unknown_ones_refused():
    names = [change.name for change in object_changes.OBJECT_CHANGES]
    assert len(names) == len(set(names))
    with pytest.raises(KeyError, match="no run-time change 'no-such-change'"):
        object_changes.object_change("no-such-change")


def _object_change_sites() -> dict:
    """{entry name: {"path:Qualname" of each function calling ``object_change(name)``}} over the
    package and pretrain_gpt.py; a call whose name is not a literal fails."""
    import ast

    root = Path(__file__).resolve().parents[3]
    files = [root / "pretrain_gpt.py", *sorted((root / "megatron" / "bounded").rglob("*.py"))]
    sites = {}

    def visit(node, qualname, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{qualname}.{child.name}" if qualname else child.name, path)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id == "object_change"):
                argument = child.args[0] if child.args else None
                assert isinstance(argument, ast.Constant) and isinstance(argument.value, str), (
                    f"{path}:{child.lineno}: object_change takes the entry's name as a literal")
                sites.setdefault(argument.value, set()).add(f"{path}:{qualname}")
            visit(child, qualname, path)

    for file in files:
        if file.name == "object_changes.py":
            continue  # the registry itself
        visit(ast.parse(file.read_text(encoding="utf-8")), "", file.relative_to(root).as_posix())
    return sites


def test_every_object_change_is_applied_where_its_entry_says_and_only_there():
    sites = _object_change_sites()
    entries = {change.name: change for change in object_changes.OBJECT_CHANGES}
    assert set(sites) - set(entries) == set(), "code applying a change the registry lacks"
    assert set(entries) - set(sites) == set(), "registry entries no code applies"
    for name, change in entries.items():
        assert sites[name] == {change.applied_in}, name


def test_methods_and_classes_of_objects_are_rebound_only_through_an_entry():
    """The monkey-style changes (a ``forward`` or ``__class__`` assigned, a method bound with
    ``types.MethodType``) appear in the package only as arguments of an entry's ``set``."""
    import ast

    root = Path(__file__).resolve().parents[3]
    found = []
    for file in [root / "pretrain_gpt.py", *sorted((root / "megatron" / "bounded").rglob("*.py"))]:
        tree = ast.parse(file.read_text(encoding="utf-8"))
        through_an_entry = set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Call)
                    and getattr(node.func.value.func, "id", None) == "object_change"):
                through_an_entry.update(id(n) for arg in node.keywords for n in ast.walk(arg.value))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr in ("forward", "__class__")
                   for t in targets):
                found.append(f"{file.name}:{node.lineno}")
            if (isinstance(node, ast.Call) and id(node) not in through_an_entry
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) == "MethodType"):
                found.append(f"{file.name}:{node.lineno}")
    assert found == [], "register these in megatron/bounded/object_changes.py"


def test_hidden_fields_come_back_also_when_the_call_raises():
    from types import SimpleNamespace

    change = object_changes.object_change("router-padding-left-to-the-dispatcher")
    config = SimpleNamespace(moe_pad_expert_input_to_capacity=True)
    with pytest.raises(RuntimeError):
        with change.hidden(config, moe_pad_expert_input_to_capacity=False):
            assert config.moe_pad_expert_input_to_capacity is False
            raise RuntimeError("upstream failed")
    assert config.moe_pad_expert_input_to_capacity is True
    view = change.copy_with(config, moe_pad_expert_input_to_capacity=False)
    assert view is not config and config.moe_pad_expert_input_to_capacity is True
    assert view.moe_pad_expert_input_to_capacity is False


def test_missing_target_fails_loudly():
    bogus = dataclasses.replace(patches.PATCHES[0], name="bogus", attribute="no_such_symbol")
    with pytest.raises(RuntimeError, match="no_such_symbol.*megatron-core==0.19.2"):
        bogus.target()


def test_version_mismatch_fails_loudly(monkeypatch):
    monkeypatch.setattr(patches, "installed_upstream_version", lambda: "0.20.0")
    with pytest.raises(RuntimeError, match="written for megatron-core==0.19.2, but 0.20.0"):
        patches.apply_patches()


def test_apply_patches_is_idempotent():
    patches.apply_patches()
    first = [patch.target() for patch in patches.PATCHES]
    patches.apply_patches()
    assert [patch.target() for patch in patches.PATCHES] == first
    assert all(patches.is_applied(patch) for patch in patches.PATCHES)


def test_checkpoint_patches_wrap_the_bindings_upstream_calls(tmp_path, monkeypatch):
    """The training loop saves through ``training.save_checkpoint``, the save schedules through
    ``checkpointing.schedule_async_save`` and every load goes through
    ``checkpointing._load_base_checkpoint``; behaviour: tests/unit/training/test_checkpoint_manifest.py."""
    from argparse import Namespace

    from megatron.training import checkpointing, training

    from megatron.bounded.training import checkpoint_integrity, checkpoint_manifest

    patches.apply_patches()
    for binding in (training.save_checkpoint, checkpointing.schedule_async_save,
                    checkpointing._load_base_checkpoint):
        assert getattr(binding, patches.PATCH_MARKER, None), binding
    checkpoint = tmp_path / "iter_0000002"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"shard" * 100)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    checkpoint_manifest.write_part(str(checkpoint))
    (checkpoint / "__0_0.distcp").write_bytes(b"shard" * 99 + b"shart")
    monkeypatch.setattr(checkpoint_integrity, "_verified", set())
    args = Namespace(non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None,
                     ckpt_step=None, verify_checkpoint=True, exit_on_missing_checkpoint=False)
    with pytest.raises(checkpoint_manifest.CheckpointIntegrityError, match="__0_0.distcp"):
        checkpointing._load_base_checkpoint(str(tmp_path), args, rank0=True)


def test_dataset_helper_compile_step_is_a_noop_that_loads_the_prebuilt_helper(monkeypatch):
    patches.apply_patches()
    calls = []
    monkeypatch.setattr("subprocess.run", lambda *a, **k: calls.append(a))
    from megatron.core.datasets import utils

    utils.compile_helpers()  # upstream would run `make` here and fail without a Makefile
    assert calls == []
    helpers = importlib.import_module("megatron.core.datasets.helpers_cpp")
    assert hasattr(helpers, "build_sample_idx_int64")


class _FakeDistributedOptimizer:
    """Just what the patched state_dict touches: a torch optimizer, a config, init_state_fn."""

    def __init__(self, params, fused):
        self.optimizer = torch.optim.AdamW(params, lr=0.1, fused=fused)
        self.config = None

    @staticmethod
    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for param in group["params"]:
                if len(opt.state[param]) == 0:
                    opt.state[param]["exp_avg"] = torch.zeros_like(param)
                    opt.state[param]["exp_avg_sq"] = torch.zeros_like(param)


def _steps(optimizer):
    return [state["step"] for state in optimizer.state.values()]


@pytest.mark.parametrize("fused", [False, True])
def test_fresh_torch_adam_gets_step_zero_state_before_state_dict(monkeypatch, fused):
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    fake = _FakeDistributedOptimizer(params, fused)
    seen = []
    patched = initialize_torch_adam_state_before_first_step(
        lambda self: seen.append(_steps(self.optimizer)) or "template"
    )
    assert patched(fake) == "template"
    steps = seen[0]
    assert len(steps) == 2 and all(float(step) == 0.0 for step in steps)
    assert all(step.dtype == torch.float32 for step in steps)
    # torch keeps `step` on the CPU unless the optimizer is fused or capturable
    assert all(step.device == params[0].device for step in steps)
    # the step-0 state is what AdamW would have created itself: the next step matches a fresh one
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW(reference_params, lr=0.1, fused=fused)
    for param, ref in zip(params, reference_params):
        param.grad = torch.ones_like(param)
        ref.grad = torch.ones_like(ref)
    fake.optimizer.step()
    reference.step()
    assert all(torch.equal(p, r) for p, r in zip(params, reference_params))


def test_torch_adam_state_exists_from_construction_and_training_is_unchanged(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def build(self, params):
        _FakeDistributedOptimizer.__init__(self, params, fused=False)

    cls = type("Built", (), {"init_state_fn": staticmethod(_FakeDistributedOptimizer.init_state_fn)})
    cls.__init__ = allocate_torch_adam_state_at_construction(build)
    built = cls(params)
    # the moments are there before any step: the first iteration already holds them
    assert len(built.optimizer.state) == 2
    assert all(torch.equal(s["exp_avg"], torch.zeros_like(p))
               for p, s in zip(params, built.optimizer.state.values()))
    reference = torch.optim.AdamW(reference_params, lr=0.1)
    for _ in range(2):
        for param, ref in zip(params, reference_params):
            param.grad = torch.full_like(param, 0.5)
            ref.grad = torch.full_like(ref, 0.5)
        built.optimizer.step()
        reference.step()
    assert all(torch.equal(p, r) for p, r in zip(params, reference_params))


def test_optimizer_with_state_is_left_alone(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    param = torch.nn.Parameter(torch.randn(3))
    fake = _FakeDistributedOptimizer([param], fused=False)
    param.grad = torch.ones_like(param)
    fake.optimizer.step()
    before = {key: value.clone() for key, value in fake.optimizer.state[param].items()}
    initialize_torch_adam_state_before_first_step(lambda self: None)(fake)
    after = fake.optimizer.state[param]
    assert all(torch.equal(before[key], after[key]) for key in before)


def _load_like_upstream_without_apex(self, state_dict):
    """What upstream's load does on the torch-AdamW path: one step tensor for every parameter."""
    shared_step = torch.tensor(float(state_dict["optimizer"]["param_groups"][0]["step"]))
    for group in self.optimizer.param_groups:
        for param in group["params"]:
            self.optimizer.state[param]["step"] = shared_step
            self.optimizer.state[param]["exp_avg"] = torch.zeros_like(param)
            self.optimizer.state[param]["exp_avg_sq"] = torch.zeros_like(param)


def test_upstream_load_shares_one_step_counter_which_torch_adam_then_overcounts():
    # the failure the patch exists for, reproduced with upstream's logic and plain torch AdamW
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    fake = _FakeDistributedOptimizer(params, fused=False)
    _load_like_upstream_without_apex(fake, {"optimizer": {"param_groups": [{"step": 20}]}})
    for param in params:
        param.grad = torch.ones_like(param)
    fake.optimizer.step()
    assert float(fake.optimizer.state[params[0]]["step"]) == 24.0  # one increment per parameter


def test_each_parameter_gets_its_own_step_counter_after_load(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    fake = _FakeDistributedOptimizer(params, fused=False)
    patched = separate_adam_step_counters_after_load(_load_like_upstream_without_apex)
    patched(fake, {"optimizer": {"param_groups": [{"step": 20}]}})
    for param in params:
        param.grad = torch.ones_like(param)
    fake.optimizer.step()
    assert [float(fake.optimizer.state[p]["step"]) for p in params] == [21.0] * 4


def _fully_reshardable_load_target():
    """A torch AdamW with step-0 state behind upstream's unpatched state setter, as the
    fully-reshardable load meets it (a fake distributed optimizer around the real method)."""
    import inspect
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param])
    optimizer.state[param].update(step=torch.tensor(7.0), exp_avg=torch.zeros(4),
                                  exp_avg_sq=torch.zeros(4))
    fake = SimpleNamespace(
        model_param_group_index_map={param: (0, 0)}, optimizer=optimizer,
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    upstream = inspect.unwrap(DistributedOptimizer._set_main_param_and_optimizer_states)
    # what upstream hands over (distrib_optimizer.py:2390): the saved tensors without "step"
    saved = {"param": torch.full((4,), 1.0), "exp_avg": torch.full((4,), 2.0),
             "exp_avg_sq": torch.full((4,), 3.0)}
    return upstream, fake, param, saved


def test_upstream_fully_reshardable_load_fails_on_the_unsaved_step():
    upstream, fake, param, saved = _fully_reshardable_load_target()
    with pytest.raises(KeyError, match="step"), torch.no_grad():  # the load runs without grad
        upstream(fake, param, saved)


def test_fully_reshardable_load_sets_what_was_saved_and_leaves_the_step():
    upstream, fake, param, saved = _fully_reshardable_load_target()
    with torch.no_grad():
        skip_unsaved_optimizer_states(upstream)(fake, param, saved)
    state = fake.optimizer.state[param]
    assert torch.equal(param.detach(), saved["param"])
    assert torch.equal(state["exp_avg"], saved["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], saved["exp_avg_sq"])
    assert float(state["step"]) == 7.0


def test_offload_stream_optimizer_is_bound_where_upstream_builds_its_host_optimizer(monkeypatch):
    from megatron.core import optimizer as core_optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from megatron.bounded.optimizer.distributed import OffloadStreamHybridOptimizer

    # the bindings are module attributes: monkeypatch restores them after the test
    monkeypatch.setattr(core_optimizer, "HybridDeviceOptimizer", core_optimizer.HybridDeviceOptimizer)
    monkeypatch.setattr(distrib_optimizer, "HybridDeviceOptimizer", distrib_optimizer.HybridDeviceOptimizer)
    assert core_optimizer.HybridDeviceOptimizer is HybridDeviceOptimizer
    bound = patches.use_offload_stream_optimizer(1024, 3)
    assert issubclass(bound, OffloadStreamHybridOptimizer) and issubclass(bound, HybridDeviceOptimizer)
    assert core_optimizer.HybridDeviceOptimizer is bound and distrib_optimizer.HybridDeviceOptimizer is bound
    assert (bound.default_bucket_numel, bound.default_num_slots) == (1024, 3)
    assert patches.use_offload_stream_optimizer(1024, 3) is bound  # idempotent
    with pytest.raises(RuntimeError, match="already bound"):
        patches.use_offload_stream_optimizer(2048, 2)


def test_flags_with_context_parallelism_validate_without_a_gpu(monkeypatch):
    from megatron.training import arguments as upstream

    assert not torch.cuda.is_available()  # the point of the patch: CPU-only planning
    patches.apply_patches()
    assert upstream.get_device_arch_version() == PLANNING_DEVICE_ARCH
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what upstream requires on Hopper
    monkeypatch.setattr("sys.argv", [
        "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "2", "--eval-interval", "2", "--lr", "1e-4",
        "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    ])
    args = upstream.parse_args()
    upstream.validate_args(args, {})  # asked the (absent) GPU for its architecture before
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 2)


def test_device_arch_is_read_from_the_gpu_when_there_is_one(monkeypatch):
    patch = next(p for p in patches.PATCHES if p.name == "device-arch-without-a-gpu")
    replacement = patch.make_replacement(lambda: 10)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert replacement() == 10


def _runner_over_budget(factor: float, demands):
    """A stand-in for upstream's PagedStashRunner: its config, and MoE layers whose dispatchers
    carry a slab demand (None: a dispatcher without one, e.g. upstream's)."""
    from types import SimpleNamespace

    layers = [
        SimpleNamespace(token_dispatcher=SimpleNamespace(
            slab_demand=None if d is None else torch.tensor([d], dtype=torch.float32)))
        for d in demands
    ]
    return SimpleNamespace(config=SimpleNamespace(moe_expert_rank_capacity_factor=factor),
                           moe_layers=layers)


def test_rerun_names_the_capacity_factor_that_would_have_fit(caplog):
    calls = []
    prepare_for_rerun = report_needed_capacity_factor(lambda self: calls.append(self))
    runner = _runner_over_budget(1.5, [1.2, None, 1.8312])
    with caplog.at_level("INFO", logger="megatron.bounded.moe"):
        prepare_for_rerun(runner)
    assert calls == [runner]  # upstream's own rerun preparation still runs, after the report
    # the largest over the layers, rounded up so the printed factor really fits
    assert "held 1.84x its even share" in caplog.text
    assert "--moe-expert-rank-capacity-factor 1.84 or more" in caplog.text and "(it is 1.5)" in caplog.text


def test_rerun_for_a_stash_overflow_alone_reports_no_factor(caplog):
    calls = []
    prepare_for_rerun = report_needed_capacity_factor(lambda self: calls.append(self))
    with caplog.at_level("INFO", logger="megatron.bounded.moe"):
        prepare_for_rerun(_runner_over_budget(1.5, [1.2, 1.4]))  # no slab went over 1.5
        prepare_for_rerun(_runner_over_budget(1.5, [None]))  # upstream's dispatcher
    assert len(calls) == 2 and "even share" not in caplog.text


def test_help_texts_with_a_bare_percent_sign_are_escaped():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.argument_utils import ArgumentGroupFactory

    patches.apply_patches()
    factory = ArgumentGroupFactory(TransformerConfig)
    text = factory.field_docstrings["moe_paged_stash_buffer_size_factor_cuda"]
    assert "10%%)" in text  # upstream's bare "10%)" broke argparse's %-formatting of --help
    assert (text % {}).endswith("10%).")  # argparse shows the original text


@pytest.mark.parametrize(
    "raw,escaped",
    [("up to 10%)", "up to 10%%)"), ("already 5%% here", "already 5%% here"),
     ("default %(default)s", "default %(default)s"), ("50% of %(prog)s, 1%", "50%% of %(prog)s, 1%%")],
)
def test_help_escape_keeps_pairs_and_fields(raw, escaped):
    escape = escape_help_percent_signs(lambda self, cls: {"field": raw, "none": None})
    assert escape(None, object) == {"field": escaped, "none": None}


def test_grouped_gemm_flags_validate_without_a_gpu(monkeypatch):
    from megatron.training import arguments as upstream

    assert not torch.cuda.is_available()
    patches.apply_patches()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr("sys.argv", [
        "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "2", "--eval-interval", "2", "--lr", "1e-4",
        "--num-experts", "4", "--moe-grouped-gemm", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    ])
    args = upstream.parse_args()
    upstream.validate_args(args, {})  # upstream asked the (absent) GPU for its capability
    assert args.moe_grouped_gemm
    # and the GPU query is upstream's again afterwards
    with pytest.raises(Exception):
        torch.cuda.get_device_capability()


def test_grouped_gemm_validation_asks_the_gpu_when_there_is_one(monkeypatch):
    from types import SimpleNamespace

    seen = []
    validate = validate_grouped_gemm_without_a_gpu(
        lambda args, defaults: seen.append(torch.cuda.get_device_capability)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = torch.cuda.get_device_capability
    validate(SimpleNamespace(moe_grouped_gemm=True), {})
    assert seen == [original]


def test_rotary_embedding_is_fused_only_where_supported(monkeypatch):
    from types import SimpleNamespace

    from megatron.bounded.attention import rotary

    calls = []
    original = lambda t, freqs, config, **kwargs: calls.append(("upstream", kwargs)) or t  # noqa: E731
    fused = fused_rotary_embedding(original)
    monkeypatch.setattr(rotary, "apply_rotary", lambda t, freqs, mscale: calls.append(("fused", mscale)) or t)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False)
    t, freqs = torch.zeros(8, 1, 2, 16), torch.zeros(8, 1, 1, 16)
    fused(t, freqs, config, mscale=1.5)  # CPU tensors: not supported
    assert calls[-1][0] == "upstream" and calls[-1][1]["mscale"] == 1.5
    monkeypatch.setattr(rotary, "fused_rotary_supported", lambda *args: True)
    fused = fused_rotary_embedding(original)
    fused(t, freqs, config, mscale=1.5)
    assert calls[-1] == ("fused", 1.5)
    fused(t, freqs, config, mla_rotary_interleaved=None)  # upstream reads the config
    assert calls[-1][0] == "upstream"
    fused(t, freqs, SimpleNamespace(apply_rope_fusion=True, rotary_interleaved=False))
    assert calls[-1][0] == "upstream"


def _without_a_gpus_generator(monkeypatch):
    """Upstream's checkpoints save and restore the CUDA generator's state; there is none here
    (restored after the test)."""
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    monkeypatch.setattr(tensor_parallel_random, "_get_cuda_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(tensor_parallel_random, "_set_cuda_rng_state", lambda *a, **k: None)
    return tensor_parallel_random


def test_upstream_checkpoint_without_output_needs_transformer_engine(monkeypatch):
    """The bug the patch exists for, in megatron-core 0.19.2 unpatched: the default fp8=False
    reads as on, and the first forward asks Transformer Engine's fp8 state, which is not there.
    When upstream fixes it this test fails: remove the patch
    ``checkpoint-without-output-fp8-off-without-te``."""
    import inspect

    random = _without_a_gpus_generator(monkeypatch)
    assert not random.HAVE_TE
    checkpoint = random.CheckpointWithoutOutput.__new__(random.CheckpointWithoutOutput)
    inspect.unwrap(random.CheckpointWithoutOutput.__init__)(checkpoint)  # fp8=False, the default
    assert checkpoint.fp8 is True
    with pytest.raises(NameError, match="FP8GlobalStateManager"):
        checkpoint.checkpoint(torch.nn.LayerNorm(8), torch.randn(4, 8, requires_grad=True))


def test_checkpoint_without_output_runs_without_transformer_engine(monkeypatch):
    """Patched: a norm under the output-discarding checkpoint, its output freed once its
    consumer has run and recomputed in backward, gives the gradients of the plain norm."""
    random = _without_a_gpus_generator(monkeypatch)
    patches.apply_patches()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, dtype=torch.float64, generator=generator)
    weight = torch.randn(8, 5, dtype=torch.float64, generator=generator)
    norm = torch.nn.LayerNorm(8, dtype=torch.float64)

    def grads(recompute: bool):
        norm.zero_grad()
        leaf = x.clone().requires_grad_(True)
        checkpoint = random.CheckpointWithoutOutput() if recompute else None
        normed = checkpoint.checkpoint(norm, leaf) if recompute else norm(leaf)
        out = normed @ weight
        if recompute:
            checkpoint.discard_output_and_register_recompute(out)
            assert normed.untyped_storage().nbytes() == 0  # freed until the backward
        out.square().sum().backward()
        return leaf.grad, norm.weight.grad.clone(), norm.bias.grad.clone()

    assert random.CheckpointWithoutOutput().fp8 is False
    for got, want in zip(grads(True), grads(False)):
        assert torch.equal(got, want)


def _gradients(device="cpu"):
    generator = torch.Generator().manual_seed(5)
    shapes = [(37,), (64, 33), (3, 5, 7), (1,), (4096,)]
    return [(torch.randn(shape, generator=generator) * 10 ** (i - 2)).to(device)
            for i, shape in enumerate(shapes)]


def test_grad_norm_in_one_transfer_is_upstreams_value():
    from megatron.bounded.optimizer import multi_tensor

    grads = _gradients()
    total, per_tensor = multi_tensor.l2_norm(2048 * 32, None, [grads], False)
    # upstream's fallback on the CPU: its device="cuda" is the only difference
    expected = torch.norm(torch.tensor([[torch.norm(g) for g in grads]]))
    assert per_tensor is None and total.shape == (1,) and total.dtype == torch.float32
    assert total[0].item() == expected.item()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copy"])
@pytest.mark.parametrize("destination_dtype", [torch.float32, torch.bfloat16])
def test_foreach_grad_scale_is_upstreams_value(in_place, destination_dtype):
    from megatron.core.utils import local_multi_tensor_scale

    from megatron.bounded.optimizer import multi_tensor

    if in_place and destination_dtype != torch.float32:
        pytest.skip("in place the destination is the source")
    sources = _gradients()
    ours = sources if in_place else [torch.empty_like(s, dtype=destination_dtype) for s in sources]
    upstream_sources = [s.clone() for s in sources]
    upstream = (upstream_sources if in_place
                else [torch.empty_like(s, dtype=destination_dtype) for s in sources])
    multi_tensor.scale(2048 * 32, None, [sources, ours], 0.3141)
    local_multi_tensor_scale(2048 * 32, None, [upstream_sources, upstream], 0.3141)
    assert all(torch.equal(a, b) for a, b in zip(ours, upstream))


def test_multi_tensor_patches_replace_only_upstreams_fallbacks():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from megatron.bounded.optimizer import multi_tensor

    make = multi_tensor_fallback
    grads = _gradients()
    ours = make("l2_norm")(local_multi_tensor_l2_norm)(0, None, [grads], False)
    assert ours[0].item() == multi_tensor.l2_norm(0, None, [grads], False)[0].item()
    seen = []
    kernel = make("scale")(lambda *args: seen.append(args))  # Apex's or TE's kernel: kept
    kernel(1, "flag", [[], []], 2.0)
    assert seen == [(1, "flag", [[], []], 2.0)]
    grads = _gradients()
    make("scale")(local_multi_tensor_scale)(0, None, [grads, grads], 0.5)
    assert torch.equal(grads[1], _gradients()[1] * 0.5)


@pytest.mark.gpu
@requires_cuda
def test_grad_norm_in_one_transfer_is_upstreams_value_on_cuda():
    from megatron.core.utils import local_multi_tensor_l2_norm

    from megatron.bounded.optimizer import multi_tensor

    grads = _gradients("cuda")
    ours, _ = multi_tensor.l2_norm(2048 * 32, None, [grads], False)
    upstream, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert ours.device == upstream.device and torch.equal(ours, upstream)

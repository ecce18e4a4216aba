"""Module-level mutable objects of megatron.bounded: each is named in :data:`ALLOWED` with the
reason it lives there, so that state of a run does not hide in a module global.

Found by reading the source with ``ast``: a module-level name bound to a dict, list or set
(display, comprehension or ``dict()``/``set()``/``defaultdict()``-like call), to an instance of a
mutable class defined in the same module, or rebound from a function through ``global``. State
of a run belongs in an object made at start-up or in the module instance that uses it; a cache of
a deterministic function, a constant table or a process-wide resource goes into :data:`ALLOWED`
with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "megatron" / "bounded"

MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local"}

CONSTANT = "a constant table: filled where it is defined, only read"

# "path relative to megatron/bounded:NAME" -> why it is a module-level mutable object
ALLOWED = {
    # one home per process by design
    "units.py:_LOGGED": "log_once's keys: 'once' means once per process",
    "activations/host_memory.py:_STREAMS": (
        "one pair of copy streams per CUDA device, shared by every user of pinned memory so "
        "that their copies queue on the link instead of competing for it"),
    "activations/host_memory.py:_planned_bytes_per_gpu": (
        "the host a plan is made for (tools/memory_budget.py --budget-host-gb), read by every "
        "pinned-memory check; set once before planning"),
    "activations/kept_attention.py:_KEPT": (
        "the store of kept attention shared by every layer of the model (the backward of layer "
        "l prefetches layer l-1's entry), one micro-batch at a time"),
    "launch/commands/preprocess_data.py:_worker_tokenizer": (
        "the tokenizer of one worker process of the tokenizing pool, loaded by the pool's "
        "initializer"),
    "moe/chunk_routing.py:_state": (
        "thread-local scope of the collecting()/applying() context managers, empty outside them"),
    "moe/pipelined_llep/schedule.py:_COMM_STREAMS": (
        "the communication side stream of each CUDA device, shared by every PipelinedLLEP layer "
        "(its schedule is made per call, inside the autograd function)"),
    "training/checkpoint_integrity.py:writer": (
        "the background manifest writer, started and joined by upstream's save and load "
        "through the patches, which hold no object of ours"),
    "training/checkpoint_integrity.py:_verified": (
        "checkpoint directories already verified by this process: upstream's load calls the "
        "patched check once per model chunk"),
    "training/checkpoint_integrity.py:_pending_async": (
        "the directory of the asynchronous save upstream is scheduling, handed from the patched "
        "save to the patched scheduler"),
    "training/progress.py:_meter": (
        "the meter made at start-up (configure), fed by the patched train_step; it holds the "
        "counters and figures"),
    "upstream/optimizer.py:_adam_moment_dtypes": (
        "the moment dtypes bound at launch for the patched DistributedOptimizer constructor"),
    # caches of deterministic functions
    "attention/rotary.py:_last_tables": "one-entry cache of the cos/sin tables of a freqs tensor",
    "moe/experts.py:_GROUPED_MM_SUPPORT": (
        "cache of whether torch._grouped_mm runs for a device type and dtype (probed once)"),
    # constant tables
    "activations/chunked_attention.py:KERNEL_OF_BACKEND": CONSTANT,
    "attention/blockwise.py:KERNELS": CONSTANT,
    "attention/core.py:FUSED_SDPA_BACKENDS": CONSTANT,
    "budget/config.py:OPERATOR_SETTINGS": CONSTANT,
    "budget/planner.py:GROUPS": CONSTANT,
    "budget/planner.py:FULL_RECOMPUTE": CONSTANT,
    "budget/planner.py:NO_RECOMPUTE": CONSTANT,
    "budget/terms.py:TERM_LABELS": CONSTANT,
    "budget/terms.py:PINNED_HOST_FIXES": CONSTANT,
    "convert/deepseek_v3.py:MLA_YARN_FIXED": CONSTANT,
    "convert/families.py:FAMILIES": CONSTANT,
    "convert/families.py:ALIASES": CONSTANT,
    "convert/hf_files.py:SAFETENSORS_DTYPES": CONSTANT,
    "convert/hf_files.py:DTYPE_NAMES": CONSTANT,
    "convert/pipeline.py:DTYPES": CONSTANT,
    "convert/pipeline.py:SIGNIFICANT_BITS": CONSTANT,
    "convert/qwen3_next.py:LAYER_TYPES": CONSTANT,
    "convert/torch_dist.py:CONTENT_METADATA": CONSTANT,
    "data/indexed_check.py:TOKEN_DTYPES": CONSTANT,
    "launch/arguments.py:RUN_SETTINGS": CONSTANT,
    "launch/arguments.py:TE_FREE_DEFAULTS": CONSTANT,
    "launch/arguments.py:REPLACED_BY_PLANNER": CONSTANT,
    "launch/run_summary.py:UPSTREAM_DISPATCHERS": CONSTANT,
    "launch/upstream_checks.py:COUNTS": CONSTANT,
    "model/mla.py:MLA_WIDTHS": CONSTANT,
    "optimizer/distributed.py:_FIXED_TORCH_ARGUMENTS": CONSTANT,
    "optimizer/moment_dtype_adamw.py:MOMENT_DTYPES": CONSTANT,
    "settings.py:_TYPES": CONSTANT,
    "loss/ring_dtp/function.py:_FORWARD": CONSTANT,
    "loss/ring_dtp/function.py:_BACKWARD": CONSTANT,
    "loss/ring_dtp/strips.py:STATS": "Ring-DTP's counters of its last call (strips, hops, bytes, "
                                     "mode), read by its tests and benchmarks: reset by "
                                     "reset_ring_dtp_stats, never part of training",
    "loss/ring_dtp/strips.py:_PROBED": "cache of the fused strip kernel's probe on this device",
}


def _call_name(func) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _immutable_class(node: ast.ClassDef) -> bool:
    """A frozen dataclass, a NamedTuple or an Enum: its instances are values."""
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and any(
                k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in decorator.keywords):
            return True
    return any(_call_name(base) in ("NamedTuple", "Enum", "IntEnum") for base in node.bases)


def _mutable(value, mutable_classes: set) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        name = _call_name(value.func)
        return name in MUTABLE_CALLS or (isinstance(value.func, ast.Name) and name in mutable_classes)
    return False


def module_state(path: Path) -> dict[str, int]:
    """``{name: line}`` of the module-level mutable objects of one source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    mutable_classes = {node.name for node in tree.body
                       if isinstance(node, ast.ClassDef) and not _immutable_class(node)}
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _mutable(value, mutable_classes):
            for target in targets:
                if isinstance(target, ast.Name) and target.id != "__all__":
                    found.setdefault(target.id, node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                found.setdefault(name, node.lineno)
    return found


def package_state() -> dict[str, int]:
    """``{"path:NAME": line}`` over every module of megatron.bounded."""
    state = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        for name, line in module_state(path).items():
            state[f"{relative}:{name}"] = line
    return state


def test_every_module_level_mutable_object_is_allowed_with_a_reason():
    unlisted = sorted(f"megatron/bounded/{key.split(':')[0]}:{line} {key.split(':')[1]}"
                      for key, line in package_state().items() if key not in ALLOWED)
    assert not unlisted, (
        "module-level mutable objects not in ALLOWED: " + ", ".join(unlisted) + ". State of a "
        "run goes into an object made at start-up (settings, the progress meter) or into the "
        "module instance that uses it; a cache of a deterministic function, a constant table or "
        "a process-wide resource goes into ALLOWED in tests/repo/test_module_state.py with its "
        "reason.")


def test_every_allowed_entry_still_exists_and_has_a_reason():
    state = package_state()
    stale = sorted(key for key in ALLOWED if key not in state)
    assert not stale, f"ALLOWED names objects no longer there (remove them): {stale}"
    assert all(isinstance(reason, str) and reason.strip() for reason in ALLOWED.values())


def test_the_finder_sees_each_kind_of_module_state(tmp_path):
    """Displays, comprehensions, mutable calls, instances of the module's own mutable classes
    and ``global`` rebinding are found; constants, frozen instances and __all__ are not."""
    source = tmp_path / "example.py"
    source.write_text(
        "import collections, dataclasses, threading\n"
        "__all__ = ['f']\n"
        "LIMIT = 3\n"
        "NAMES = ('a', 'b')\n"
        "TABLE = {'a': 1}\n"
        "SQUARES = [i * i for i in range(3)]\n"
        "SEEN: set = set()\n"
        "BY_KEY = collections.defaultdict(list)\n"
        "LOCAL = threading.local()\n"
        "class Store:\n"
        "    pass\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Point:\n"
        "    x: int = 0\n"
        "STORE = Store()\n"
        "ORIGIN = Point()\n"
        "current = None\n"
        "def f():\n"
        "    global current\n"
        "    current = 1\n",
        encoding="utf-8")
    assert set(module_state(source)) == {"TABLE", "SQUARES", "SEEN", "BY_KEY", "LOCAL", "STORE",
                                         "current"}

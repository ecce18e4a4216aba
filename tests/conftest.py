"""Markers and helpers shared by every test directory (tests/unit, tests/harness, tests/functional).

GPU tests carry two marks: ``@pytest.mark.gpu`` selects them (``pytest -m gpu``, what
``scripts/gpu_functional.sh`` runs) and one of the skips below keeps them from failing on a
machine without enough GPUs::

    from tests.conftest import requires_cuda, requires_two_gpus

    @pytest.mark.gpu
    @requires_cuda
    def test_gpu_something(): ...

Multi-rank helpers live in ``tests/unit/distributed.py`` (``run_on_ranks``: gloo on CPU, NCCL on
GPUs) and routing generators for the MoE tests in ``tests/unit/routing.py``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal

import pytest
import torch


# The smallest pretrain_gpt.py command line upstream's parser accepts (mock data, 2 tiny layers):
# argument tests add the flags they are about to it.
MINIMAL_PRETRAIN_FLAGS = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
    "--eval-interval", "3", "--eval-iters", "0", "--lr", "1e-4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--disable-bias-linear",  # as MoE models do (the torch-native MoE backend has no biases)
)


def write_indexed_dataset(prefix, documents, dtype=None, multimodal: bool = False):
    """``prefix``.bin/.idx holding ``documents`` (lists of token ids), one sequence each, written
    by megatron-core's own builder (what tools/preprocess_data.py uses); returns ``prefix``."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype or numpy.uint16,
                                    multimodal=multimodal)
    for document in documents:
        builder.add_item(torch.tensor(document, dtype=torch.int64), *([0] if multimodal else []))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def requires_gpus(count: int):
    """Skip unless this machine has at least ``count`` CUDA devices."""
    reason = "needs a CUDA GPU" if count == 1 else f"needs {count} CUDA GPUs"
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=reason)


requires_cuda = requires_gpus(1)
requires_two_gpus = requires_gpus(2)


class _TorchOnCpu:
    """``torch`` for upstream modules that make tensors on CUDA: rope_utils (its CP slice pins
    an index and moves it to CUDA) and transformer utils (attention masks made on CUDA)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, pin_memory=False, **kwargs):
        return torch.tensor(*args, **kwargs)

    @staticmethod
    def ones(*args, device=None, **kwargs):
        return torch.ones(*args, **kwargs)


def keep_upstream_rotary_on_cpu():
    """Test-only shims (this worker process): upstream's rotary embedding moves its frequencies
    to the current CUDA device and its context-parallel slice index to CUDA; keep both here."""
    from megatron.core.models.common.embeddings import rope_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    rope_utils.torch = _TorchOnCpu()


def keep_upstream_masks_on_cpu():
    """Test-only shim (this worker process): upstream's local attention makes its causal and
    sliding-window masks on CUDA; make them here (the masks themselves are upstream's)."""
    from megatron.core.transformer import utils

    utils.torch = _TorchOnCpu()


def keep_upstream_dispatcher_on_cpu():
    """Test-only shim (this worker process): upstream's all-to-all token dispatcher copies its
    split sizes to the host on a side CUDA stream; without a GPU every tensor is on the host
    already, so the side stream is the current one and switching to it does nothing."""
    import contextlib

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class HostStream:  # its copies are done when issued: nothing to wait for
        def record_event(self):
            return self

        def synchronize(self):
            pass

    host_stream = HostStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = host_stream
    torch.cuda.current_stream = lambda device=None: host_stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()


def keep_upstream_checkpoint_on_cpu():
    """Test-only shim (this worker process): upstream's activation checkpoint saves and restores
    the CUDA generator's state; without a GPU there is none to keep."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None


@contextlib.contextmanager
def one_cpu_rank():
    """Upstream's parallel state on this one (CPU) rank, with the shims above."""
    from megatron.core import parallel_state

    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def small_bounded_gpt(seq_length: int, vocab_size: int, **config):
    """A float64 GPT of two small layers on CPU, built like ``pretrain_gpt.py`` builds its model
    (``BoundedTransformerConfig``, ``BoundedMLATransformerConfig`` with
    ``multi_latent_attention=True``, and ``bounded_decoder_spec``), with seed 0; ``config`` adds or
    overrides config fields (recompute, MoE, parallel sizes, MLA's dimensions, ...)."""
    from megatron.core.models.gpt import GPTModel

    from megatron.bounded.model.config import transformer_config_class
    from megatron.bounded.model.specs import bounded_decoder_spec

    fields = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, kv_channels=8, attention_dropout=0.0, hidden_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float64,
        init_method_std=0.2, transformer_impl="local",
    )
    config_class = transformer_config_class(config.get("multi_latent_attention", False))
    transformer = config_class(**{**fields, **config})

    class ModelConfig:  # what bounded_decoder_spec reads
        pass

    ModelConfig.transformer = transformer
    torch.manual_seed(0)
    return GPTModel(
        transformer, bounded_decoder_spec(ModelConfig), vocab_size=vocab_size,
        max_sequence_length=seq_length, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).double()


def pytest_configure(config):
    # also declared in pytest.ini; repeated here so that a run from another directory knows them
    config.addinivalue_line(
        "markers",
        "gpu: needs CUDA GPUs (selected by scripts/gpu_functional.sh with -m gpu)",
    )
    config.addinivalue_line(
        "markers",
        "slow: left out of the quick tier (scripts/test.sh --quick); set in pytest_collection_modifyitems",
    )


# Test files left out of the quick tier besides those that import run_on_ranks (every one of
# those starts processes): each takes more than a few seconds on 2 cores (model builds, planner
# searches, tool runs in subprocesses). tests/harness/test_quick_tier.py checks that they exist.
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SLOW_FILES = (
    "tests/harness/test_bench_pipelined_llep.py",
    "tests/harness/test_diagnostics_checksums.py",
    "tests/harness/test_gpu_lanes.py",
    "tests/unit/launch/test_arguments.py",
    "tests/unit/launch/test_bad_input.py",
    "tests/unit/budget/test_budget.py",
    "tests/unit/budget/test_budget_reach_records.py",
    "tests/unit/launch/test_console_script_runs.py",
    "tests/unit/convert/test_convert_hf_deepseek_v32.py",
    "tests/unit/data/test_data_check.py",
    "tests/unit/budget/test_example_budgets.py",
    "tests/unit/launch/test_help.py",
    "tests/unit/budget/test_planner.py",
    "tests/unit/budget/test_planner_examples.py",
    "tests/unit/data/test_preprocess_data.py",
    "tests/unit/activations/test_sco.py",
    "tests/unit/attention/test_sparse_attention.py",
)


def pytest_collection_modifyitems(items):
    """Mark ``slow`` every test of :data:`SLOW_FILES` and of a module that imports run_on_ranks."""
    from tests.unit.distributed import run_on_ranks

    slow_paths = {_REPO_ROOT / path for path in SLOW_FILES}
    for item in items:
        module = getattr(item, "module", None)
        if (item.path in slow_paths
                or getattr(module, "run_on_ranks", None) is run_on_ranks):
            item.add_marker(pytest.mark.slow)


# Signals whose handlers a test may replace (a tool's main() called in-process installs its own
# SIGTERM handler, pretrain code its exit-signal handler); restored after every test, so one
# test's handler never decides how a later test, or pytest itself, reacts to a signal.
_RESTORED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
    if hasattr(signal, name)
)


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """Put back every handler of :data:`_RESTORED_SIGNALS` that the test changed."""
    saved = {number: signal.getsignal(number) for number in _RESTORED_SIGNALS}
    yield
    for number, handler in saved.items():
        if handler is not None and signal.getsignal(number) is not handler:
            signal.signal(number, handler)


@pytest.fixture(autouse=True)
def restore_attention_backend_environment():
    """megatron-core's model build exports ``NVTE_*`` variables for its attention backend and
    asserts on them at the next build (and worker processes inherit them): each test starts from
    the environment the session had."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("NVTE_")}
    yield
    for name in [name for name in os.environ if name.startswith("NVTE_")]:
        if name not in saved:
            del os.environ[name]
    os.environ.update(saved)

"""megatron-bounded: bounded-memory long-context MoE training on top of megatron-core."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).parent


def _version() -> str:
    for line in (ROOT / "megatron" / "bounded" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip('"')
    raise RuntimeError("megatron/bounded/__init__.py has no __version__")


setup(
    name="megatron-bounded",
    version=_version(),
    description=(
        "Megatron-LM extension for long-context Mixture-of-Experts training with bounded "
        "memory peaks: sync-free MoE, Ring-DTP, SCO, OffloadStreamAdamW, launch-time budget"
    ),
    license="Apache-2.0",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    # `megatron` is a namespace package shared with the installed megatron-core: we ship only
    # `megatron.bounded` and must never ship megatron/core or megatron/training.
    packages=find_namespace_packages(include=["megatron.bounded", "megatron.bounded.*"]),
    # the user commands; from a clone, tools/<name>.py runs the same main
    entry_points={"console_scripts": [
        "bounded-memory-budget = megatron.bounded.launch.commands.memory_budget:main",
        "bounded-convert-hf = megatron.bounded.launch.commands.convert_hf:main",
        "bounded-preprocess-data = megatron.bounded.launch.commands.preprocess_data:main",
        "bounded-verify-checkpoint = megatron.bounded.launch.commands.verify_checkpoint:main",
        "bounded-summarize-metrics = megatron.bounded.launch.commands.summarize_metrics:main",
    ]},
    install_requires=[
        "torch>=2.9",
        "megatron-core==0.19.2",
        "einops",
        "numpy",
        # megatron-core's torch_dist checkpoint writer imports it while saving but does not
        # declare it
        "psutil",
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        # transformers' model classes are the reference of tests/unit/convert/test_convert_hf.py
        "test": ["pytest>=8", "pytest-timeout", "transformers>=5", "safetensors"],
        # bounded-preprocess-data: HuggingFace tokenizers (loading, and training one on a corpus)
        "data": ["transformers", "tokenizers", "tqdm"],
        # bounded-convert-hf: safetensors files (import, export); transformers for verify
        "convert": ["safetensors", "transformers>=5"],
        "te": ["transformer-engine[pytorch]"],
        # the gated delta rule's Triton kernels (gated DeltaNet layers on CUDA); without it the
        # PyTorch kernel of megatron/bounded/attention/gated_delta_rule.py runs
        "gdn": ["fla-core==0.6.0"],
        "resiliency": ["nvidia-resiliency-ext"],
        # single-GPU fused cross-entropy kernels that tools/benchmarks/bench_ring_dtp.py compares
        # Ring-DTP with; never imported by the package itself
        "bench": ["liger-kernel", "cut-cross-entropy"],
    },
)

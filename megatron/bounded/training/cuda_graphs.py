"""Release upstream's whole-iteration CUDA graphs before the process exits.

A captured CUDA graph holds on to the NCCL resources of the collectives it recorded. Upstream's
training (``--cuda-graph-impl full_iteration``) keeps its graphs and their static outputs in class
attributes of ``FullCudaGraphWrapper``, which Python frees only at interpreter exit, after the
NCCL process groups have been destructed, and a group torn down while a graph that recorded its
collectives is alive can wait forever: a graph-trained job then finishes its iterations and never
exits. ``pretrain_gpt.py`` therefore releases the graphs as soon as training returns. Tests: ``tests/unit/training/test_cuda_graphs.py`` (the bookkeeping, on CPU) and
``tests/functional/test_paged_stash_training.py::test_whole_iteration_graph_trains_and_exits``.
"""

from __future__ import annotations

import torch
from megatron.core.full_cuda_graph import FullCudaGraphWrapper


def release_full_iteration_graphs() -> int:
    """Drop every captured whole-iteration graph and its static outputs; how many were captured."""
    captured = sum(graph is not None for graph in FullCudaGraphWrapper.cuda_graph.values())
    # upstream's own reset of every stage: graphs, static outputs and iteration counters, then a
    # collection (a graph's exec is destroyed with its last reference, before NCCL's); it reads
    # only the class's bookkeeping, so it needs none of the wrappers training built
    FullCudaGraphWrapper.reset_cuda_graph(None)
    if captured and torch.cuda.is_available():
        torch.cuda.synchronize()
    return captured

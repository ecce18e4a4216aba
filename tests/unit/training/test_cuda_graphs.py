"""release_full_iteration_graphs drops upstream's whole-iteration graphs (CPU stand-ins)."""

import gc
import weakref

from megatron.bounded.training.cuda_graphs import release_full_iteration_graphs
from megatron.core.full_cuda_graph import FullCudaGraphWrapper


class _Graph:
    """Stands in for a captured torch.cuda.CUDAGraph: only its lifetime matters here."""


def test_upstream_keeps_graphs_and_results_per_stage():
    # what the helper relies on in the pinned megatron-core
    assert set(FullCudaGraphWrapper.cuda_graph) == {"training", "validation"}
    assert set(FullCudaGraphWrapper.result) == set(FullCudaGraphWrapper.cuda_graph)


def test_release_frees_captured_graphs_and_outputs(monkeypatch):
    graph, output = _Graph(), [_Graph()]
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": graph, "validation": None})
    monkeypatch.setattr(FullCudaGraphWrapper, "result", {"training": output, "validation": None})
    graph_alive, output_alive = weakref.ref(graph), weakref.ref(output[0])
    del graph, output
    assert release_full_iteration_graphs() == 1
    gc.collect()
    assert graph_alive() is None and output_alive() is None
    assert FullCudaGraphWrapper.cuda_graph == {"training": None, "validation": None}
    assert FullCudaGraphWrapper.result == {"training": None, "validation": None}


def test_release_without_graphs_is_a_no_op(monkeypatch):
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": None, "validation": None})
    monkeypatch.setattr(FullCudaGraphWrapper, "result", {"training": None, "validation": None})
    assert release_full_iteration_graphs() == 0


def test_release_goes_through_upstreams_reset_of_both_stages(monkeypatch):
    graphs = {"training": _Graph(), "validation": _Graph()}
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", dict(graphs))
    monkeypatch.setattr(FullCudaGraphWrapper, "result", {"training": [1], "validation": [2]})
    monkeypatch.setattr(FullCudaGraphWrapper, "curr_iteration", {"training": 7, "validation": 3})
    alive = [weakref.ref(graph) for graph in graphs.values()]
    del graphs
    assert release_full_iteration_graphs() == 2
    assert all(graph() is None for graph in alive)  # upstream's reset collects them
    assert FullCudaGraphWrapper.cuda_graph == {"training": None, "validation": None}
    assert FullCudaGraphWrapper.result == {"training": None, "validation": None}
    assert FullCudaGraphWrapper.curr_iteration == {"training": 0, "validation": 0}

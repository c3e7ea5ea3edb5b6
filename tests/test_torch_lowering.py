"""exporters/executorch/torch_lowering.py: while a program is lowered, torch.fx's provenance chains are shared
instead of deep-copied and, for a small model, the collector is relaxed. The chains record the same
thing, the lowered program is the same bytes, and torch and the collector are left as they were."""

import copy
import gc

import pytest
import torch

from exporters.executorch.backend import BACKEND
from exporters.executorch.torch_lowering import SMALL_BYTES, YOUNG_THRESHOLD, collect, lowering, shared_provenance


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.silu(self.a(x)) * x)


def chains(ep) -> list:
    """Every node's provenance, as torch renders it (NodeSource.to_dict: names, passes, actions, nested),
    less graph_id (the id() of a graph object: another object on another run)."""
    def plain(d):
        return {k: [plain(f) for f in v] if k == "from_node" else v for k, v in d.items() if k != "graph_id"}

    return [[plain(s.to_dict()) for s in n.meta.get("from_node", [])] for n in ep.graph.nodes]


def test_the_chains_are_the_same_and_torch_is_restored():
    from torch.fx import traceback as fxt

    ep = torch.export.export(Two(), (torch.ones(2, 8),))
    want = chains(ep.run_decompositions())
    with shared_provenance():
        assert fxt.copy is not copy
        with shared_provenance():  # nested: the inner one leaves the outer's in place
            pass
        assert fxt.copy is not copy
        got = chains(ep.run_decompositions())
    assert fxt.copy is copy
    assert got == want and any(got)  # the decomposition recorded provenance, and the same
    with pytest.raises(RuntimeError), shared_provenance():
        raise RuntimeError("a lowering that fails")
    assert fxt.copy is copy  # restored on the way out of a failure too


def test_a_copy_of_anything_but_a_chain_is_deep():
    from exporters.executorch.torch_lowering import _ShallowChains

    x = [{"a": [1]}]
    y = _ShallowChains.deepcopy(x)
    assert y == x and y[0] is not x[0]


@pytest.mark.skipif(not BACKEND.availability()[0], reason=BACKEND.availability()[1])
def test_the_lowered_program_is_the_same_bytes():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    def lower():
        ep = torch.export.export(Two(), (torch.ones(2, 8),))
        return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer

    plain = lower()
    with lowering(1 << 10):
        shared = lower()
    assert shared == plain


def test_the_collector_is_relaxed_for_a_small_model_only(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    before = gc.get_threshold()
    with lowering(SMALL_BYTES - 1):
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        collect()
        assert calls == []  # kilobytes: not worth a full collection
        with lowering(SMALL_BYTES):  # a larger program inside a small one's build stays relaxed
            collect()
        assert calls == []
    assert gc.get_threshold() == before
    with lowering(SMALL_BYTES):
        assert gc.get_threshold() == before
        collect()
        assert len(calls) == 1  # a real width's weights held by reference cycles: freed
    collect()
    assert len(calls) == 2  # outside a lowering, collect() is gc.collect()
    with pytest.raises(RuntimeError), lowering(0):
        raise RuntimeError("a lowering that fails")
    assert gc.get_threshold() == before


def test_a_lowering_leaves_no_graph_in_executorchs_node_cache():
    """executorch.exir.backend.utils.is_same_node is an unbounded lru_cache keyed by fx Nodes: a self-test
    worker kept every graph it lowered (about 45 MB a check). lowering() empties it when a build ends."""
    import torch
    from executorch.exir.backend.utils import is_same_node

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    a, b = list(gm.graph.nodes)[:2]
    with lowering(0):
        is_same_node(a, b)
        assert is_same_node.cache_info().currsize > 0
    assert is_same_node.cache_info().currsize == 0

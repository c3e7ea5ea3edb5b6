"""What every ExecuTorch lowering here runs under: torch.fx's provenance shared instead of copied,
for a small model Python's cyclic collector relaxed, and ExecuTorch's node cache emptied when it ends
(_forgetting: otherwise it keeps every graph it compared, for the process's life). None changes a byte
of the program (tests/test_torch_lowering.py); the first two are about a lowering's time, which is Python's (graphs of
hundreds of thousands of nodes rebuilt by each of dozens of passes). Measured on 2 cores,
2026-11-29, docs/benchmarks.md.

Provenance. When a pass makes a node from another, torch.fx records where it came from: a
NodeSource whose `from_node` is a deep copy of the source node's whole chain
(torch/fx/traceback.py, `copy.deepcopy(node.meta["from_node"])`). Each pass adds a level to every
chain, so copying them took a sixth of a lowering (tiny qwen3_5_moe's XNNPACK check program
132 s -> 110 s without). Nothing edits a NodeSource once it is made (torch only builds new
ones; ExecuTorch never reads them), so a shallow copy of the list records the same provenance.

The collector. A lowering makes millions of short-lived objects; at Python's default thresholds
the collector runs about 5000 times in one tiny program's lowering, 18 of them full collections of
every object of the process (6.3 s of olmoe's 43 s; the explicit ones below, 0.3-1 s each, free
a real width's weights that reference cycles hold). For a model under SMALL_BYTES the first
threshold is 10000 instead of 700 (3.3 s) and the explicit collections are skipped: what they
would free is kilobytes. A larger model's lowering is left as it was (memory first).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import gc
import sys

SMALL_BYTES = 256 << 20  # weights (fp32) under this: the collector relaxed
YOUNG_THRESHOLD = 10_000  # the collector's first threshold in a small model's lowering (Python's: 700)

_small: contextvars.ContextVar = contextvars.ContextVar("small_lowering", default=False)


class _ShallowChains:
    """Stands in for the `copy` module inside torch.fx.traceback: a provenance chain (a list of
    NodeSource) is copied as a list; anything else as `copy` would."""

    copy = staticmethod(copy.copy)

    @staticmethod
    def deepcopy(x, memo=None):
        from torch.fx.traceback import NodeSource

        if type(x) is list and all(isinstance(s, NodeSource) for s in x):
            return list(x)
        return copy.deepcopy(x, memo)


@contextlib.contextmanager
def shared_provenance():
    """Within: torch.fx shares provenance chains instead of deep-copying them."""
    from torch.fx import traceback as fxt

    if getattr(fxt, "copy", None) is not copy:  # another torch, or already inside: leave it as it is
        yield
        return
    fxt.copy = _ShallowChains
    try:
        yield
    finally:
        fxt.copy = copy


@contextlib.contextmanager
def _forgetting():
    """After a build, ExecuTorch's `exir.backend.utils.is_same_node` cache emptied: an unbounded lru_cache
    keyed by fx Nodes, it keeps every graph it compared alive (a self-test worker grew by about 45 MB a
    lowered check, 11 GB over the fifteen-family catalogue: docs/benchmarks.md)."""
    try:
        yield
    finally:
        utils = sys.modules.get("executorch.exir.backend.utils")
        if utils is not None and hasattr(utils.is_same_node, "cache_clear"):
            utils.is_same_node.cache_clear()


@contextlib.contextmanager
def lowering(weight_bytes: int):
    """The context of one program's build (export, lowering, serialisation) for a model whose
    weights take `weight_bytes`: provenance shared; under SMALL_BYTES, the collector relaxed and
    collect() a no-op. Also a decorator."""
    with shared_provenance(), _forgetting():
        if weight_bytes >= SMALL_BYTES or _small.get():
            yield
            return
        threshold = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])
        token = _small.set(True)
        try:
            yield
        finally:
            _small.reset(token)
            gc.set_threshold(*threshold)


def collect() -> None:
    """gc.collect(): what reference cycles hold of a large model's weights, freed now (inside a
    small model's lowering, nothing: kilobytes, for 0.3-1 s)."""
    if not _small.get():
        gc.collect()

"""The state a recurrent mixer (Gated DeltaNet, LFM2's short convolution) carries between calls, in buffers."""

from __future__ import annotations


def reset_at_start(pos, *states) -> None:
    """Zero a mixer's carried state buffers when a call starts at position 0 (a new sequence), in the graph (no
    branch: exportable); pos [T]."""
    keep = (pos[0] != 0).to(states[0].dtype)  # (cast once, then only where a state's dtype differs: the graph
    for s in states:                         # the exporters' cast gates count is the one it was)
        s.mul_(keep.to(s.dtype))

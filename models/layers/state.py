"""The state a recurrent mixer (Gated DeltaNet, LFM2's short convolution) carries between calls, in buffers."""

from __future__ import annotations


def reset_at_start(pos, *states) -> None:
    """Zero a mixer's carried state buffers when a call starts at position 0 (a new sequence), in the graph (no
    branch: exportable); pos [T]."""
    # one cast for the first state, one more for each further state: the ops the exporters' structural goldens
    # count (even a cast to the same dtype leaves an assertion in an exported graph)
    keep = (pos[0] != 0).to(states[0].dtype)
    states[0].mul_(keep)
    for s in states[1:]:
        s.mul_(keep.to(s.dtype))

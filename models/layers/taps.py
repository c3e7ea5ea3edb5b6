"""The drill's taps in the production model: a value with no module of its own, named so that
the drill (oracle/drill/points.py) can record it while one runs."""

from __future__ import annotations

# a drill's recorder (oracle/drill/points.py), called as TAPS(point, tensor) while one runs; None otherwise,
# so `tap` is a no-op and traced graphs (torch.export) do not change
TAPS = None


def tap(point: str, x, view=None):
    """A value with no module of its own, named for the drill (oracle.drill.points.TAPS); `view` maps it to
    the layout HF computes it in (applied only while a drill records)."""
    if TAPS is not None:
        TAPS(point, x if view is None else view(x))
    return x

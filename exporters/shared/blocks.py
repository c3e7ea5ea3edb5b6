"""What a block of the production model is called with, for exporters that trace it alone: its input's rows per
position and width (models.args.block_path's (layer, kind) -> module; the harness calls it with the rows the
reference records, oracle/reference/run.py)."""

from __future__ import annotations


def block_rows(args, kind: str) -> tuple[int, int]:
    """(rows per position, width) of block `kind`'s input x [1, T * rows, width] at T positions (pos [T]): one row of
    hidden_size, except a decoder layer's on a residual widened to N streams: hyper-connections' N rows
    (models/layers/hyper.py: [1, T*N, H]), Qwen4-Exp's gated residual one row of N*H (models/layers/gated_residual.py,
    its final norm's too: it mixes the streams)."""
    if kind == "layer" and args.hyper is not None:
        return args.hyper.streams, args.hidden_size
    if kind in ("layer", "final_norm") and args.gated_residual is not None:
        return 1, args.hidden_size * args.gated_residual.streams
    return 1, args.hidden_size

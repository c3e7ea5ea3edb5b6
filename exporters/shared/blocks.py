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


def not_isolated(args, unit: str) -> dict:
    """The blocks (layer, kind) an exporter's block `unit` (IREE's program, the MLX delegate's method) cannot run alone,
    and why (their rows' n/a): those reading another layer's state (GLM-5's shared DSA layers, ZAYA's routers after
    the first) or the call's token ids (models.args.token_blocks). The whole model's prefill and decode carry both."""
    from models.args import token_blocks

    held = f"its block {unit} does not hold (the whole model's prefill and decode carry it: the e2e row)"
    dsa = args.attention.dsa
    out = {(i, kind): f"a DSA shared layer attends to the keys an earlier layer's indexer chose, state {held}"
           for i, shared in enumerate(dsa.shared if dsa is not None else ()) if shared for kind in ("attention", "layer")}
    if args.zaya is not None:  # (models/layers/zaya_router.py)
        out.update({(i, kind): f"a ZAYA router after the first adds the previous layer's router state, which {held}"
                    for i in range(1, args.num_hidden_layers) for kind in ("router", "moe", "layer")})
    out.update({key: f"{why}, which its block {unit} does not take (the whole model's prefill and decode carry them: "
                     "the e2e row)" for key, why in token_blocks(args).items()})
    return out

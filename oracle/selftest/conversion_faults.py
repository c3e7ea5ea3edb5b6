"""Conversion defects, seeded: the mistakes a converter makes between a checkpoint and the file it ships
(`oracle selftest --conversion`: each must fail the weight check naming its tensor, oracle/verdict/conversion.py).

Most act on the checkpoint's tensors before the format's own converter runs (a converter that stacks the
experts in the wrong order, transposes a projection, permutes q/k rows for another rope layout, folds a
stray scale into one expert, drops a router row): `edit(tensors, args) -> {name: new tensor}` over the
tensors of the checkpoint as saved (HF names and layouts), found by what they are (a layer's experts, its
router, its attention), never by a family's name for them. The faulted checkpoint is then converted by the
backend's own exporter, and the file checked against the unfaulted original. The faults that only a file
can have (a scale written for another group) are the backend's (`Backend.file_faults`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from models.args import FULL, SPARSE, mlp_type

EXPERT = re.compile(r"\.experts\.(\d+)\.(.+)$")  # per-expert tensors: <moe>.experts.<e>.<projection>
ROUTER = re.compile(r"\.(gate|router(\.layer)?)\.weight$")


@dataclass(frozen=True)
class ConversionFault:
    name: str
    what: str
    # (tensors of the target layer: name -> torch tensor, args, layer) -> {name: new tensor}; {} where the
    # layer has nothing the fault breaks (not applicable)
    edit: Callable


def last_sparse(args) -> int:
    return max(i for i in range(args.num_hidden_layers) if mlp_type(args, i) == SPARSE)


def last_full(args) -> int | None:
    full = [i for i in range(args.num_hidden_layers) if args.layer_types[i] == FULL]
    return max(full) if full else None


def _per_expert(tensors: dict) -> dict:
    """projection -> {expert: name} of a layer's per-expert tensors."""
    out: dict = {}
    for n in tensors:
        m = EXPERT.search(n)
        if m:
            out.setdefault(m.group(2), {})[int(m.group(1))] = n
    return out


def _stacked(tensors: dict, args) -> list[str]:
    """A layer's expert tensors stacked along a leading expert dimension (fused layouts)."""
    return sorted(n for n, t in tensors.items() if t.ndim == 3 and t.shape[0] == args.num_experts
                  and ("expert" in n or "linear" in n))


def _pick(names, prefer: tuple[str, ...]) -> str | None:
    names = sorted(names)
    for p in prefer:
        hit = [n for n in names if p in n]
        if hit:
            return hit[0]
    return names[0] if names else None


def experts_exchanged(tensors, args, layer):
    """Experts 0 and 1 of one projection exchanged (a stacking step that took them in the wrong order)."""
    per = _per_expert(tensors)
    proj = _pick(per, ("up_proj", "w3", "gate_up", "gate_proj", "w1"))
    if proj is not None and {0, 1} <= set(per[proj]):
        a, b = per[proj][0], per[proj][1]
        return {a: tensors[b].clone(), b: tensors[a].clone()}
    stacked = _pick(_stacked(tensors, args), ("gate_up", "input_linear", "up"))
    if stacked is None:
        return {}
    t = tensors[stacked].clone()
    t[[0, 1]] = t[[1, 0]]
    return {stacked: t}


def projection_transposed(tensors, args, layer):
    """A square attention projection written transposed (a converter that took x W for W x)."""
    square = sorted(n for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2 and "attn" in n
                    and t.shape[0] == t.shape[1] and not ROUTER.search(n))
    name = _pick(square, ("o_proj", "q_proj"))
    return {} if name is None else {name: tensors[name].t().contiguous()}


def qk_rows_permuted(tensors, args, layer):
    """q and k rows permuted as llama.cpp's converter permutes them for its rope layout (the pairs (i,
    i + d/2) of each head made adjacent): a file whose rows are for another rotation than its graph's."""
    out = {}
    for which, heads in (("q_proj", args.num_attention_heads), ("k_proj", args.num_key_value_heads)):
        name = next((n for n in tensors if n.endswith(f".{which}.weight")), None)
        if name is None:
            return {}
        w = tensors[name]
        if w.shape[0] != heads * args.head_dim:
            return {}  # a gated or otherwise wider projection: not the plain rope layout
        out[name] = w.reshape(heads, 2, args.head_dim // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()
    return out


def expert_scaled(tensors, args, layer):
    """One expert's down projection 1 % too large (a stray scale folded into one expert)."""
    per = _per_expert(tensors)
    proj = _pick(per, ("down_proj", "w2"))
    if proj is not None and 0 in per[proj]:
        return {per[proj][0]: tensors[per[proj][0]] * 1.01}
    stacked = _pick([n for n in _stacked(tensors, args) if "down" in n or "output" in n], ("down", "output"))
    if stacked is None:
        return {}
    t = tensors[stacked].clone()
    t[0] *= 1.01
    return {stacked: t}


def router_row_zeroed(tensors, args, layer):
    """The router's row of expert 0 written as zeros (a slice that lost one expert)."""
    name = next((n for n, t in sorted(tensors.items()) if ROUTER.search(n) and "expert" not in n and t.ndim == 2
                 and t.shape[0] == args.num_experts), None)
    if name is None:
        return {}
    t = tensors[name].clone()
    t[0] = 0
    return {name: t}


CATALOGUE = (
    ConversionFault("experts_exchanged", "experts 0 and 1 of one projection exchanged (last MoE layer)",
                    experts_exchanged),
    ConversionFault("projection_transposed", "a square attention projection written transposed (last full-attention "
                    "layer)", projection_transposed),
    ConversionFault("qk_rows_permuted", "q and k rows permuted for another rope layout (last full-attention layer)",
                    qk_rows_permuted),
    ConversionFault("expert_scaled", "one expert's down projection 1 % too large (last MoE layer)", expert_scaled),
    ConversionFault("router_row_zeroed", "the router's row of one expert zeroed (last MoE layer)", router_row_zeroed),
)
ATTENTION_FAULTS = ("projection_transposed", "qk_rows_permuted")


def target_layer(fault: ConversionFault, args) -> int | None:
    return last_full(args) if fault.name in ATTENTION_FAULTS else last_sparse(args)


def faulted_tensors(fault: ConversionFault, index: dict, args) -> dict:
    """The edited tensors of a checkpoint (`index`: models.checkpoint.tensor_index): {} where the fault
    does not apply to this model."""
    from models.checkpoint import LAYER, read_tensors

    layer = target_layer(fault, args)
    if layer is None:
        return {}
    names = [n for n in index if (m := LAYER.search(n)) and int(m.group(1)) == layer]
    return fault.edit(read_tensors(index, names), args, layer)


def folded(name: str) -> str:
    """A checkpoint tensor's name with its expert index folded (how the weight check labels a stacked tensor)."""
    return re.sub(r"\.experts\.\d+\.", ".experts.*.", name)


def faulted_checkpoint(model_dir, sha: str, fault: ConversionFault, args):
    """(a copy of the checkpoint at `model_dir` (identity `sha`) with the fault's edits, cached by both and
    this code; the names of the edited tensors), or None where the fault does not apply to the model. Its config and every other tensor
    are the original's; all tensors go into one file (a tiny checkpoint's few MB)."""
    import hashlib
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from oracle.cache.files import cached_dir
    from models.checkpoint import read_tensors, tensor_index

    index = tensor_index(Path(model_dir))
    edits = faulted_tensors(fault, index, args)
    if not edits:
        return None
    recipe = {"checkpoint": sha, "fault": fault.name, "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}

    def build(out):
        tensors = {**read_tensors(index, sorted(index)), **edits}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(Path(model_dir) / "config.json", out / "config.json")

    return cached_dir(recipe, f"conversion-{fault.name}", "oracle_fault.json", build), sorted(edits)

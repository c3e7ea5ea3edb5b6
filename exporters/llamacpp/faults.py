"""Seeded faults in a GGUF: the bugs llama.cpp's converter and hand-written graphs really have,
written into the f32 GGUF the converter made (the llamacpp backend's `oracle selftest` catalogue).

A metadata fault changes a hyper-parameter every layer reads, so it shows first in the first layer
it touches (`first_*` targets, models.faults.fault.Fault.layer); a tensor fault edits one layer's tensors
(the catalogue's `last`/`rope` targets). Each names what a correct oracle must localise: the block
kind and, through its target, the layer. Edits go through gguf-py (the converter's own copy):
`rewrite` copies every field and tensor, changing, dropping or replacing what the fault says.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from exporters.llamacpp.gguf import arch_of
from exporters.llamacpp.setup import gguf_module
from models.args import SPARSE, mlp_type
from models.faults.fault import Fault


def rewrite(path: Path, fields: dict | None = None, drop: tuple = (), tensors=None) -> None:
    """The GGUF at `path` with `fields` (key -> new value, of the field's own type) set, the keys and
    tensors named in `drop` left out, and `tensors(arrays) -> {name: new array}` applied to the
    tensors (name -> array, numpy order), written over it."""
    gguf = gguf_module()
    fields = dict(fields or {})
    reader = gguf.GGUFReader(path)
    arch = arch_of(reader)
    full = {k.replace("{arch}", arch): v for k, v in fields.items()}
    dropped = {k.replace("{arch}", arch) for k in drop}
    missing = [k for k in [*full, *dropped] if k not in reader.fields and k not in {t.name for t in reader.tensors}]
    if missing:
        raise KeyError(f"the GGUF has no {', '.join(missing)}")
    arrays = {t.name: np.array(t.data) for t in reader.tensors}
    new = tensors(arrays, reader) if tensors else {}
    tmp = Path(path).with_suffix(".faulted")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name in dropped:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = full.get(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in dropped:
            continue
        data = new.get(t.name, arrays[t.name])
        writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type if data.dtype != np.float32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


def field(path: Path, key: str):
    gguf = gguf_module()
    reader = gguf.GGUFReader(path)
    f = reader.fields.get(key.replace("{arch}", arch_of(reader)))
    return None if f is None else f.contents()


def _sparse(a) -> bool:
    return any(mlp_type(a, i) == SPARSE for i in range(a.num_hidden_layers))


# ---------------------------------------------------------------- metadata faults (every layer)

def _rope_base(path, layer, a):
    base = field(path, "{arch}.rope.freq_base")
    rewrite(path, {"{arch}.rope.freq_base": 1e4 if abs(base - 1e4) > 1 else 1e6})


def _norm_flag(path, layer, a):
    """The flag flipped (KeyError where the converter writes none: the architecture's graph then has its
    own rule and never reads the key, measured: olmoe, qwen3moe, qwen2moe, llama, gpt-oss, granitemoe)."""
    rewrite(path, {"{arch}.expert_weights_norm": not bool(field(path, "{arch}.expert_weights_norm"))})


def _used_count(path, layer, a):
    k = int(field(path, "{arch}.expert_used_count"))
    rewrite(path, {"{arch}.expert_used_count": k - 1 if k > 1 else k + 1})


def _rms_eps(path, layer, a):
    rewrite(path, {"{arch}.attention.layer_norm_rms_epsilon": float(field(path, "{arch}.attention.layer_norm_rms_epsilon")) * 1e3})


def _drop(key):
    def fn(path, layer, a):
        rewrite(path, drop=(key,))
    return fn


# ---------------------------------------------------------------- tensor faults (one layer)

def _gate_up_swapped(path, layer, a):
    gate, up = f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight"
    rewrite(path, tensors=lambda t, r: {gate: t[up], up: t[gate]})


def _qk_permuted(path, layer, a):
    """q and k rows permuted as the converter's llama permute does (pairs (i, i + d/2) made adjacent):
    a GGUF whose rope layout is not the one its graph rotates."""
    heads = {"q": int(field(path, "{arch}.attention.head_count")), "k": int(field(path, "{arch}.attention.head_count_kv"))}

    def edit(t, r):
        out = {}
        for which, n in heads.items():
            name = f"blk.{layer}.attn_{which}.weight"
            w = t[name]  # [n * head_dim, hidden]
            out[name] = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return out

    rewrite(path, tensors=edit)


def _shared_gate_negated(path, layer, a):
    """Written with its sign flipped (a converter that writes the wrong slice or sign; dropping it makes
    llama.cpp refuse the file, which then catches the bug itself): the shared expert is gated by
    sigmoid(-x) = 1 - sigmoid(x). (Zeroed, it is NaN: llama.cpp's qwen2moe computes that sigmoid as
    silu(x) / x, 0 / 0 at x = 0: docs/llamacpp.md.)"""
    name = f"blk.{layer}.ffn_gate_inp_shexp.weight"
    rewrite(path, tensors=lambda t, r: {name: -t[name]})


def _bias_dropped(path, layer, a):
    rewrite(path, drop=tuple(f"blk.{layer}.attn_{w}.bias" for w in "qkv"))


CATALOGUE: tuple[Fault, ...] = (
    Fault("gguf_rope_freq_base_wrong", "attention", "first_rope", "rope.freq_base wrong (1e4 vs the checkpoint's)",
          _rope_base),
    Fault("gguf_expert_weights_norm_flipped", "router", "first_sparse", "expert_weights_norm flag flipped",
          _norm_flag, lambda a: _sparse(a) and a.num_experts_per_tok > 1 and a.router.scoring != "sparsemixer"),
    Fault("gguf_expert_used_count_wrong", "router", "first_sparse", "expert_used_count one off", _used_count, _sparse),
    Fault("gguf_rms_eps_wrong", "layer", "first", "attention.layer_norm_rms_epsilon 1000x", _rms_eps,
          # with q/k norms (or MLA's low-rank norms) the attention's own norms show it first
          lambda a: a.attention.qk_norm == "none" and a.attention.kind == "gqa"),
    Fault("gguf_expert_gate_up_swapped", "moe", "last_sparse", "every expert's gate and up tensors swapped in one layer",
          _gate_up_swapped, _sparse),
    Fault("gguf_qk_permuted", "attention", "rope", "q/k rows permuted (the rope pairing) in one layer", _qk_permuted,
          lambda a: a.attention.kind == "gqa"),
    Fault("gguf_shared_expert_gate_negated", "moe", "last_sparse", "the shared expert's gate tensor negated in one layer",
          _shared_gate_negated, lambda a: _sparse(a) and a.shared_expert_intermediate_size > 0 and a.shared_expert_gated),
    Fault("gguf_residual_scale_dropped", "layer", "first", "residual_scale key dropped (a residual multiplier)",
          _drop("{arch}.residual_scale"), lambda a: a.multipliers.residual != 1.0),
    Fault("gguf_expert_weights_scale_dropped", "router", "first_sparse", "expert_weights_scale key dropped",
          _drop("{arch}.expert_weights_scale"), lambda a: _sparse(a) and a.router.routed_scaling_factor != 1.0),
    Fault("gguf_attention_bias_dropped", "attention", "last", "q/k/v bias tensors dropped in one layer", _bias_dropped,
          lambda a: a.attention.qkv_bias),
)


def applicable(a) -> list[Fault]:
    return [f for f in CATALOGUE if f.is_applicable(a)]

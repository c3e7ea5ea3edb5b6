"""The config consistency rules a config.json is checked by before any work (Family.check_config):
the common ones, and the groups families add (grouped routers, dense first layers, Gated DeltaNet)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass



# ------------------------------------------------------------------ config consistency
# Checked before any work (Family.check_config), on HF's config object (its defaults filled in),
# naming the fields as config.json spells them ("a.b": key b of the dict a). A field that is absent
# or None (HF's "not used") passes every rule. A rule is (kind, *fields):
#   ("positive", f, ...)   each a number > 0          ("at_most", a, b)    a <= b
#                          (for these two, a list of numbers is judged by each of its entries)
#   ("at_least", f, n)     f >= the number n          ("divides", a, b)    b is a multiple of a
#   ("per_layer", f)       a list of num_hidden_layers entries
#   ("layer_index", f)     a list of layers, each in 0 .. num_hidden_layers - 1
#   ("within_depth", f)    0 <= f <= num_hidden_layers (-1: up to the last, as ERNIE's end index)
#   ("fraction", f)        0 < f <= 1                ("token_id", f)      0 <= f < vocab_size
COMMON_RULES = (
    ("positive", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
     "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters.rope_theta"),
    ("divides", "num_key_value_heads", "num_attention_heads"),  # grouped-query attention shares a KV head
    ("at_most", "num_attention_heads", "hidden_size"),  # a head at least one wide (where its width is derived)
    ("token_id", "pad_token_id"),  # the embedding's padding row
    ("per_layer", "layer_types"),
    ("fraction", "rope_parameters.partial_rotary_factor"),
)


# the group-limited routers (DeepSeek-V3's, GLM-4.5's, dots.llm1's): the kept groups among the groups,
# the experts split evenly into groups
GROUPED = (("positive", "n_group", "topk_group"), ("at_most", "topk_group", "n_group"),
           ("divides", "n_group", "n_routed_experts"))


FIRST_K_DENSE = (("positive", "moe_intermediate_size", "intermediate_size"), ("within_depth", "first_k_dense_replace"))


# Gated DeltaNet (Qwen3.5, Qwen3-Next): value heads grouped over key heads
GATED_DELTANET = (("positive", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_conv_kernel_dim"),
                  ("divides", "linear_num_key_heads", "linear_num_value_heads"))


_MISSING = object()


def field_value(c, name: str):
    """A config field by its config.json name ("rope_parameters.rope_theta": a key of a dict
    field); _MISSING where absent, None where HF leaves it unset."""
    head, _, rest = name.partition(".")
    try:
        v = getattr(c, head, _MISSING)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: a heterogeneous config's per-layer
        v = c._getattr_without_heterogeneous_validation(head, _MISSING)  # field (Gemma 4's head_dim): as stated
    if rest:
        v = v.get(rest, _MISSING) if isinstance(v, dict) else _MISSING
    return v


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _extreme(v, largest: bool):
    """A non-empty list of numbers as the entry a rule judges (its largest, else its smallest); any
    other value as it is."""
    if isinstance(v, (list, tuple)) and v and all(_number(x) for x in v):
        return max(v) if largest else min(v)
    return v


def broken_rule(c, rule: tuple, raw: bool = False) -> str | None:
    """What `c` (an HF config object) breaks of one rule (see COMMON_RULES), or None. `raw`: a
    value of another type passes (HF's class names the type it expects)."""
    kind, *names = rule
    if kind == "at_least":
        names, bound = names[:1], names[1]
    values = [field_value(c, n) for n in names]
    if kind in ("positive", "at_most"):  # a per-layer list of numbers (HunYuan's moe_topk): its every entry
        values = [_extreme(v, kind == "at_most" and j == 0) for j, v in enumerate(values)]
    if any(v is _MISSING or v is None for v in values) and kind != "positive":
        return None
    for n, v in zip(names, values):
        if v is _MISSING or v is None:
            continue
        if kind in ("per_layer", "layer_index"):
            if not isinstance(v, (list, tuple)):
                return None if raw else f"{n} must be a list, got {v!r:.60}"
            continue
        if not _number(v):
            return None if raw else f"{n} must be a finite number, got {v!r:.60}"
    depth = getattr(c, "num_hidden_layers", None)
    if kind == "positive":
        bad = next(((n, v) for n, v in zip(names, values) if v not in (_MISSING, None) and v <= 0), None)
        return bad and f"{bad[0]} must be positive, got {bad[1]!r}"
    a, b = (values + [None])[:2]
    if kind == "at_least" and a < bound:
        return f"{names[0]} ({a}) must be at least {bound}"
    if kind == "at_most" and a > b:
        return f"{names[0]} ({a}) must be at most {names[1]} ({b})"
    if kind == "divides" and (a <= 0 or b % a):
        return f"{names[1]} ({b}) must be a multiple of {names[0]} ({a})"
    if kind == "fraction" and not 0 < a <= 1:
        return f"{names[0]} ({a}) must be in (0, 1]"
    vocab = getattr(c, "vocab_size", None)
    if kind == "token_id" and _number(vocab) and not (a == int(a) and 0 <= a < vocab):
        return f"{names[0]} ({a}) must be a token id, in 0..{vocab - 1} (vocab_size {vocab})"
    if not _number(depth):
        return None  # num_hidden_layers' own rule says what is wrong with it
    if kind == "per_layer" and len(a) != depth:
        return f"{names[0]} has {len(a)} entries, num_hidden_layers is {depth}"
    if kind == "layer_index":
        bad = [i for i in a if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth)]
        if bad:
            return f"{names[0]} names layer {bad[0]!r}, outside 0..{depth - 1} (num_hidden_layers {depth})"
    if kind == "within_depth" and not (a == int(a) and -1 <= a <= depth):
        return f"{names[0]} ({a}) must be within 0..num_hidden_layers ({depth})"
    return None

"""Model families: one module per family, registered here.

A family module defines `FAMILY = Family(...)`: the HF classes of the reference, a tiny
config, the config mapping to `ModelArgs`, and `sanitize()` (HF checkpoint names and
layouts -> the production model's parameter names).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

from models.args import DENSE, MLA, SPARSE, AttentionArgs, ModelArgs, RopeArgs, RouterArgs, YaRN, stored_dtype
from models.checkpoint import CheckpointError

if TYPE_CHECKING:
    from models.layers import Transformer

# the families: every module of this package that defines `FAMILY = Family(...)` (a new family is
# its own file and nothing else): the core five first (Qwen3.5-MoE, the production target, then
# the families every backend and test path covers in depth), then the others by name
CORE = ("qwen3_5_moe", "qwen3_moe", "olmoe", "qwen2_moe", "mixtral")
_FILES = sorted(p.stem for p in Path(__file__).parent.glob("*.py") if "\nFAMILY = Family(" in p.read_text())
FAMILY_NAMES = tuple(n for n in CORE if n in _FILES) + tuple(n for n in _FILES if n not in CORE)

# Families transformers has but the harness cannot yet reproduce, and the missing feature.
UNSUPPORTED = {
    "jamba": "Mamba (selective state-space) layers",
    "granitemoehybrid": "Mamba2 layers",
    "granitemoeshared": "Granite's shared MLP beside the experts (shared_intermediate_size)",
    "granitemoe_swa": "Granite's sliding-window layers",
    "minimax": "lightning (linear) attention layers",
    "dbrx": "DBRX's fused Wqkv with clip_qkv and its per-expert weight layout",
    "jetmoe": "mixture-of-attention-heads (routed attention experts)",
    "deepseek_v32": "DeepSeek sparse attention (the lightning indexer)",
    "longcat_flash": "zero-computation experts and shortcut-connected MoE",
}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values this family reads
    hf_module: str  # transformers.models.<hf_module>
    hf_class_name: str  # the CausalLM class used as reference
    hf_config_name: str
    tiny_config: dict
    to_args: Callable  # HF config object -> ModelArgs
    sanitize: Callable  # (weights, ModelArgs) -> production state dict
    # where the reference's blocks live inside an HF decoder layer (first that exists)
    hf_attention: tuple[str, ...] = ("self_attn", "linear_attn")
    hf_moe: str = "mlp"
    hf_router: str = "mlp.gate"
    hf_mlp: str = "mlp"  # a dense layer's MLP
    # (mlx-lm checkpoint tensors of one layer, config.json) -> the HF checkpoint's names and layouts
    # (how a shipped mlx-lm directory's dequantized weights become an HF reference)
    from_mlx: Callable = None
    # how mlx-lm's model of the family reads the checkpoint (models.mlx_lm.MlxLm; None: no mlx-lm model)
    mlx: object = None
    # tiny checkpoints: the std of the tensors whose names end so, where TINY_STD would hide a
    # mechanism (gpt-oss's SwiGLU clamp at 7 is never reached by weights of std 0.1)
    tiny_std: dict = None
    # an HF router's output -> (logits [N, E], top-k weights [N, k], indices [N, k]) given the
    # ModelArgs (None: it returns that triple, as transformers 5's TopKRouters do)
    router_output: Callable = None
    # the inverse: (the HF router's output, top-k weights [N, k], indices [N, k], ModelArgs) -> its output
    # with that selection, what its MoE block then computes (oracle/replay.py forces a selection); None:
    # the triple's weights and indices replaced
    router_input: Callable = None
    # config consistency (check_config): the config.json names of the routed-expert count and of
    # top-k, and the family's own rules beside COMMON_RULES (see there)
    experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    rules: tuple = ()
    # how HF's fused experts.gate_up_proj holds gate and up (its forward splits them, the module does
    # not say how): "rows" [E, 2I, H] gate rows then up (transformers 5's chunk(2)), "columns"
    # [E, H, 2I] gate columns then up, "interleaved" [E, H, 2I] gate in the even columns, up in the odd
    hf_gate_up: str = "rows"

    def __post_init__(self):
        if self.from_mlx is None:
            from models.quantized import unstack_experts

            object.__setattr__(self, "from_mlx", lambda weights, config: unstack_experts(weights))

    def hf_path(self, kind: str) -> tuple[str, ...]:
        """The paths (first that exists) of a block inside HF's decoder layer: the one
        (layer, kind) -> HF module map (oracle.reference.block_modules) reads it."""
        return {"attention": self.hf_attention, "router": (self.hf_router,), "moe": (self.hf_moe,),
                "mlp": (self.hf_mlp,)}[kind]

    def hf_class(self):
        return getattr(importlib.import_module(f"transformers.models.{self.hf_module}"), self.hf_class_name)

    def hf_config(self, cfg: dict):
        """HF's config object of a config.json dict; a value of the wrong type (HF's configs are
        strict dataclasses) or one HF refuses is a CheckpointError naming the field."""
        cls = getattr(importlib.import_module(f"transformers.models.{self.hf_module}"), self.hf_config_name)
        cfg = {k: v for k, v in text_config(cfg).items() if k not in ("architectures", "transformers_version")}
        try:
            return cls(**cfg)
        except Exception as e:  # huggingface_hub's StrictDataclassFieldValidationError, HF's own ValueErrors
            raise CheckpointError(hf_config_problem(e)) from None

    def check_config(self, c, raw: bool = False) -> None:
        """CheckpointError naming the config.json field(s) of the first rule `c` (HF's config object;
        `raw`: the file's values, whose types HF's class checks after) breaks: COMMON_RULES, the
        experts' rules and the family's own (`rules`)."""
        experts = (("positive", self.experts, self.top_k), ("at_most", self.top_k, self.experts))
        for rule in COMMON_RULES + experts + self.rules:
            problem = broken_rule(c, rule, raw)
            if problem:
                raise CheckpointError(problem)

    def args(self, cfg: dict, max_seq_len: int = 256) -> ModelArgs:
        """ModelArgs from a config.json dict, resolved through HF's own config class so that
        defaults are exactly the reference's; the config checked for consistency first. Bad
        input never escapes as another exception: to_args' arithmetic on a value no rule
        foresaw is a CheckpointError too."""
        # the rules on the file's own values first (a message about what the user wrote, not about
        # what HF derived from it: Llama 4's layer_types from no_rope_layers), then on HF's resolution
        # (its defaults filled in)
        self.check_config(SimpleNamespace(**text_config(cfg)), raw=True)
        c = self.hf_config(cfg)
        self.check_config(c)
        try:
            args = self.to_args(c)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as e:
            raise CheckpointError(f"the config does not resolve to a {self.name} model "
                                  f"({type(e).__name__}: {one_line(e)})") from None
        return ModelArgs(**{**args.__dict__, "max_seq_len": max_seq_len})

    def validate(self, cfg: dict, weights: dict, max_seq_len: int = 256, where: str = "config.json") -> ModelArgs:
        """Resolve the config (its problems named after `where`, the config file) and check the
        checkpoint's tensors against the production model's (names and shapes) without
        allocating it."""
        import torch

        from models.checkpoint import LAYER, validate_state
        from models.layers import Transformer

        try:
            # before anything per layer is made (a depth of 10**9: a 10**9-entry layer_types, then a model
            # that would take forever even on the meta device)
            depth = 1 + max((int(m.group(1)) for k in weights if (m := LAYER.search(k))), default=-1)
            text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
            stated = text.get("num_hidden_layers")
            if isinstance(stated, int) and not isinstance(stated, bool) and stated > depth:
                raise CheckpointError(f"num_hidden_layers {stated}: the checkpoint has tensors of {depth} layer(s)")
            args = self.args(cfg, max_seq_len)
            if args.num_hidden_layers > depth:
                raise CheckpointError(f"num_hidden_layers {args.num_hidden_layers}: the checkpoint has tensors of "
                                      f"{depth} layer(s)")
            try:
                with torch.device("meta"):
                    model = Transformer(args)
            except (RuntimeError, ValueError, OverflowError, TypeError, ZeroDivisionError) as e:  # sizes past int64
                raise CheckpointError(f"a model torch cannot build ({type(e).__name__}: {one_line(e)})") from None
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        try:
            state = self.sanitize(weights, args)
        except CheckpointError:
            raise
        except (KeyError, RuntimeError, ValueError, IndexError) as e:  # a layout the family's sanitize() cannot read
            raise CheckpointError(f"the checkpoint's tensors are not a {self.name} layout "
                                  f"({type(e).__name__}: {one_line(e)})") from None
        validate_state(model, state)
        return args

    def build(self, cfg: dict, weights: dict, dtype=None, max_seq_len: int = 256) -> Transformer:
        """The production model with the checkpoint's weights (strict name/shape check), in
        `dtype` (default fp32)."""
        import torch

        from models.checkpoint import load_state
        from models.layers import Transformer

        dtype = dtype or torch.float32
        args = self.args(cfg, max_seq_len)
        model = Transformer(args, dtype)
        load_state(model, self.sanitize(weights, args), dtype)
        return model.eval()

    def build_from(self, cfg: dict, model_dir, dtype=None, max_seq_len: int = 256,
                   args: ModelArgs | None = None, mapped: Path | None = None) -> Transformer:
        """The production model from a checkpoint directory, one decoder layer at a time: the
        parameters start on the meta device (accelerate's init_empty_weights; buffers are real),
        each layer's tensors are read from the safetensors files, sanitized, converted to
        `dtype` and assigned, then dropped. Peak memory: the model in `dtype` plus one layer.
        `mapped` (a directory): each layer's converted tensors are written there instead
        (safetensors, one file per layer) and the parameters are views of those files' memory
        maps (copy-on-write): the model's weights are file pages the kernel can drop and read
        again, not process memory: for a build that reads every weight once (an ExecuTorch
        lowering). The directory must outlive the model.
        The names, shapes and dtypes were checked from the headers by `validate` (how a
        ModelSource is made); a parameter left unfilled is still an error here."""
        import torch
        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device

        from models.layers import Transformer

        dtype = dtype or torch.float32
        args = args or self.args(cfg, max_seq_len)  # the ModelSource's, already resolved
        with init_empty_weights(include_buffers=False):
            model = Transformer(args, dtype)
        for i, group in enumerate(self.production_tensors(model_dir, args, dtype)):
            if mapped is not None:
                group = map_group(group, Path(mapped) / f"layer-group-{i:05d}.safetensors")
            for name, value in group.items():  # in `dtype`, or fp32 where kept (production_tensors)
                set_module_tensor_to_device(model, name, "cpu", value=value, dtype=value.dtype)
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(f"missing tensor(s): {', '.join(missing[:6])}")
        return model.eval()

    def production_tensors(self, model_dir, args: ModelArgs, dtype=None):
        """The production model's parameters (its state-dict names) in `dtype`, one decoder
        layer at a time (then the embedding, final norm and head): each group read from the
        shards' memory maps, sanitized and converted, in fresh memory. What build_from assigns,
        and what a backend that keeps its weights outside the model (an IREE parameter archive)
        writes group by group without ever holding the whole model. Below fp32, the parameters
        HF keeps in fp32 (models.args.kept_fp32) are fp32."""
        import torch

        from models.checkpoint import layer_groups, read_tensors, tensor_index

        dtype = dtype or torch.float32
        index = tensor_index(model_dir)
        for names in layer_groups(index):
            yield self.production_group(read_tensors(index, names), args, dtype)

    def production_group(self, tensors: dict, args: ModelArgs, dtype) -> dict:
        """One group of checkpoint tensors (a decoder layer's, or those outside the layers) as the
        production model's parameters: sanitized and converted to `dtype` (fp32 where kept), in fresh
        memory either way (a tensor read from a shard can sit at an alignment that makes BLAS round
        differently from run to run of the same weights)."""
        group = self.sanitize(tensors, args)
        return {name: t.to(d) if t.dtype != (d := stored_dtype(args, name, dtype)) else t.clone()
                for name, t in group.items()}


# ------------------------------------------------------------------ config consistency
# Checked before any work (Family.check_config), on HF's config object (its defaults filled in),
# naming the fields as config.json spells them ("a.b": key b of the dict a). A field that is absent
# or None (HF's "not used") passes every rule. A rule is (kind, *fields):
#   ("positive", f, ...)   each a number > 0          ("at_most", a, b)    a <= b
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
    v = getattr(c, head, _MISSING)
    if rest:
        v = v.get(rest, _MISSING) if isinstance(v, dict) else _MISSING
    return v


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def broken_rule(c, rule: tuple, raw: bool = False) -> str | None:
    """What `c` (an HF config object) breaks of one rule (see COMMON_RULES), or None. `raw`: a
    value of another type passes (HF's class names the type it expects)."""
    kind, *names = rule
    if kind == "at_least":
        names, bound = names[:1], names[1]
    values = [field_value(c, n) for n in names]
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


def one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def hf_config_problem(e: Exception) -> str:
    """HF's refusal of a config.json as one line naming the field: a strict dataclass's
    "Validation error for field 'f': TypeError: Field 'f' expected int, got str (value: '64')"
    becomes "f: expected int, got str (value: '64')"."""
    text = one_line(e)
    m = re.search(r"Field '([^']+)' (.*)$", text) or re.search(r"field '([^']+)':\s*(?:\w+: )?(.*)$", text)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    m = re.search(r"validation error for validator '[^']+':\s*(?:\w+: )?(.*)$", text)  # HF's own rules
    return m.group(1) if m else f"HF's config class refuses it ({type(e).__name__}: {text})"


def map_group(tensors: dict, path: Path) -> dict:
    """`tensors` written to `path` (safetensors) and given back as views of its memory map
    (safetensors' own reader: no copy; written to, a page is copied, the file stays as it is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    tensors.clear()
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of the models package's source: what a cached result derived from a family's
    code (resolved ModelArgs, a validation) is keyed by."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def text_config(cfg: dict) -> dict:
    """The language model's config: a composite (multimodal) release's `text_config`, with the
    top-level keys it leaves out (e.g. tie_word_embeddings); any other config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    inherited = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg and k not in text}
    return {**text, **inherited}


def get_family(name: str) -> Family:
    if name in FAMILY_NAMES:
        return importlib.import_module(f"models.{name}").FAMILY
    raise KeyError(name)


def family_for_model_type(model_type: str) -> str | None:
    for name in FAMILY_NAMES:
        if model_type in get_family(name).model_types:
            return name
    return None


def rope_theta(config) -> float:
    """rope_theta of a config with default RoPE (a family that implements YaRN: rope_theta_any)."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"rope_type {rope_type!r} is not supported yet (only 'default' RoPE)")
    return rope_theta_any(config)


def rope_theta_any(config) -> float:
    """rope_theta of a config with default or YaRN RoPE (`yarn` reads the rest)."""
    rp = getattr(config, "rope_parameters", None) or {}
    yarn(config)  # refuses other rope types
    if "rope_theta" not in rp:
        raise CheckpointError("config has no rope_parameters.rope_theta")
    return float(rp["rope_theta"])


def yarn(config) -> YaRN | None:
    """The YaRN scaling of a config whose rope_parameters have rope_type "yarn", as HF 5.23's
    _compute_yarn_parameters reads them (factor defaults to max_position_embeddings /
    original_max_position_embeddings, beta_fast 32, beta_slow 1, truncate True); None for default RoPE.
    mscale is recorded as HF uses it: only with mscale_all_dim and no attention_factor (else 0: a
    config's mscale that HF never reads, e.g. mlx-lm's own 1 beside mscale_all_dim 0, is no difference)."""
    rp = getattr(config, "rope_parameters", None) or {}
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "yarn":
        raise CheckpointError(f"rope_type {kind!r} is not supported yet (only 'default' and 'yarn' RoPE)")
    if "original_max_position_embeddings" not in rp:
        raise CheckpointError("yarn rope_parameters without original_max_position_embeddings")
    omp = int(rp["original_max_position_embeddings"])
    factor = float(rp.get("factor") or config.max_position_embeddings / omp)
    af = rp.get("attention_factor")
    mscale, mscale_all_dim = float(rp.get("mscale") or 0), float(rp.get("mscale_all_dim") or 0)
    return YaRN(factor, omp, beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
                mscale=mscale if af is None and mscale_all_dim else 0.0, mscale_all_dim=mscale_all_dim,
                truncate=bool(rp.get("truncate", True)), attention_factor=None if af is None else float(af))


def rope_of(config, **how) -> RopeArgs:
    """The RopeArgs of a config with default or YaRN RoPE; `how` sets the rest (interleave, ...)."""
    return RopeArgs.scaled(rope_theta_any(config), yarn(config), **how)


def hf_args(c, family: str, **specific) -> ModelArgs:
    """ModelArgs with the fields every family reads the same way from an HF config object;
    `specific` sets (or overrides) the rest."""
    common = dict(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, num_experts_per_tok=c.num_experts_per_tok,
        layer_types=("full_attention",) * c.num_hidden_layers, tie_word_embeddings=c.tie_word_embeddings,
    )
    if "rope" not in specific:  # (a family with scaled RoPE passes its own: rope_of)
        common["rope"] = RopeArgs(rope_theta(c))
    return ModelArgs(**{**common, **specific})


def sanitize_hf(weights: dict, args: ModelArgs) -> dict:
    """The common checkpoint mapping: strip `model.`, stack per-expert tensors, tie embeddings."""
    from models.checkpoint import stack_hf_experts

    return tie_embeddings(stack_hf_experts(strip_prefix(weights)), args)


def strip_prefix(weights: dict, prefix: str = "model.") -> dict:
    """Checkpoint keys without the HF base-model prefix."""
    return {k[len(prefix):] if k.startswith(prefix) else k: t for k, t in weights.items()}


def tie_embeddings(weights: dict, args: ModelArgs) -> dict:
    if args.tie_word_embeddings and "lm_head.weight" not in weights and "embed_tokens.weight" in weights:
        weights = {**weights, "lm_head.weight": weights["embed_tokens.weight"]}
    return weights


def first_k_dense(c) -> dict:
    """The ModelArgs of a DeepSeek-style layer stack: the first `first_k_dense_replace` layers
    have a dense MLP (intermediate_size), the rest experts plus `n_shared_experts` always-on
    shared experts (no gate). Its router: deepseek_router."""
    first = c.first_k_dense_replace or 0
    return dict(mlp_types=tuple(DENSE if i < first else SPARSE for i in range(c.num_hidden_layers)),
                intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                moe_intermediate_size=c.moe_intermediate_size,
                shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                shared_expert_gated=False)


def deepseek_router(c, **how) -> RouterArgs:
    """The router of a DeepSeek-style layer stack: fp32 logits and weights, routed_scaling_factor;
    `how` sets the rest (sigmoid_routing)."""
    return RouterArgs(routed_scaling_factor=float(c.routed_scaling_factor), fp32=True, weights_in_model_dtype=False,
                      **how)


def sigmoid_routing(c) -> dict:
    """DeepSeek-V3's routing (also GLM-4.5's and dots.llm1's): sigmoid scores, the correction
    bias for the choice, the topk_group best of n_group groups (by the sum of their best two)."""
    return dict(scoring="sigmoid", correction_bias=True, n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                group_score="top2", norm_topk_prob=bool(c.norm_topk_prob),
                fp32_params=("e_score_correction_bias",))  # HF: _keep_in_fp32_modules_strict


def mla(c) -> AttentionArgs:
    """DeepSeek's multi-head latent attention (its RoPE: rope_of)."""
    return AttentionArgs("mla", MLA(kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                                    q_lora_rank=c.q_lora_rank or 0),
                         qkv_bias=c.attention_bias, o_bias=c.attention_bias)


def drop_layers_from(weights: dict, n: int) -> dict:
    """Without the tensors of layers n and beyond (DeepSeek-V3 / GLM-4.5 checkpoints carry their
    multi-token-prediction layers as model.layers.{num_hidden_layers}...: not the model checked)."""
    from models.checkpoint import LAYER

    return {k: t for k, t in weights.items() if not ((m := LAYER.search(k)) and int(m.group(1)) >= n)}


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckpointError(message)


__all__ = ["Family", "FAMILY_NAMES", "UNSUPPORTED", "get_family", "family_for_model_type", "ModelArgs"]

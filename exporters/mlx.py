"""`mlx`: the family's mlx-lm model, built from the same HF checkpoint as the reference.

mlx-lm's own modules, `sanitize()`, caches and quantizer; nothing re-implemented but the
config conversion (below) and the checkpoint's expert layout. mlx runs on the CPU on
Linux (`mlx[cpu]`) and on the Metal GPU on Apple silicon (`--device cpu|gpu`, default gpu
where there is one). mlx and mlx-lm are imported lazily: without them the backend is
`unavailable` with the import error as the reason.

Precisions: fp32, bf16, and q8 / q4: mlx-lm's affine quantizer (`mlx_lm.utils.quantize_model`
with the model's own quant_predicate, as `mlx_lm.convert -q` does it) applied to the fp32
model, `--group-size 32|64` (default 64, mlx-lm's default). mlx-lm leaves a layer whose input
dim is not divisible by the group size unquantized without a word: `info["quantization"]`
lists every weight-carrying module as quantized (bits, group size) or not (and why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import platform
import re
import sys
from pathlib import Path

import numpy as np

from models import drop_layers_from, get_family
from models.args import CHUNKED, SLIDING
from models.checkpoint import CheckpointError, shard_files
from models.mlx_lm import ConfigError  # noqa: F401  (the backend's refusal; tests import it from here)
from exporters.mlx_model import attention_block, moe_block, route, text_model  # noqa: F401 (route: tests read the mirrors here)
from oracle.backend import Backend, Candidate, Option
from oracle.result import GateRow

# bf16 only where a GPU can be: mlx's CPU gather_mm (the experts) is float32-only (0.32.4)
PRECISIONS = ("fp32", "bf16", "q8", "q4") if sys.platform == "darwin" else ("fp32", "q8", "q4")
QUANT_BITS = {"q8": 8, "q4": 4}
GROUP_SIZES = (32, 64)
DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default; real MoE dims are multiples of 64


def mapping(family: str):
    """The family's mlx-lm mapping (models.mlx_lm.MlxLm, declared in its models/ file)."""
    m = get_family(family).mlx
    if m is None:
        raise ConfigError(f"{family}: no mlx-lm model is mapped for this family")
    return m


def check_args(temperature: float, top_p: float) -> None:
    """The sampling head's argument check (models.sampling, which imports torch: only with --sampling)."""
    from models import sampling

    sampling.check_args(temperature, top_p)


def mlx_lm_models() -> None:
    """Make `mlx_lm.models.*` importable without running `mlx_lm/__init__.py`, which imports
    mlx_lm's generate/convert/utils and through them transformers (0.6 s, most of a warm mlx
    check; the model files need only mlx). The package module is registered bare, and runs its
    real `__init__` the first time anything else is asked of it (`mlx_lm.load`, ...); submodules
    (`mlx_lm.utils`, `mlx_lm.convert`) import as usual."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the import that follows says so
    pkg = importlib.util.module_from_spec(spec)

    def complete(name):  # the rest of the package: its __init__, run once in this module
        del pkg.__getattr__
        spec.loader.exec_module(pkg)
        return getattr(pkg, name)

    pkg.__getattr__ = complete
    sys.modules["mlx_lm"] = pkg


def mlx_args_class(family: str):
    """The dataclass whose fields the family's mlx mapping must cover."""
    m = mapping(family)
    module, cls = m.args_class or (m.module, "ModelArgs")
    return getattr(mlx_module(module), cls)


def mlx_module(name: str):
    """mlx_lm.models.<name> (without mlx_lm's package imports: mlx_lm_models)."""
    mlx_lm_models()
    return importlib.import_module(f"mlx_lm.models.{name}")


def mlx_config(family: str, config: dict) -> dict:
    """config.json -> the explicit field values of the family's mlx-lm ModelArgs."""
    c = get_family(family).hf_config(config)
    m = mapping(family)
    for ok, what in m.require:
        if not ok(c):
            raise ConfigError(f"{family}: the checkpoint's config has {what}")
    table = m.config
    fields = {f.name for f in dataclasses.fields(mlx_args_class(family))}
    if set(table) != fields:  # a new mlx-lm field would otherwise take its default silently
        raise ConfigError(f"{family}: mlx-lm's ModelArgs fields differ from the conversion table: "
                          f"unmapped {sorted(fields - set(table))}, unknown {sorted(set(table) - fields)}")
    return {k: getattr(c, src) if isinstance(src, str) else src(c) for k, src in table.items()}


def cached_mlx_config(family: str, config: dict) -> dict:
    """mlx_config from the cache when this config.json was converted by this code before (a warm
    check then imports no transformers config class)."""
    from models import code_digest
    from oracle.artifacts import cached_json, versions

    parts = {"family": family, "config": config, "code": code_digest(), "exporter": _source_digest(),
             **versions("mlx-lm", "transformers")}
    return cached_json("mlx-config", parts, lambda: mlx_config(family, config))


@functools.cache
def _source_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def naive_mlx_config(family: str, config: dict) -> dict:
    """What mlx_lm.utils.load_model does: config.json straight into ModelArgs.from_dict, so
    every key it does not find takes mlx-lm's default. Only for showing the traps."""
    module = mapping(family).module
    cls = mlx_module(module).ModelArgs
    return dataclasses.asdict(cls.from_dict({**config, "model_type": module}))


def build_model(family: str, fields: dict):
    """The mlx-lm Model for the converted fields; checks mlx-lm kept every value."""
    m = mapping(family)
    mod = mlx_module(m.module)
    if m.composite:
        args = fields if "text_config" in fields else {"model_type": m.module, "text_config": fields}
        model = mod.Model(mod.ModelArgs(**args))
        got, want = model.language_model.args, args["text_config"]
    else:
        model = mod.Model(mod.ModelArgs(**fields))
        got, want = model.args, fields
    changed = {k: (v, getattr(got, k)) for k, v in want.items() if getattr(got, k) != v}
    if changed:
        raise ConfigError(f"{family}: mlx-lm changed config values while building the model: {changed}")
    return model


# ---------------------------------------------------------------- weights
EXPERT_KEY = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
FUSED_KEY = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def expert_layout(family: str, weights: dict) -> dict:
    """The checkpoint's expert tensors (per-expert as save_pretrained writes them, or fused
    experts.gate_up_proj [E, 2I, H] + down_proj [E, H, I]) in the layout the family's mlx-lm
    sanitize() stacks (its mapping's `experts`: fused, or per-expert under its `expert_names`,
    in its `moe` block: Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2), every tensor passed
    through the mapping's `check_tensor`."""
    import mlx.core as mx

    m = mapping(family)
    out, experts = {}, {}
    for k, v in weights.items():
        if km := EXPERT_KEY.fullmatch(k):
            experts.setdefault(km[1], {}).setdefault(int(km[2]), {})[ROLE[km[3]]] = v
        elif km := FUSED_KEY.fullmatch(k):
            ex = experts.setdefault(km[1], {})
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                parts = {"gate": v[e, :half], "up": v[e, half:]} if km[2] == "gate_up_proj" else {"down": v[e]}
                ex.setdefault(e, {}).update(parts)
        else:
            out[k] = v
    for prefix, ex in experts.items():
        for e in range(len(ex)):
            if set(ex.get(e, {})) != {"gate", "up", "down"}:
                raise CheckpointError(f"{prefix}: expert {e} lacks gate/up/down tensors (experts 0..{len(ex) - 1})")
        if m.experts == "fused":
            gate_up, down = m.fused_names
            out[f"{prefix}.{m.moe}.{gate_up}"] = mx.stack(
                [mx.concatenate([ex[e]["gate"], ex[e]["up"]]) for e in range(len(ex))])
            out[f"{prefix}.{m.moe}.{down}"] = mx.stack([ex[e]["down"] for e in range(len(ex))])
            continue
        for e in range(len(ex)):
            for role, name in m.expert_names.items():
                out[f"{prefix}.{m.moe}.experts.{e}.{name}.weight"] = ex[e][role]
    if m.moe != "mlp":  # transformers' in-memory name for the MoE block is mlp
        out = {k.replace(".mlp.", f".{m.moe}."): v for k, v in out.items()}
    for k, v in out.items():
        problem = (m.check_tensor(k, v.shape) if m.check_tensor else None) or (
            m.check_value(k, v) if m.check_value else None)
        if problem:
            raise ConfigError(problem)
    return out


def load_model(src, config_fn=mlx_config):
    """(mlx-lm model with the checkpoint's weights through its sanitize(), converted fields)."""
    import mlx.core as mx

    family = src.family.name
    fields = cached_mlx_config(family, src.config) if config_fn is mlx_config else config_fn(family, src.config)
    model = build_model(family, fields)
    weights = {}
    for shard in shard_files(src.model_dir):
        weights.update(mx.load(str(shard)))
    weights = drop_layers_from(weights, src.args.num_hidden_layers)
    m = mapping(family)
    weights = model.sanitize(m.convert(weights) if m.convert else expert_layout(family, weights))
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model, fields


def cast(model, dtype) -> None:
    """Floating parameters to `dtype`, except what the model's cast_predicate keeps (as mlx_lm.convert)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))


def quantize(model, bits: int, group_size: int) -> dict:
    """mlx-lm's quantizer as mlx_lm.convert runs it; returns what was and was not quantized."""
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
        quantize_model(model, {}, group_size, bits, mode="affine")
    return {"bits": bits, "group_size": group_size, "mode": "affine", **quantization_table(model, group_size)}


def quantization_table(model, group_size: int) -> dict:
    """Every weight-carrying module of an mlx model: quantized (bits, group size) or not (why)."""
    done, skipped = {}, {}
    for path, m in sorted(model.named_modules()):
        w = m.get("weight") if isinstance(m, dict) else None
        if w is None or w.ndim < 2 or m.children():
            continue
        if "scales" in m:
            done[path] = {"bits": m.bits, "group_size": m.group_size}
        elif not hasattr(m, "to_quantized"):
            skipped[path] = f"{type(m).__name__}: mlx has no quantized form"
        elif w.shape[-1] % group_size:
            skipped[path] = f"input dim {w.shape[-1]} not divisible by group size {group_size}"
        else:
            skipped[path] = "left out by the model's quant_predicate"
    return {"quantized": done, "not_quantized": skipped}


# ---------------------------------------------------------------- shipped directories
# the value mlx-lm's models use for a ModelArgs field left None (read off their __init__)
DERIVED = {"head_dim": lambda a: a.hidden_size // a.num_attention_heads}
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")  # mlx_lm.convert --quant-predicate


def loadable_config(family: str, config: dict, fields: dict) -> dict:
    """config.json of an mlx-lm directory that mlx-lm's own loader (config.json straight into
    ModelArgs.from_dict) reads as the model `fields` describe: the HF config, plus every field
    mlx-lm would otherwise miss or take from its defaults (rope_theta inside rope_parameters,
    num_experts from num_local_experts, ...). Qwen3.5: the composite form mlx-lm reads.

    `rope_scaling` is read by both: transformers 5 takes a config's legacy `rope_scaling` for its
    whole `rope_parameters` (rope_theta and every key mlx-lm's form lacks would fall back to HF's
    defaults: PhiMoE's rope_theta 1e6 for the original's 1e4). So it is written as the original's
    rope_parameters with mlx-lm's keys over them (write_directory checks that HF still reads the
    original's architecture; mlx-lm reads no key beyond its own)."""
    cls = mlx_args_class(family)
    text = dict(config.get("text_config") or config)
    required = {f.name: fields[f.name] for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in text}
    naive = dataclasses.asdict(cls.from_dict({**text, **required}))
    extra = {k: v for k, v in fields.items() if k != "model_type" and (k in required or naive.get(k) != v)}
    if isinstance(extra.get("rope_scaling"), dict):
        original = text.get("rope_parameters") or text.get("rope_scaling") or {}
        extra["rope_scaling"] = {**original, **extra["rope_scaling"]}
    m = mapping(family)
    if not m.composite:
        return {**config, **extra}
    top = {k: v for k, v in config.items() if k not in ("text_config", "model_type")}
    return {**top, "model_type": m.module, "text_config": {**text, **extra}}


def hf_reading_differs(src, config: dict) -> str | None:
    """Where transformers (through the family's args()) reads the directory's config.json as
    another architecture than the original's (None: the same). The fields mlx-lm needs share
    their names with HF's legacy ones (rope_scaling): the directory must mean the original to both."""
    from oracle.sources import first_difference

    return first_difference(src.args, src.family.args(config, src.args.max_seq_len))


def write_directory(src, out, bits: int | None, group_size: int, recipe: str | None = None) -> list:
    """An mlx-lm directory of the checkpoint as mlx_lm.convert writes one: mlx-lm's model,
    quantizer (`recipe`: one of mlx_lm.convert's mixed recipes) and writers (save_model,
    save_config), the weights at the checkpoint's own dtype; the config that mlx-lm's loader
    reads as this model (loadable_config). bits None: unquantized."""
    import mlx.core as mx
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, fields = load_model(src)
    config = loadable_config(src.family.name, src.config, fields)
    differs = hf_reading_differs(src, config)
    if differs:
        raise ConfigError(f"{src.family.name}: the config.json mlx-lm needs would mean another model to "
                          f"transformers ({differs}): not written")
    if bits is not None or recipe:
        pred = mixed_quant_predicate_builder(recipe, model, group_size) if recipe else None
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits or 4, mode="affine", quant_predicate=pred)
    mx.eval(model.parameters())
    out = Path(out)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    return sorted(p for p in out.iterdir() if p.suffix in (".json", ".safetensors"))


def reference_directory(original, progress) -> Path:
    """The original as mlx-lm writes it unquantized (write_directory: its sanitize() and writers, the
    weights at the original's own dtype), cached by the checkpoint's identity, this code and the tool
    versions: what a shipped directory's weight check compares it with (exporters/mlx_weights.py)."""
    import inspect

    from oracle.artifacts import cached_artifact, sha256_file, versions

    parts = {"checkpoint": original.checkpoint_sha256, "code": sha256_file(Path(inspect.getsourcefile(load_model))),
             **versions("mlx", "mlx-lm")}
    progress("the original through mlx-lm's own conversion, unquantized (to compare the directory with)")
    art = cached_artifact("mlx-reference", parts, "config.json",
                          lambda path: write_directory(original, path.parent, None, DEFAULT_GROUP_SIZE),
                          name=f"{original.family.name}.reference")
    return Path(art.path).parent


def load_directory(path, family: str, dtype, reference_config: dict):
    """(mlx-lm model, info) of a shipped directory, loaded as mlx-lm loads it (mlx_lm.utils.load_model:
    its config.json, quantization and weights), floating arrays (scales and biases included: an
    exact upcast) at the activation dtype. info["config"]: the ModelArgs fields the HF reference's
    config means (mlx_config); info["config_mismatch"]: those mlx-lm read differently."""
    from mlx_lm.utils import load_model as mlx_load

    model, config = mlx_load(Path(path), lazy=True)
    cast(model, dtype)
    want = mlx_config(family, reference_config)
    got = text_model(model).args
    mismatch = {}
    for k, v in want.items():
        have = getattr(got, k, v)
        if have is None and k in DERIVED:  # mlx-lm derives it when absent
            have = DERIVED[k](got)
        if isinstance(v, dict) and isinstance(have, dict):  # rope_scaling: mlx-lm reads the mapping's keys
            have = {key: have.get(key) for key in v}  # (loadable_config writes HF's beside them)
        if k != "model_type" and have != v:
            mismatch[k] = {"mlx_lm": have, "reference": v}
    q = config.get("quantization") or {}
    table = quantization_table(model, q.get("group_size", 0)) if q else {}
    return model, {"quantization": {"bits": q.get("bits"), "group_size": q.get("group_size"),
                                    "mode": q.get("mode", "affine"), **table} if q else None,
                   "config": want, "config_mismatch": mismatch}


# ---------------------------------------------------------------- running
@contextlib.contextmanager
def mlx_points(block, rec, mx):
    """Each submodule of an mlx-lm block records what it returns while the block runs: its class
    swapped for a subclass whose __call__ records (mlx modules take no hooks), swapped back after."""
    from exporters.mlx_model import router_linear

    def array(a):
        return np.array(a.astype(mx.float32)) if isinstance(a, mx.array) else None

    rope_calls = [0]
    logits_of = None
    for moe in (block, *[m for _, m in block.named_modules() if m is not block]):
        try:
            logits_of = router_linear(moe)
            break
        except (KeyError, StopIteration, TypeError, AttributeError):
            continue
    if logits_of is not None and hasattr(logits_of, "top_k") and rec.points.taps is not None:
        rec.points.taps.discard("logits")  # a gate that routes by itself (DeepSeek's MoEGate): no logits out
    swapped, patched = [], []
    for _, m in block.named_modules():  # the Gated DeltaNet recurrence: mlx-lm's gated_delta_update
        mod = sys.modules.get(type(m).__module__)
        fn = getattr(mod, "gated_delta_update", None)
        if fn is not None and not any(p[0] is mod for p in patched):
            def recurrence(*a, _fn=fn, **kw):
                out = _fn(*a, **kw)
                rec.add("recurrence", array(out[0]))
                return out
            patched.append((mod, fn))
            mod.gated_delta_update = recurrence
    for path, m in block.named_modules():
        if not path or not callable(m):
            continue
        leaf = path.rsplit(".", 1)[-1]

        def call(self, *a, _cls=type(m), _path=path, _leaf=leaf, _m=m, **kw):
            out = _cls.__call__(self, *a, **kw)
            if _leaf in ("o_proj", "out_proj") and a:
                rec.add("context", array(a[0]))
            if _leaf == "rope":  # q first, then k
                rec.add("q_rope" if rope_calls[0] % 2 == 0 else "k_rope", array(out))
                rope_calls[0] += 1
            elif _m is logits_of and isinstance(out, mx.array):  # (a gate that routes by itself: its choice)
                rec.add("logits", array(out).reshape(-1, out.shape[-1]))
            elif isinstance(out, mx.array):
                rec.add(_path, array(out))
            return out
        cls = type(m)
        m.__class__ = type(cls.__name__, (cls,), {"__call__": call})
        swapped.append((m, cls))
    try:
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        for mod, fn in patched:
            mod.gated_delta_update = fn


class MLXCandidate(Candidate):
    block_mode = "isolated"

    def __init__(self, model, dtype, device, info, array_mask: bool = False, windows: dict | None = None,
                 chunks: dict | None = None):
        import mlx.core as mx

        self.mx, self.model, self.dtype, self.device, self.info = mx, model, dtype, device, info
        self.cache, self.pos = None, 0
        self.array_mask = array_mask  # the family's mlx-lm model builds an array mask (MlxLm.array_mask)
        self.windows = windows or {}  # layer -> its sliding window (the model's own masks; a block needs it)
        self.chunks = chunks or {}  # layer -> its attention chunk (Llama 4's chunked layers)
        self.routes: list = []  # (layer, indices, weights) of each MoE block's call (routing replay)
        self._record_routes()

    def _record_routes(self) -> None:
        """Each sparse layer's mlx-lm MoE block, its class swapped for one that records the experts it
        selects on every call (the routing mirror, exporters/mlx_model.py route, on the block's input:
        what the block itself computes, tests/test_mlx.py) before running as it is."""
        mx, routes = self.mx, self.routes
        for i, layer in enumerate(self.model.layers):
            moe = moe_block(layer)
            if not ("switch_mlp" in moe or "experts" in moe):
                continue
            cls = type(moe)

            def call(self_, x, *a, _cls=cls, _i=i, **kw):
                w, idx = route(self_, x)
                mx.eval(w, idx)
                routes.append((_i, np.array(idx).reshape(-1, idx.shape[-1]).astype(np.int64),
                               np.array(w.astype(mx.float32)).reshape(-1, idx.shape[-1])))
                return _cls.__call__(self_, x, *a, **kw)
            moe.__class__ = type(cls.__name__, (cls,), {"__call__": call})

    def last_routes(self):
        return {layer: (idx, w) for layer, idx, w in self.routes}

    def block_routes(self):
        return [{layer: (idx, w)} for layer, idx, w in self.routes]

    def _in(self, x):  # the reference's fp32 numpy input -> mx at the model's activation dtype
        return self.mx.array(np.asarray(x, np.float32)).astype(self.dtype)

    def _out(self, a):
        """numpy fp32; bf16 as a torch bf16 tensor (numpy has no bf16; the dtype is checked)."""
        out = np.array(a.astype(self.mx.float32))
        if a.dtype == self.mx.bfloat16:
            import torch

            return torch.from_numpy(out).to(torch.bfloat16)
        return out

    def _prefill(self, tokens):
        """mx logits [T, V] of a new sequence (a fresh mlx-lm cache)."""
        from mlx_lm.models.cache import make_prompt_cache

        with self.mx.stream(self.device):
            self.cache, self.pos = make_prompt_cache(self.model), len(tokens)
            return self.model(self.mx.array([tokens]), cache=self.cache)[0]

    def _decode(self, token, pos):
        """mx logits [V] of one step on the carried cache."""
        if pos != self.pos:
            raise ValueError(f"decode at position {pos}, but the cache holds {self.pos} tokens")
        with self.mx.stream(self.device):
            self.pos += 1
            return self.model(self.mx.array([[token]]), cache=self.cache)[0, -1]

    def prefill(self, tokens):
        self.routes.clear()
        return self._out(self._prefill(tokens))

    def decode(self, token, pos):
        self.routes.clear()
        return self._out(self._decode(token, pos))

    # The on-device sampler is mlx-lm's own (mlx_lm.sample_utils.make_sampler: top-p, then
    # mx.random.categorical at the temperature; temperature 0 is its argmax), on the
    # log-probabilities as mlx_lm.generate hands them over, seeded per call with
    # mx.random.seed as a runner would seed it. The harness is the runner (seed s + k at step k)
    # and validates the arguments, which mlx-lm's sampler does not refuse. mlx-lm takes the
    # top-p nucleus of the unscaled distribution (apply_top_p on the log-probabilities, the
    # temperature only in categorical_sampling): the distribution row judges it as such.
    top_p_after_temperature = False

    def sample_logits(self, logits, temperature, top_p, seed) -> int:
        check_args(temperature, top_p)
        from mlx_lm.sample_utils import make_sampler

        mx = self.mx
        with mx.stream(self.device):
            lg = (logits if isinstance(logits, mx.array) else mx.array(np.asarray(logits, np.float32)))
            lg = lg.reshape(1, -1).astype(mx.float32)
            mx.random.seed(int(seed))
            return int(make_sampler(temp=temperature, top_p=top_p)(lg - mx.logsumexp(lg, axis=-1, keepdims=True)).item())

    def sample_prefill(self, tokens, temperature, top_p, seed) -> int:
        check_args(temperature, top_p)  # before the model runs: a refused call changes no state
        return self.sample_logits(self._prefill(tokens)[-1], temperature, top_p, seed)

    def sample_decode(self, token, pos, temperature, top_p, seed) -> int:
        check_args(temperature, top_p)
        return self.sample_logits(self._decode(token, pos), temperature, top_p, seed)

    def host_sampler(self, logits, temperature, top_p, seed) -> tuple[int, None]:
        """The seed schedule's reference: the same mlx-lm sampler on the HF reference's logits
        (its Gumbel noise is mlx's own, drawn inside mx.random.categorical: no margin to report)."""
        return self.sample_logits(np.asarray(logits, np.float32), temperature, top_p, seed), None

    def gates(self):
        """A shipped directory: does mlx-lm read its config.json as the model the reference's config
        means? (A field it misses takes mlx-lm's default: rope_theta 1e6 where HF's is 1e4.)"""
        mismatch = self.info.get("config_mismatch")
        if mismatch is None:
            return []
        text = "; ".join(f"{k}: mlx-lm {v['mlx_lm']!r}, reference {v['reference']!r}" for k, v in mismatch.items())
        return [GateRow("mlx_config", "fail" if mismatch else "pass", len(mismatch), 0,
                        f"fields mlx-lm read differently from the candidate's config.json: {text}" if mismatch
                        else "mlx-lm reads the candidate's config.json as the reference's model")]

    def run_block(self, layer, kind, calls):
        self.routes.clear()
        with self.mx.stream(self.device):
            fn = self._block(layer, kind)
            return [fn(self._in(c.x_array), c) for c in calls]

    def run_block_points(self, layer, kind, calls):
        """The drill (oracle/points.py): every submodule of mlx-lm's block records its output under its
        path (mlx-lm names them as HF does: q_proj, q_norm, shared_expert.down_proj, ...), the output
        projection its input (`context`), the rotary module its two calls (`q_rope`, `k_rope`: mlx-lm
        rotates q, then k), the router's linear layer its `logits`, the block's routing mirror its
        `topk` and `weights`. mlx-lm computes scores and selection inline: not recorded."""
        from oracle import points

        tm = text_model(self.model)
        if kind in ("final_norm", "logits"):
            block = tm.model.norm if kind == "final_norm" else tm.lm_head if "lm_head" in tm else None
        else:
            dec = self.model.layers[layer]
            block = {"attention": attention_block(dec), "layer": dec}.get(kind) or moe_block(dec)
        if block is None:
            return None
        rec = points.Recorder(taps=("q_rope", "k_rope", "logits", "recurrence")
                              + (("topk", "weights") if kind == "router" else ()))
        with self.mx.stream(self.device), mlx_points(block, rec, self.mx):
            outs = self.run_block(layer, kind, calls)
        for out in outs:
            if kind == "router":
                rec.add("topk", np.asarray(out[1], dtype=np.float32))
                rec.add("weights", np.asarray(out[0], dtype=np.float32))
            else:  # the block's own output (as run_block returns it)
                rec.add("output", np.asarray(out, dtype=np.float32))
        return rec.points

    def chunk_mask(self, x, cache, chunk: int):
        """The chunked layers' mask as mlx-lm's llama4 builds it over its ChunkedKVCache (key j visible
        to query i iff j <= i in the same chunk), after trimming the cache to the current chunk."""
        mx = self.mx
        cache.maybe_trim_front()
        start, offset = cache.start_position, cache.offset
        linds = mx.arange(start, offset + x.shape[1])
        rinds = mx.arange(offset, offset + x.shape[1])[:, None]
        return (mx.abs(linds // chunk - rinds // chunk) == 0) & (linds <= rinds)

    def _block(self, layer, kind):
        """fn(x [1, T, H], call) for one block; stateful blocks own a fresh mlx-lm cache."""
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask
        from mlx_lm.models.cache import make_prompt_cache

        tm = text_model(self.model)
        if kind == "final_norm":
            return lambda x, c: self._out(tm.model.norm(x))
        if kind == "logits":
            head = tm.model.embed_tokens.as_linear if getattr(tm.args, "tie_word_embeddings", False) else tm.lm_head
            # what mlx-lm's Model.__call__ does after the head: Granite divides by its logits_scaling
            scaling = getattr(tm, "logits_scaling", 1.0)
            return lambda x, c: self._out(head(x) / scaling if scaling != 1.0 else head(x))
        dec = self.model.layers[layer]
        if kind in ("moe", "mlp"):  # a sparse layer's MoE block, or a dense layer's MLP
            return lambda x, c: self._out(moe_block(dec)(x))
        if kind == "router":
            def router(x, c):
                w, idx = route(moe_block(dec), x)
                return self._out(w.reshape(-1, w.shape[-1])), np.array(idx).reshape(-1, idx.shape[-1])

            return router
        module = {"attention": attention_block(dec), "layer": dec}[kind]
        cache, pos = make_prompt_cache(self.model)[layer], [0]
        linear = getattr(dec, "is_linear", False)

        def fn(x, c):
            if c.probe or int(c.pos_array[0]) != pos[0]:
                raise ValueError(f"{kind} of layer {layer}: call at position {int(c.pos_array[0])}, state at {pos[0]}")
            pos[0] += x.shape[1]
            if layer in self.chunks:
                mask = self.chunk_mask(x, cache, self.chunks[layer])
            else:
                mask = create_ssm_mask(x, cache) if linear else create_attention_mask(
                    x, cache, window_size=self.windows.get(layer), return_array=self.array_mask)
            return self._out(module(x, mask, cache))

        return fn


class MLXBackend(Backend):
    """`transform(model, args)` modifies the loaded mlx-lm model in place (how exporters/mlx_faults.py
    injects faults; args: the checkpoint's ModelArgs), before any quantization. `config_fn(family, config.json dict)` gives the
    ModelArgs fields (naive_mlx_config shows what mlx-lm's own loader would do)."""

    precisions = PRECISIONS
    cache_namespaces = ("mlx-reference", "quantized")  # the reference directories, the q8/q4 ones it writes
    # the model at its precision (q8/q4: packed weights + a scale and a bias per group of 32),
    # plus one layer's arrays while it is evaluated
    # measured peaks: OLMoE --layers 2 (1.05 B parameters) fp32 4.9, q8 3.4, q4 3.2 GiB; full-size
    # OLMoE (6.92 B) q4 7.9 GiB (docs/benchmarks.md)
    memory_per_param = {"fp32": 4.4, "bf16": 2.4, "q8": 1.4, "q4": 1.2}
    memory_note = "the mlx model at its precision, evaluated a layer at a time"
    runs_torch = False  # the candidate runs no torch (provenance records no torch thread count)
    loads_directory = True  # --candidate-dir: a shipped mlx-lm directory (mlx_lm.convert's output)
    option_schema = (
        Option("device", str, ("cpu", "gpu"), "gpu where mlx has one, else cpu",
               "where mlx runs (gpu: Metal on Apple silicon)", "--device"),
        Option("group_size", int, GROUP_SIZES, DEFAULT_GROUP_SIZE, "quantization group size (q8/q4 only)",
               "--group-size", quantizes=True),
        Option("recipe", str, RECIPES, None, "mlx-lm's mixed quantization recipe (with --precision q4)",
               commands=("export",), quantizes=True),
    )

    def __init__(self, name: str = "mlx", transform=None, transform_id: str | None = None, config_fn=mlx_config):
        self.name, self.transform, self.transform_id, self.config_fn = name, transform, transform_id, config_fn

    def availability(self):
        try:
            import mlx.core  # noqa: F401

            mlx_module("cache")
        except Exception as e:  # ImportError, or a native library that fails to load
            return False, (f"mlx / mlx-lm cannot be imported ({type(e).__name__}: {e}); "
                           "install the extra: pip install 'moe-oracle[mlx]'")
        return True, ""

    def with_quantized_fault(self, name: str, layer: int):
        """This backend with a quantized runtime fault (exporters/mlx_faults.py QUANTIZED_FAULTS)
        in decoder layer `layer`'s experts: the weights in the file right, their dequantization wrong."""
        from exporters import mlx_faults

        fn = mlx_faults.QUANTIZED_FAULTS[name]
        return type(self)(f"{self.name}+{name}", lambda m, a: fn(text_model(m).layers[layer]), f"{name}@{layer}",
                          self.config_fn)

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults.py name) on mlx-lm's model; None
        where the fault has no natural form there (exporters/mlx_faults.py)."""
        from exporters import mlx_faults

        if mlx_faults.not_applicable(fault, "") is not None:
            return None
        return type(self)(f"{self.name}+{fault.name}", lambda m, a: mlx_faults.inject(fault, m, a), fault.name,
                          self.config_fn)

    def fault_not_applicable(self, fault) -> str | None:
        """Why with_fault(fault) is None (the selftest lists the fault as not applicable with this)."""
        from exporters import mlx_faults

        return mlx_faults.not_applicable(fault, "")

    def fault_point(self, fault) -> str | tuple | None:
        """Where a fault's mlx form breaks another point than its torch form (exporters/mlx_faults.POINTS)."""
        from exporters import mlx_faults

        return mlx_faults.POINTS.get(fault.name)

    def check_options(self, spec) -> str | None:
        """What is wrong with spec.options for this backend on this host (None: nothing).
        For the harness to refuse before any work (bad input); load() raises it as well."""
        opts = spec.options or {}
        group_size = opts.get("group_size")
        if spec.candidate_dir and (group_size is not None or opts.get("recipe")):
            return "--group-size / recipe: a shipped directory's quantization is its own (its config.json)"
        if group_size is not None and spec.precision not in QUANT_BITS:
            return f"--group-size applies to q8/q4, not {spec.precision}"
        if self.availability()[0]:
            import mlx.core as mx

            has_gpu = mx.is_available(mx.gpu)
            if opts.get("device") == "gpu" and not has_gpu:
                return (f"--device gpu: mlx has no GPU backend on this host ({platform.system()} "
                        f"{platform.machine()}; mlx[cpu] runs on the CPU only): use --device cpu")
            if spec.precision == "bf16" and (opts.get("device") == "cpu" or not has_gpu):
                return "bf16 needs --device gpu: mlx's CPU gather_mm (the MoE experts) is float32-only"
        return None

    def load(self, model, spec):
        import mlx.core as mx

        problem = self.check_options(spec)
        if problem:
            raise ValueError(problem)
        opts = spec.options or {}
        device = device_of(opts.get("device"))
        group_size = int(opts.get("group_size") or DEFAULT_GROUP_SIZE)
        dtype = mx.bfloat16 if spec.precision == "bf16" else mx.float32
        shipped = {}
        with mx.stream(device):
            if spec.candidate_dir:  # the shipped directory, as mlx-lm loads it
                m, shipped = load_directory(spec.candidate_dir, model.family.name, dtype, model.config)
                fields, quant = shipped["config"], shipped["quantization"]
                if self.transform is not None:
                    self.transform(m, model.args)
            else:
                try:
                    m, fields = load_model(model, self.config_fn)
                except ConfigError as e:  # what mlx-lm's model of the family cannot do: refused, with the reason
                    from oracle.backend import InputError

                    raise InputError(f"mlx-lm cannot check this checkpoint: {e}") from None
                cast(m, dtype)
                if self.transform is not None:
                    self.transform(m, model.args)
                quant = quantize(m, QUANT_BITS[spec.precision], group_size) if spec.precision in QUANT_BITS else None
            # evaluated a decoder layer at a time: the lazily loaded checkpoint arrays of one layer
            # (and their fp32/quantization intermediates) are live at once, not the model's
            for layer in m.layers:
                mx.eval(layer.parameters())
            mx.eval(m.parameters())
        versions = {p: importlib.metadata.version(p) for p in ("mlx", "mlx-lm")}
        dev = "gpu" if device == mx.gpu else "cpu"
        info = {"executor": f"mlx-lm {versions['mlx-lm']} on mlx {versions['mlx']} ({dev})", "device": dev, "mlx_model": f"mlx_lm.models.{mapping(model.family.name).module}",
                "config": fields, "dtype": str(dtype).split(".")[-1]}
        if quant:
            info["quantization"] = quant
        if spec.candidate_dir:
            info["loaded_from"] = f"{spec.candidate_dir} (mlx_lm.utils.load_model)"
            info["config_mismatch"] = shipped["config_mismatch"]
        if self.transform_id:
            info["transform"] = self.transform_id
        a = model.args
        windows = {i: a.attention.sliding_window for i, t in enumerate(a.layer_types) if t == SLIDING}
        chunks = {i: a.attention.chunk_size for i, t in enumerate(a.layer_types) if t == CHUNKED}
        return MLXCandidate(m, dtype, device, info, mapping(model.family.name).array_mask, windows, chunks)

    # `oracle selftest --conversion`: mlx-lm directories at two widths and two group sizes
    shipped_formats = tuple((f"{p} g{g}", p, {"group_size": g}) for p in ("q8", "q4") for g in GROUP_SIZES)
    file_faults = {"scales_other_group": "one module's scales and biases computed for another group size, over "
                                         "the q of its own (last MoE layer)"}

    def shipped_tensors(self, original, shipped, progress):
        """The weight check of a shipped mlx-lm directory (exporters/mlx_weights.py), each tensor labelled
        with the checkpoint tensors the family's from_mlx puts there."""
        from exporters.mlx_weights import directory_tensor_sources, hf_labels
        from models.checkpoint import tensor_index

        ref = reference_directory(original, progress)
        shapes = {n: tuple(v[2]) for n, v in tensor_index(ref).items()}
        labels = hf_labels(original.family, original.config, shapes)
        return directory_tensor_sources(Path(shipped), ref, labels)

    def apply_file_fault(self, name, path, original, args, progress):
        from exporters.mlx_weights import scales_other_group
        from models.conversion_faults import last_sparse

        if name != "scales_other_group":
            return None
        return scales_other_group(Path(path), reference_directory(original, progress), last_sparse(args))

    def export(self, model, spec, output_dir) -> list:
        """An mlx-lm directory (what mlx_lm.convert writes: config.json, model*.safetensors):
        unquantized at fp32, or q8/q4 with --group-size, or --option recipe=mixed_4_6 (mlx-lm's
        mixed recipes: 6-bit v_proj/down_proj in some layers and lm_head, 4-bit elsewhere)."""
        opts = spec.options or {}
        recipe = opts.get("recipe")
        bits = QUANT_BITS.get(spec.precision)
        if recipe and bits is None:
            raise ValueError(f"--option recipe={recipe} is a quantization recipe: use --precision q4 (its low bits)")
        return write_directory(model, output_dir, None if recipe else bits,
                               int(opts.get("group_size") or DEFAULT_GROUP_SIZE), recipe)


def device_of(name: str | None):
    """--device (checked by check_options): gpu (Metal, Apple silicon; the default there) or
    cpu (the default elsewhere)."""
    import mlx.core as mx

    name = name or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    return mx.gpu if name == "gpu" else mx.cpu


BACKEND = MLXBackend()

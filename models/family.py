"""A family: the HF classes of its reference, its tiny config, the config mapping to `ModelArgs`,
`sanitize()` (the checkpoint's names and layouts -> the production model's), where its blocks live in
HF's model, and how the production model is built from a checkpoint (whole, or one layer at a time)."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable

from models.args import ModelArgs, stored_dtype
from models.checkpoint import CheckpointError

if TYPE_CHECKING:
    from models.layers.transformer import Transformer
from models.rules import COMMON_RULES, broken_rule
from models.text_tower import causal_lm, text_config, text_section  # noqa: F401  (text_config: the harness's)


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
    # a correction bias (e_score_correction_bias) HF keeps beside the router, not under it: its path in
    # the decoder layer (MiniMax-M2's MoE block holds it and passes it to its router); None: under the router
    hf_router_bias: str | None = None
    # (mlx-lm checkpoint tensors of one layer, config.json) -> the HF checkpoint's names and layouts
    # (how a shipped mlx-lm directory's dequantized weights become an HF reference)
    from_mlx: Callable = None
    # how mlx-lm's model of the family reads the checkpoint (models.mlx_lm.MlxLm; None: no mlx-lm model)
    mlx: object = None
    # tiny checkpoints: the std of the tensors whose names end so, where TINY_STD would hide a
    # mechanism (gpt-oss's SwiGLU clamp at 7 is never reached by weights of std 0.1)
    tiny_std: dict = None
    # ... and the tensors (name endings) kept as HF's init computes them, not drawn: buffers derived from the config
    # that save_pretrained writes (MiniMax's lightning decays)
    tiny_derived: tuple = ()
    # ... and the integer tables (name endings) drawn, not left at HF's init: each row k distinct ids below the config
    # attribute named (DeepSeek-V4's hash-routing table tid2eid [vocab, k], all 0 at init: every token expert 0 twice)
    tiny_ids: dict = None
    # HF's model called with explicit position_ids in decode: its cache does not count the tokens it holds (MiniMax's
    # reports 0 seen, its first layer lightning: HF's own decode would rotate every step at position 0)
    hf_position_ids: bool = False
    # config.json fields the release writes that HF's config class derives its own from or drops (MiMo-V2-Flash's
    # hybrid_layer_pattern, swa_* and sliding_window_size, read by llama.cpp's converter): written into the tiny
    # checkpoint's config.json over what save_pretrained wrote; they must mean the tiny config's model to HF
    release_config: dict = None
    release_drops: tuple = ()  # ... and the fields save_pretrained writes that the release's config.json has not
    # the release's tensor names where save_pretrained writes others: (tensors by name) -> the same under the release's
    # names (Kimi-Linear's dense MLP: `mlp` in the release, `block_sparse_moe` from transformers 5.23's reversed rename),
    # applied to every seeded checkpoint as it is written: what llama.cpp's converter and mlx-lm read is the release
    release_names: Callable = None
    # (a published config's text section, layers) -> the same cut to its last `layers` layers where the family keeps
    # the depth in fields the generic cut (num_hidden_layers, layer_types, first_k_dense_replace: oracle/source/
    # published.py) does not know: Kimi-Linear's 1-based linear_attn_config.kda_layers / full_attn_layers
    cut_layers: Callable = None
    # an HF router's output -> (logits [N, E], top-k weights [N, k], indices [N, k]) given the
    # ModelArgs (None: it returns that triple, as transformers 5's TopKRouters do)
    router_output: Callable = None
    # the inverse: (the HF router's output, top-k weights [N, k], indices [N, k], ModelArgs) -> its output
    # with that selection, what its MoE block then computes (oracle/verdict/replay.py forces a selection); None:
    # the triple's weights and indices replaced
    router_input: Callable = None
    # (the HF router module, its input hidden states, indices [N, k], ModelArgs) -> its output with that selection,
    # weighed as the router itself weighs it, where the weights are not a function of the routed logits alone
    # (Inkling's shared experts share the routed ones' normalisation); None: router_input's
    router_reweigh: Callable = None
    # config consistency (check_config): the config.json names of the routed-expert count and of
    # top-k, and the family's own rules beside COMMON_RULES (see there)
    experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    rules: tuple = ()
    # COMMON_RULES' "positive" fields the family's HF config sets to 0 by design (GLM-5.3's head_dim: HF's "the rotary
    # dims", 0 on its NoPE attention), left out of those rules
    not_positive: tuple = ()
    # how HF's fused experts.gate_up_proj holds gate and up (its forward splits them, the module does
    # not say how): "rows" [E, 2I, H] gate rows then up (transformers 5's chunk(2)), "columns"
    # [E, H, 2I] gate columns then up, "interleaved" [E, H, 2I] gate in the even columns, up in the odd
    hf_gate_up: str = "rows"
    # the MoE text tower of a multimodal release (models.text_tower.TextTower): the reference is HF's text
    # model class `hf_class_name` with the release's head, as a CausalLM under the release's names
    text_tower: object = None
    # (HF state dict, config.json dict) -> the same tensors, or views of them, under the names the trained weight
    # profile reads (oracle/source/trained.py: HF's shared names, model.layers.N.self_attn.q_proj, ...) for a
    # family whose modules are named otherwise (DBRX's blocks and fused Wqkv); None: those names already
    hf_profile_view: Callable = None
    # HF's submodule names inside a block -> the production model's, each dotted part of a path renamed
    # (models.mapping.renamed), where a decoder layer names its modules otherwise (Kolibri-1's GLM-4 sandwich:
    # post_self_attn_layernorm is the production post_attention_layernorm; LFM2's feed_forward is mlp): the drill
    # compares the points both have by name; None: the same names
    hf_point_names: dict = None
    # (the drill's points of an HF-named model, HF's or mlx-lm's, renamed by hf_point_names; ModelArgs; the layer) ->
    # the same points in the production model's layout or names where a point is laid out or named otherwise (AFMoE's
    # q_proj holds the gate; Nemotron-H's block names its mixer `mixer` whatever its kind)
    hf_point_view: Callable = None
    # () -> the reference class where HF's decoder layer has no module for a block the harness checks: HF's CausalLM
    # with its layers' own modules regrouped under one more (Gemma 4's MoE block: models/gemma4.py), the same
    # computation in the same order (tested equal to HF's own); None: HF's class as it is
    hf_reference: Callable = None
    # why the reference's output at a position depends on the other tokens of its call, so that no correct port is
    # invariant under chunking or batching (Doge's router: HF's view over the call's tokens); the chunked and batched
    # invariance rows are then n/a with it (oracle/verdict/invariance.py); None: the reference is causal per sequence
    tokens_mixed: str | None = None

    def __post_init__(self):
        if self.from_mlx is None:
            from models.checkpoint import unstack_experts

            object.__setattr__(self, "from_mlx", lambda weights, config: unstack_experts(weights))

    def hf_path(self, kind: str) -> tuple[str, ...]:
        """The paths (first that exists) of a block inside HF's decoder layer: the one
        (layer, kind) -> HF module map (oracle.reference.run.block_modules) reads it."""
        return {"attention": self.hf_attention, "router": (self.hf_router,), "moe": (self.hf_moe,),
                "mlp": (self.hf_mlp,)}[kind]

    def hf_class(self):
        if self.hf_reference is not None:
            return self.hf_reference()
        if self.text_tower is not None:
            return causal_lm(self.hf_module, self.text_tower)
        return getattr(importlib.import_module(f"transformers.models.{self.hf_module}"), self.hf_class_name)

    def hf_config(self, cfg: dict):
        """HF's config object of a config.json dict; a value of the wrong type (HF's configs are
        strict dataclasses) or one HF refuses is a CheckpointError naming the field."""
        cls = getattr(importlib.import_module(f"transformers.models.{self.hf_module}"), self.hf_config_name)
        cfg = {k: v for k, v in text_config(cfg).items() if k not in ("architectures", "transformers_version")}
        try:  # (HF's own reading of the floats JSON has no spelling for: {"__float__": "Infinity"})
            return cls(**cls._decode_special_floats(cfg))
        except Exception as e:  # huggingface_hub's StrictDataclassFieldValidationError, HF's own ValueErrors
            raise CheckpointError(hf_config_problem(e)) from None

    def check_config(self, c, raw: bool = False) -> None:
        """CheckpointError naming the config.json field(s) of the first rule `c` (HF's config object;
        `raw`: the file's values, whose types HF's class checks after) breaks: COMMON_RULES, the
        experts' rules and the family's own (`rules`)."""
        experts = (("positive", self.experts, self.top_k), ("at_most", self.top_k, self.experts))
        common = tuple(r if r[0] != "positive" else (r[0], *(f for f in r[1:] if f not in self.not_positive))
                       for r in COMMON_RULES)
        for rule in common + experts + self.rules:
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
        from models.layers.transformer import Transformer

        try:
            # before anything per layer is made (a depth of 10**9: a 10**9-entry layer_types, then a model
            # that would take forever even on the meta device)
            depth = 1 + max((int(m.group(1)) for k in weights if (m := LAYER.search(k))), default=-1)
            text = text_section(cfg)
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
        from models.layers.transformer import Transformer

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

        from models.layers.transformer import Transformer

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

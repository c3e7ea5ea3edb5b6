"""Seeded checkpoints: a family's tiny checkpoint (the tiny config, weights drawn from the seed)
and a published config's (HF's own initialisation, seeded, written layer by layer as save_pretrained
writes it), each built once into the content-addressed cache, in a weight profile (oracle/source/trained.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from models.checkpoint import split_by_layer, torch_dtype
from oracle.source.published import published_config
from oracle.cache.files import cached_dir

TINY_STD = 0.1  # large enough that router top-k and final argmax are not near ties


TINY_FORMAT = 2  # bump when the tiny-weight recipe changes (invalidates the cache)


def _draw(name: str, shape, gen, std: dict | None = None):
    """One tiny weight, N(0, TINY_STD) (or the family's `tiny_std` for names ending so: a std, or (mean, std)), except
    the Gated DeltaNet decay parameters: drawn so the recurrent state is remembered across tokens
    (per-token decay 0.85-0.98); a decay near 0 would hide a state that is not carried."""
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.05, 0.5, generator=gen).log()
    sd = next((v for k, v in (std or {}).items() if name.endswith(k)), TINY_STD)
    if isinstance(sd, tuple):  # (mean, std): a scale whose identity is 1 (Gemma 4's router and layer scales)
        return sd[0] + torch.randn(shape, generator=gen) * sd[1]
    noise = torch.randn(shape, generator=gen) * sd
    if name.endswith("dt_bias"):
        return noise - 1.0
    return noise


def draw_weights(model, seed: int, hf_config, std: dict | None = None, derived: tuple = (), ids: dict | None = None):
    """Overwrite every tensor of the HF `model` deterministically from `seed`, but those whose names end with one of
    `derived` (buffers HF computes from the config: Family.tiny_derived); its state dict. Norm weights keep the
    identity HF initialises them to (1 for w * x, 0 for (1 + w) * x) plus the noise. Integer tables whose names end
    with a key of `ids` (Family.tiny_ids): each row distinct ids below the `hf_config` attribute that key names."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    with torch.no_grad():
        for name in sorted(sd):
            t = sd[name]
            bound = next((getattr(hf_config, v) for k, v in (ids or {}).items() if name.endswith(k)), None)
            if bound is not None and not torch.is_floating_point(t):  # distinct ids per row, drawn
                rows = torch.rand(t.shape[:-1].numel(), bound, generator=gen).argsort(-1)[:, : t.shape[-1]]
                t.copy_(rows.reshape(t.shape))
                continue
            if not torch.is_floating_point(t) or (derived and name.endswith(derived)):
                continue
            w = _draw(name, t.shape, gen, std)
            if "norm" in name and name.endswith("weight"):
                w = w + t.mean()  # HF's identity init: all ones or all zeros
            t.copy_(w)
    return sd


def write_tiny_checkpoint(hf_config, hf_class, seed: int, out: Path, std: dict | None = None,
                          rewrite=None, derived: tuple = (), ids: dict | None = None) -> None:
    """The HF model with its weights drawn from `seed` (draw_weights), saved at `out`. `rewrite` (a weight profile's,
    oracle.source.trained): applied to the state dict before it is saved."""
    import torch

    torch.manual_seed(seed)
    model = hf_class(hf_config)
    sd = draw_weights(model, seed, hf_config, std, derived, ids)
    if rewrite is not None:
        rewrite(sd)
    model.save_pretrained(out, safe_serialization=True)


def tiny_checkpoint(family, seed: int, weights: str = "normal") -> Path:
    """The family's tiny checkpoint for `seed` and weight profile (oracle.source.trained.PROFILES),
    built once into a content-addressed cache dir."""
    from importlib.metadata import version

    from oracle.source.trained import profile_recipe, profile_rewrite

    rewrite = profile_rewrite(family, family.tiny_config, weights, seed)
    recipe = {
        "family": family.name,
        "config": family.tiny_config,
        "seed": seed,
        "std": TINY_STD,
        **({"tiny_std": family.tiny_std} if family.tiny_std else {}),
        **({"tiny_derived": list(family.tiny_derived)} if family.tiny_derived else {}),
        **({"tiny_ids": family.tiny_ids} if family.tiny_ids else {}),
        **({"release_config": family.release_config or {}, "release_drops": list(family.release_drops)}
           if family.release_config or family.release_drops else {}),
        **({"release_names": True} if family.release_names else {}),
        "format": TINY_FORMAT,
        "transformers": version("transformers"),
        **profile_recipe(weights, family),
    }
    stem = f"{family.name}-s{seed}" + ("" if weights == "normal" else f"-{weights}")
    def build(out):
        write_tiny_checkpoint(family.hf_config(family.tiny_config), family.hf_class(), seed, out, family.tiny_std,
                              rewrite, family.tiny_derived, family.tiny_ids)
        if family.release_config or family.release_drops:  # the release's own fields, as its config.json has them
            path = out / "config.json"
            written = {k: v for k, v in json.loads(path.read_text()).items() if k not in family.release_drops}
            path.write_text(json.dumps({**written, **(family.release_config or {})}, indent=2) + "\n")
        if family.release_names:  # the release's tensor names where save_pretrained wrote others
            rename_tensors(out, family.release_names)

    return cached_dir(recipe, stem, "oracle_tiny.json", build)


def rename_tensors(out: Path, names) -> None:
    """Every safetensors file of the checkpoint directory `out` (and its index) with its tensors renamed by `names`
    (tensors by name -> the same tensors by their new names)."""
    from safetensors.torch import load_file, save_file

    weight_map = {}  # each new name -> the file that holds it
    for path in sorted(out.glob("*.safetensors")):
        renamed = names(load_file(str(path)))
        save_file({k: v.contiguous() for k, v in renamed.items()}, str(path), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(renamed, path.name))
    index = out / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        index.write_text(json.dumps({**doc, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


SHARD_BYTES = 5 * 10**9  # the 5 GB shards the published checkpoints use


def write_seeded_checkpoint(family, cfg: dict, seed: int, out: Path, dtype=None,
                            shard_bytes: int = SHARD_BYTES, progress=None, rewrite=None) -> None:
    """A checkpoint of `cfg`'s shapes with weights from HF's own initialisation (normal with the
    config's initializer_range, norms at identity), seeded, written as save_pretrained writes
    it (HF's reverse weight conversion: per-expert names; sharded with an index), one decoder
    layer at a time: peak memory is one layer in fp32, not the model. dtype: torch's (default bf16).
    `rewrite` (a weight profile's, oracle.source.trained): applied to each layer's (and the modules outside
    the layers') fp32 state dict before it is stored. A config that declares a released quantized format
    (gpt-oss's MXFP4, DeepSeek-V3's FP8: models/release_formats.py) is written in it, as released: the tensors
    the release packs are packed from their fp32 values, the others stored in `dtype`."""
    import torch
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from models.release_formats import pack, packs, release_format

    dtype = dtype or torch.bfloat16
    fmt = release_format(cfg)
    hf_cfg = family.hf_config(cfg)
    with torch.device("meta"):
        model = family.hf_class()(hf_cfg)
    torch.manual_seed(seed)
    decoder = model.get_decoder()
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    groups = [(f"{prefix}.layers.{i}.", layer) for i, layer in enumerate(decoder.layers)]
    shards, pending, size = [], {}, 0

    def flush():
        nonlocal pending, size
        if pending:
            path = out / f".shard-{len(shards):05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            shards.append((path, sorted(pending)))
            pending, size = {}, 0

    def add(module, name_prefix):
        nonlocal size
        module.to_empty(device="cpu")
        for sub in module.modules():
            model._init_weights(sub)
        sd = {name_prefix + k: v for k, v in module.state_dict().items()}
        if rewrite is not None:
            rewrite(sd)
        reverted = revert_weight_conversion(model, sd)
        for k, v in (family.release_names(reverted) if family.release_names else reverted).items():
            if fmt is not None and v.is_floating_point() and packs(fmt, k, v.shape):
                parts = pack(fmt, k, v)
            else:
                parts = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()}
            pending.update(parts)
            size += sum(t.numel() * t.element_size() for t in parts.values())
        module.to("meta")  # freed
        if size >= shard_bytes:
            flush()

    for n, (name_prefix, layer) in enumerate(groups):
        if progress:
            progress(f"layer {n + 1}/{len(groups)}")
        add(layer, name_prefix)
    # then the modules outside the decoder layers (embeddings, final norm, head), initialised the
    # same way; a tied head is not written (as save_pretrained does)
    done = {id(layer) for _, layer in groups}
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        mod_name = name.rpartition(".")[0]
        mod = model.get_submodule(mod_name)
        if any(name.startswith(g) for g, _ in groups) or id(mod) in done:
            continue
        done.add(id(mod))
        if tied and mod is model.get_output_embeddings():
            continue
        add(mod, mod_name + ".")
    flush()
    total = len(shards)
    weight_map = {}
    for i, (path, names) in enumerate(shards):
        final = out / (f"model-{i + 1:05d}-of-{total:05d}.safetensors" if total > 1 else "model.safetensors")
        os.replace(path, final)
        weight_map.update({k: final.name for k in names})
    if total > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def config_checkpoint(family, name: str, layers: int | None, seed: int, dtype: str = "bf16",
                      progress=None, weights: str = "normal", build: bool = True) -> Path | None:
    """The seeded checkpoint of a published config (--config NAME [--layers N]) and weight profile
    (oracle.source.trained.PROFILES), built once into the content-addressed cache (`build` False: None where
    it is not built yet, nothing written: --validate-only)."""
    from importlib.metadata import version

    from oracle.source.trained import profile_recipe, profile_rewrite

    cfg = published_config(name, layers)
    rewrite = profile_rewrite(family, cfg, weights, seed)
    name = Path(name).stem if name.endswith(".json") else name
    recipe = {"family": family.name, "config": cfg, "seed": seed, "dtype": dtype, "format": TINY_FORMAT,
              "transformers": version("transformers"), **profile_recipe(weights, family), **release_recipe(cfg),
              **({"release_names": True} if family.release_names else {})}
    stored = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[dtype]
    profile = "" if weights == "normal" else f"-{weights}"
    return cached_dir(recipe, f"{name}-L{layers or 'all'}-s{seed}-{dtype}{profile}", "oracle_seeded.json",
                      lambda out: write_seeded_checkpoint(family, cfg, seed, out, torch_dtype(stored),
                                                          progress=progress, rewrite=rewrite),
                      needed=lambda: config_parameters(family, cfg) * {"bf16": 2, "fp16": 2, "fp32": 4}[dtype],
                      build_it=build)


def release_recipe(cfg: dict) -> dict:
    """What the cache key of a seeded checkpoint written in a release's format adds (nothing for a plain one)."""
    from models.release_formats import PACKING, release_format

    fmt = release_format(cfg)
    return {} if fmt is None else {"release": fmt.describe(), "release_packing": PACKING}


def meta_model(family, cfg: dict):
    """A config's HF model on the meta device (no memory): its parameters' names and shapes."""
    import torch

    with torch.device("meta"):
        return family.hf_class()(family.hf_config(cfg))


def config_parameters(family, cfg: dict) -> int:
    """Parameters of a config's HF model."""
    return sum(p.numel() for p in meta_model(family, cfg).parameters())


def config_layer_parameter_counts(family, cfg: dict) -> tuple[int, int]:
    """layer_parameter_counts of a config's HF model, before any checkpoint is written."""
    return split_by_layer((f".{name}", p.numel()) for name, p in meta_model(family, cfg).named_parameters())

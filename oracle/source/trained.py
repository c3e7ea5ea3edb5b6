"""The `trained` weight profile: a normal-law checkpoint rewritten so that it has the statistics
of trained LLMs, which one normal law lacks and which set the rounding error of a reduced
precision (docs/weights.md has the numbers measured on the result). A deterministic rewrite of a
few tensors, chosen by their role (HF's in-memory names, which the families share), drawn from
the checkpoint's seed:

- outlier feature dimensions (LLM.int8(), Dettmers et al. 2022: a few hidden dims, up to ~20x the
  others, in every token and layer): OUTLIER_DIMS dims get OUTLIER_SCALE times the embedding's std
  in every token (one sign per dim), and every layer's attention output projection writes them
  OUTLIER_SCALE times larger, so they stay outliers at every layer's input (the embedding alone
  fades after the first layer).
- massive activations (Sun et al. 2024, "Massive Activations in Large Language Models": a few
  fixed dims, the same value on a few tokens, hundreds to thousands of times the median): a
  MASSIVE_SHARE of the vocabulary gets MASSIVE_SCALE times the embedding's median |value| on
  MASSIVE_DIMS other dims.
- RMSNorm (and LayerNorm) gains of the residual stream log-normal, about two decades wide
  (GAIN_SIGMA). On the outlier and massive dims they keep their normal-law gain: the block inputs
  then carry the outliers at the factor LLM.int8() measures, not that times a random gain of up to
  ~16, which made every token's block output the same and the greedy tokens a single repeated one.
  The final norm divides those dims by their factor so the head reads the token, not what every
  token shares (trained models remove massive activations in their last layers: Sun et al. §2).
- routers ROUTER_SCALE times sharper (their weight and bias scaled).
- attention QK_SCALE times sharper on each side: q and k projections scaled (weight and bias), or
  where the layer normalises q and k with a gain (q_norm / k_norm), which a projection's scale
  cannot pass, those gains; MLA (DeepSeek), whose keys come from a normalised latent shared with
  the values, scales its queries by QK_SCALE**2. The Gated DeltaNet layers L2-normalise q and k
  without a gain and Llama 4's rope layers likewise: no scale reaches them there.
"""

from __future__ import annotations

import hashlib
import math
import re

PROFILES = ("normal", "trained")
# bump when the recipe below changes (part of the cache key of trained checkpoints). 2: a norm of the embeddings
# (Inkling's embed_tokens.embed_norm) gets a residual norm's gains, no longer the final norm's
TRAINED_FORMAT = 2

OUTLIER_DIMS, OUTLIER_SCALE = 3, 20.0
MASSIVE_DIMS, MASSIVE_SHARE, MASSIVE_SCALE = 2, 0.1, 300.0
GAIN_SIGMA = math.log(100.0) / 4  # std of ln(gain): 95 % of the gains within two decades (e^(+-2 sigma))
ROUTER_SCALE = 4.0
QK_SCALE = 2.5

# the residual stream's norms inside a layer (the final norm is the one outside the layers)
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight",
               "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
# the mixers' output projections ([H, ...]): every layer writes into the residual stream through one (attention,
# Gated DeltaNet, LFM2's short convolution)
WRITERS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "linear_attn.out_proj.weight", "conv.out_proj.weight")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
MLA_QUERIES = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")
QK_PROJ = re.compile(r"self_attn\.[qk]_proj\.(weight|bias)")
LAYER = re.compile(r"(.*\.layers\.\d+\.)(.*)")


def profile_recipe(weights: str, family=None) -> dict:
    """What a checkpoint's cache key adds for the profile: nothing for normal (its keys, and so every
    cached checkpoint, golden and baseline made before the profiles existed, stay as they were); a family
    whose names the profile reads through a view (Family.hf_profile_view) says so: its trained checkpoints
    made before the view had roles left out."""
    if weights == "normal":
        return {}
    view = {"view": 1} if family is not None and family.hf_profile_view is not None else {}
    return {"weights": weights, "weights_format": TRAINED_FORMAT, **view}


def profile_rewrite(family, cfg: dict, weights: str, seed: int):
    """The rewrite a checkpoint of `family` and `cfg` (a config.json dict) gets for the profile
    `weights`: None for normal, else a callable on a state dict (see rewrite)."""
    if weights not in PROFILES:
        raise ValueError(f"unknown weight profile {weights!r}; known: {', '.join(PROFILES)}")
    if weights == "normal":
        return None
    offset = family.args(cfg).norm.offset
    view = family.hf_profile_view or (lambda sd, cfg: sd)  # (the rewrite is in place: through the views too)
    return lambda sd: rewrite(view(sd, cfg), seed, offset, family.hf_router)


def generator(seed: int, what: str):
    """A torch generator for one choice of the profile: independent of the order the tensors come
    in (a seeded checkpoint is written one layer at a time)."""
    import torch

    return torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{what}".encode()).hexdigest()[:15], 16))


def special_dims(seed: int, hidden: int) -> tuple[list[int], list[int], list[int]]:
    """(outlier dims, massive dims, a sign for each of both) of a hidden size."""
    import torch

    g = generator(seed, f"dims:{hidden}")
    dims = torch.randperm(hidden, generator=g)[: OUTLIER_DIMS + MASSIVE_DIMS].tolist()
    signs = (torch.randint(0, 2, (len(dims),), generator=g) * 2 - 1).tolist()
    return dims[:OUTLIER_DIMS], dims[OUTLIER_DIMS:], signs


def massive_rows(seed: int, vocab: int) -> list[int]:
    """The token ids that carry massive activations."""
    import torch

    n = max(1, round(MASSIVE_SHARE * vocab))
    return sorted(torch.randperm(vocab, generator=generator(seed, f"rows:{vocab}"))[:n].tolist())


def rewrite(sd: dict, seed: int, norm_offset: bool, router: str) -> None:
    """Rewrite the normal-law tensors of `sd` (HF in-memory names -> fp32 tensors: a whole model,
    whole layers, or the modules outside the layers) in place. `norm_offset`: the family's norms
    compute (1 + w) * x (NormArgs.offset), so a gain g is stored as g - 1; `router`: the
    family's router module inside a layer (Family.hf_router)."""
    import torch

    def gain(t):  # the gain a stored norm weight stands for, and back
        return t + 1 if norm_offset else t

    def stored(g):
        return g - 1 if norm_offset else g

    def lognormal(name, t):
        """Log-normal gains, bar the outlier and massive dims: those keep the normal-law ones."""
        g = torch.exp(GAIN_SIGMA * torch.randn(t.shape, generator=generator(seed, name)))
        outlier, massive, _ = special_dims(seed, t.shape[0])
        g[outlier + massive] = gain(t)[outlier + massive]
        return g, outlier, massive

    layers: dict = {}
    with torch.no_grad():
        for name, t in sd.items():
            if not t.is_floating_point():
                continue
            m = LAYER.fullmatch(name)
            if m:
                layers.setdefault(m.group(1), {})[m.group(2)] = t
            elif name.endswith("embed_tokens.weight"):  # a tied head follows (it is the same tensor)
                outlier, massive, signs = special_dims(seed, t.shape[1])
                std, median = t.std().item(), t.abs().median().item()
                for d, s in zip(outlier, signs):
                    t[:, d] += s * OUTLIER_SCALE * std
                rows = torch.tensor(massive_rows(seed, t.shape[0]))
                for d, s in zip(massive, signs[OUTLIER_DIMS:]):
                    t[rows, d] = s * MASSIVE_SCALE * median
            elif name.endswith("norm.weight") and t.ndim == 1 and "embed_tokens." in name:  # the embeddings' norm
                t.copy_(stored(lognormal(name, t)[0]))  # (as a layer's: the outlier and massive dims reach the layers)
            elif name.endswith("norm.weight") and t.ndim == 1:  # the final norm
                g, outlier, massive = lognormal(name, t)
                g[outlier] /= OUTLIER_SCALE
                g[massive] /= MASSIVE_SCALE
                t.copy_(stored(g))
        for prefix, layer in layers.items():
            mla = "self_attn.kv_a_proj_with_mqa.weight" in layer
            qk_norm = "self_attn.q_norm.weight" in layer
            for rel, t in layer.items():
                if rel in LAYER_NORMS:
                    t.copy_(stored(lognormal(prefix + rel, t)[0]))
                elif rel in WRITERS:
                    t[special_dims(seed, t.shape[0])[0]] *= OUTLIER_SCALE
                elif rel.startswith(router + ".") and (rel.endswith("weight") or rel.endswith(".bias")):
                    t *= ROUTER_SCALE  # (not a score-correction bias: that is added after the softmax/sigmoid)
                elif qk_norm and rel in QK_NORMS:
                    t.copy_(stored(QK_SCALE * gain(t)))
                elif mla and rel in MLA_QUERIES:
                    t *= QK_SCALE ** 2
                elif not qk_norm and not mla and QK_PROJ.fullmatch(rel):
                    t *= QK_SCALE

"""The MoE text tower of a multimodal release (Qwen3-VL-MoE, Qwen3-Omni-MoE's thinker, GLM-4.5V, ERNIE 4.5 VL),
checked on text input: the reference is HF's own text model class of the family (transformers 5.23 has no
*ForCausalLM for these) with the release's output projection, assembled here as a CausalLM the harness runs
like any other (`Family.hf_class()`), built from the text config alone.

It keeps the release's names and layouts: the text model where the release keeps it (`path`, e.g.
`model.language_model`), the head at `head`, and transformers' own weight conversion of the release
(conversion_mapping of the composite's model_type, e.g. qwen3_vl_moe's transposed fused experts)
registered for it, so that `save_pretrained` writes what the released checkpoint holds for its language
model (no vision or audio tower: the check is of text) and `from_pretrained` reads it through HF's own
conversion. The config.json written is the release's composite one (`composite`: model_type,
architectures, the text config nested where the release nests it), what llama.cpp's converter and
mlx-lm pick their model by; `from_pretrained` reads the text config out of it (models.family.text_config).

On text, the multi-axis rope of these models (MRoPE, 3-D rope) is given the same position on every axis
(their text models' own default when no position ids are passed, and what their get_rope_index gives
text tokens): it is the 1-D rope of those positions (tests/test_text_tower.py)."""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class TextTower:
    model: str  # HF's text model class in transformers.models.<Family.hf_module>
    composite: str  # the release's model_type (config.json) and transformers' conversion mapping of its layout
    architecture: str  # the release's architectures[0] (llama.cpp's converter picks its class by it)
    composite_config: str  # HF's config class of the release (Family.hf_module's)
    path: str = "model.language_model"  # where the release keeps the text model
    head: str = "lm_head"  # where the release keeps the output projection
    # where the release's config.json nests the text config: ("text_config",), Qwen3-Omni's
    # ("thinker_config", "text_config")
    nest: tuple[str, ...] = ("text_config",)
    # HF's conversion of the composite (a list of transforms) -> the one registered for the CausalLM, where
    # what save_pretrained writes is not the release's layout (None: HF's as it is)
    conversion: Callable | None = None

    def composite_json(self, hf_module: str, text: dict) -> dict:
        """The release's config.json around a text config (HF's composite config class: its other
        sub-configs at their defaults; no tower of theirs is in the checkpoint)."""
        cls = getattr(importlib.import_module(f"transformers.models.{hf_module}"), self.composite_config)
        inner = dict(text)
        for key in reversed(self.nest[1:]):
            inner = {key: inner}
        cfg = cls(**{self.nest[0]: inner, "tie_word_embeddings": text.get("tie_word_embeddings", False)}).to_dict()
        cfg["architectures"] = [self.architecture]
        return cfg


def _holder(root, path: str, module) -> None:
    """Set `module` at the dotted `path` under `root`, with plain nn.Modules between."""
    from torch import nn

    *parents, leaf = path.split(".")
    for p in parents:
        if not hasattr(root, p):
            setattr(root, p, nn.Module())
        root = getattr(root, p)
    setattr(root, leaf, module)


def _get(root, path: str):
    for p in path.split("."):
        root = getattr(root, p)
    return root


@functools.cache
def causal_lm(hf_module: str, tower: TextTower):
    """The CausalLM class of a text tower: HF's text model at `tower.path`, a linear head at `tower.head`."""
    from torch import nn
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import PreTrainedModel

    mod = importlib.import_module(f"transformers.models.{hf_module}")
    text_cls = getattr(mod, tower.model)
    base = next(c for c in text_cls.__mro__[1:] if issubclass(c, PreTrainedModel))
    name = tower.model.removesuffix("Model") + "ForCausalLM"

    class TextTowerForCausalLM(base):
        config_class = text_cls.config_class
        base_model_prefix = tower.path.split(".")[0]
        _tied_weights_keys = {f"{tower.head}.weight": f"{tower.path}.embed_tokens.weight"}
        _no_split_modules = getattr(text_cls, "_no_split_modules", None)

        def __init__(self, config):
            super().__init__(config)
            _holder(self, tower.path, text_cls(config))
            _holder(self, tower.head, nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            self.post_init()

        def get_decoder(self):
            return _get(self, tower.path)

        def get_input_embeddings(self):
            return _get(self, tower.path).embed_tokens

        def get_output_embeddings(self):
            return _get(self, tower.head)

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, **kwargs):
            out = _get(self, tower.path)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                         use_cache=use_cache, **kwargs)
            return CausalLMOutputWithPast(logits=_get(self, tower.head)(out.last_hidden_state),
                                          past_key_values=out.past_key_values)

        @classmethod
        def from_pretrained(cls, model_dir, *args, config=None, **kwargs):
            if config is None:  # the release's composite config.json: its text config (text_config)
                cfg = json.loads((Path(model_dir) / "config.json").read_text())
                text = {k: v for k, v in text_config(cfg).items() if k not in ("architectures", "transformers_version")}
                config = cls.config_class(**text)
            return super().from_pretrained(model_dir, *args, config=config, **kwargs)

        def save_pretrained(self, out, *args, **kwargs):
            super().save_pretrained(out, *args, **kwargs)
            text = {k: v for k, v in self.config.to_dict().items() if k not in ("architectures", "transformers_version")}
            cfg = tower.composite_json(hf_module, text)
            (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    TextTowerForCausalLM.__name__ = TextTowerForCausalLM.__qualname__ = name
    # the release's layout: transformers' own conversion of the composite model, for this class
    transforms = get_checkpoint_conversion_mapping(tower.composite) or []
    register_checkpoint_conversion_mapping(name, tower.conversion(transforms) if tower.conversion else transforms,
                                           overwrite=True)
    return TextTowerForCausalLM


def text_config(cfg: dict) -> dict:
    """The language model's config: a composite (multimodal) release's `text_config` (Qwen3-Omni's under its
    `thinker_config`: text_section), with the top-level keys it leaves out (e.g. tie_word_embeddings); any
    other config as it is."""
    text = text_section(cfg)
    if text is cfg:
        return cfg
    outer = [cfg, *([cfg["thinker_config"]] if isinstance(cfg.get("thinker_config"), dict) else [])]
    inherited = {k: o[k] for o in outer for k in ("tie_word_embeddings",) if k in o and k not in text}
    return {**text, **inherited}


def text_section(cfg: dict) -> dict:
    """The dict of a config.json that holds the language model's fields (itself, not a copy): `text_config`,
    `thinker_config.text_config` (Qwen3-Omni: the thinker is its language model), or the config itself."""
    holder = cfg["thinker_config"] if isinstance(cfg.get("thinker_config"), dict) else cfg
    text = holder.get("text_config")
    return text if isinstance(text, dict) else cfg

"""The production model streamed from its checkpoint, for a model that does not fit in memory: the
decoder layers hold their weights only while in use, and the check runs it layer by layer."""

from __future__ import annotations

import torch

from exporters.torch.candidate import TorchCandidate
from models.layers.transformer import reset_state
from oracle.reference.streaming import hold, layer_tensors, release_held, trim_heap
from oracle.schedule import Ahead

# ---------------------------------------------------------------- streamed from the checkpoint
# For a model that does not fit in memory: the decoder layers hold their weights only while in use
# (`LayerWeights`: read from the checkpoint's shards, sanitized and converted by the family's own rules, dropped
# after), and the check runs it layer by layer (`Steps`, oracle/schedule.py): each layer loaded once for its
# block rows and its stage of the e2e steps, in turn with HF's noise measurement, so that the checkpoint's bytes
# are read from disk once for all.


class LayerWeights:
    """One decoder layer of a production model whose parameters are read from the checkpoint when the layer
    is in use and put back on the meta device after (the acquire / release protocol of
    oracle.reference.streaming.LayerStream, so that `hold` and `materialized` apply): in use during its forward, or while
    held. Its state buffers (KV cache, recurrent state) stay."""

    def __init__(self, family, model, layer: int, names: list, index: dict, args, dtype):
        self.family, self.model, self.index, self.names, self.args, self.dtype = family, model, index, names, args, dtype
        self.layer = model.layers[layer]
        self.prefix = f"layers.{layer}."
        self.users, self.bytes = 0, 0
        for m in self.layer.modules():
            m._oracle_stream = self
        self.layer.register_forward_pre_hook(lambda m, a: self.acquire())
        self.layer.register_forward_hook(lambda m, a, out: self.release())

    def acquire(self):
        if self.users == 0:
            self.read()
        self.users += 1

    def release(self):
        self.users -= 1
        if self.users == 0:
            self.drop()

    def read(self):
        from accelerate.utils import set_module_tensor_to_device

        from models.checkpoint import CheckpointError

        raw = layer_tensors(self.index, self.names, self)
        group = self.family.production_group(raw, self.args, self.dtype)
        own = dict(self.layer.named_parameters())
        for name, value in group.items():
            if not name.startswith(self.prefix) or name[len(self.prefix):] not in own:
                raise CheckpointError(f"{name}: not a parameter of the production model's layer {self.prefix[:-1]}")
            set_module_tensor_to_device(self.layer, name[len(self.prefix):], "cpu", value=value, dtype=value.dtype)
        missing = [n for n, p in self.layer.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(f"missing tensor(s) of {self.prefix[:-1]}: {', '.join(missing[:6])}")

    def drop(self):
        from accelerate.utils import set_module_tensor_to_device

        for name, _ in list(self.layer.named_parameters()):
            set_module_tensor_to_device(self.layer, name, "meta")
        trim_heap()


def build_streamed(src, dtype):
    """The production model of `src` (an oracle.backend.ModelSource) with the tensors outside the decoder
    layers resident and each layer's read when in use (LayerWeights); `_oracle_streams` lists those."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from models.checkpoint import LAYER, CheckpointError, layer_groups, read_tensors, tensor_index
    from models.layers.transformer import Transformer

    index = tensor_index(src.model_dir)
    with init_empty_weights(include_buffers=False):
        model = Transformer(src.args, dtype)
    streams = []
    for names in layer_groups(index):
        m = LAYER.search(names[0])
        if m is not None and int(m.group(1)) < len(model.layers):
            streams.append(LayerWeights(src.family, model, int(m.group(1)), names, index, src.args, dtype))
            continue
        for name, value in src.family.production_group(read_tensors(index, names), src.args, dtype).items():
            set_module_tensor_to_device(model, name, "cpu", value=value, dtype=value.dtype)
    missing = [n for n, p in model.named_parameters() if p.is_meta and not n.startswith("layers.")]
    if missing:
        raise CheckpointError(f"missing tensor(s): {', '.join(missing[:6])}")
    model._oracle_streams = streams
    return model.eval()


class Steps:
    """The production model's e2e steps layer by layer (the prefill of tokens[:prompt_len], then `calls` - 1
    decode steps fed the next tokens): the embedding, then `through(layer)` for each layer in order (its
    state reset, then every call in order, its outputs the next layer's inputs), then `finish` (the final
    norm and the head). The production model's own modules and state; the same operations as its forward
    call by call."""

    def __init__(self, cand, tokens, prompt_len: int, calls: int):
        self.cand, self.done = cand, 0
        ids = [list(tokens[:prompt_len])] + [[tokens[prompt_len + k - 1]] for k in range(1, calls)]
        self.pos = [torch.arange(len(ids[0]))] + [torch.tensor([prompt_len + k - 1]) for k in range(1, calls)]
        model = cand.model
        with torch.no_grad():
            self.hidden = []
            for t in ids:  # Transformer.forward's embedding
                x = model.embed_tokens(torch.tensor([t]))
                self.hidden.append(x * model.args.multipliers.embedding if model.args.multipliers.embedding != 1.0 else x)
        self.routes = [{} for _ in ids]
        self.layers = len(model.layers)

    @torch.no_grad()
    def through(self, layer: int) -> None:
        if layer != self.done:
            raise ValueError(f"layer {layer} run before layer {self.done}")
        module = self.cand.model.layers[layer]
        hold(module._oracle_stream)
        reset_state(module)
        for c, (x, pos) in enumerate(zip(self.hidden, self.pos)):
            self.cand.routes.reset()
            self.hidden[c] = module(x, pos)
            self.routes[c].update(self.cand.routes.call())
        self.done += 1

    @torch.no_grad()
    def finish(self) -> tuple[list, list]:
        if self.done != self.layers:
            raise ValueError(f"{self.done} of {self.layers} layers run")
        release_held()
        model = self.cand.model
        logits = [model.lm_head(model.norm(x)) for x in self.hidden]
        return [lg[0] if k == 0 else lg[0, -1] for k, lg in enumerate(logits)], self.routes


class StreamedTorchCandidate(TorchCandidate):
    """The production model streamed (build_streamed): its block rows and e2e steps computed ahead, layer by
    layer (`ahead`), a block's layer held while its blocks run; prefill and decode (other prompts, the
    sampler) read each layer for each forward."""

    def __init__(self, model, dtype, info=None):
        super().__init__(model, dtype, info)
        self.kept = Ahead()

    def ahead(self, ref, on_block=None, on_layer=None):
        self.kept = Ahead()
        return self.kept.run(self, ref, len(self.model.layers), Steps(self, ref.tokens, ref.prompt_len, len(ref.logits)),
                             self.routes, on_block, on_layer)

    def teacher_forced(self, tokens, prompt_len, calls):
        return self.kept.steps(tokens, prompt_len, calls, lambda: Steps(self, tokens, prompt_len, calls))

    def prefill(self, tokens):
        release_held()  # a layer its block rows kept: this run loads each layer itself
        return super().prefill(tokens)

    def run_block(self, layer, kind, calls):
        if (kept := self.kept.block((layer, kind), calls, self.routes)) is not None:  # computed ahead (the first ask)
            return kept
        if layer is not None:  # loaded once for this block and the next ones of the layer
            hold(self.model.layers[layer]._oracle_stream)
        return super().run_block(layer, kind, calls)

"""The HF reference, whole or streamed: the same modules and weights give the same bytes."""

import tempfile
from pathlib import Path

import pytest
import torch

from models import FAMILY_NAMES, get_family
from models.checkpoint import tiny_checkpoint
from oracle.reference import capture, load_hf_model


def _tensors(ref):
    out = [*ref.logits]
    for key in ref.outputs:
        for o in ref.outputs[key]:
            out += list(o) if isinstance(o, tuple) else [o]
        out += [c.x for c in ref.inputs[key]]
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_reference_is_bitwise_the_whole_one(family):
    """Decoder layers offloaded to disk (HF's own big-model loading: accelerate hooks load each
    module's weights for its forward, the expert probes read the router inside one) capture
    exactly what the in-memory model captures: tokens, logits, every block's inputs and outputs."""
    fam = get_family(family)
    d = tiny_checkpoint(fam, 0)
    prompt = [3, 17, 99, 5, 200, 42, 7, 1]
    whole = capture(load_hf_model(fam, d), fam, prompt, 4)
    with tempfile.TemporaryDirectory() as off:
        streamed = capture(load_hf_model(fam, d, offload_dir=Path(off)), fam, prompt, 4)
        assert streamed.tokens == whole.tokens and streamed.coverage == whole.coverage
        a, b = _tensors(whole), _tensors(streamed)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

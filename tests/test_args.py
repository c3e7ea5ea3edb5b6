"""models/args.py: ModelArgs is made of one small group per mechanism; a kind outside its Literal
is refused when the args are built (naming the field and the kinds it takes), and the JSON form
(the validated-args cache) reads back to the same args for every family."""

import dataclasses
import json

import pytest

from models import FAMILY_NAMES, get_family
from models.args import (MLA, AttentionArgs, ExpertArgs, Llama3Scaling, ModelArgs, NormArgs, RopeArgs, RouterArgs,
                         YaRN)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_json_form_reads_back(family):
    fam = get_family(family)
    args = fam.args(fam.tiny_config, max_seq_len=40)
    d = json.loads(json.dumps(dataclasses.asdict(args)))
    assert isinstance(d["rope"], dict) and isinstance(d["router"], dict)  # the groups stay groups
    back = ModelArgs.from_dict(d)
    assert back == args and repr(back) == repr(args)


@pytest.mark.parametrize("build, message", [
    (lambda: RouterArgs(scoring="softmax_topk"), "RouterArgs.scoring: 'softmax_topk' is not one of 'softmax', 'sigmoid'"),
    (lambda: RouterArgs(group_score="sum"), "RouterArgs.group_score: 'sum' is not one of 'top2', 'max'"),
    (lambda: NormArgs(kind="rmsnorm"), "NormArgs.kind: 'rmsnorm' is not one of 'rms', 'layer'"),
    (lambda: AttentionArgs(qk_norm="per_head"), "AttentionArgs.qk_norm: 'per_head' is not one of"),
    (lambda: AttentionArgs(kind="mla"), "AttentionArgs.mla: None for kind 'mla'"),
    (lambda: AttentionArgs(mla=MLA(8, 8, 8, 8)), "AttentionArgs.mla: MLA("),
    (lambda: ExpertArgs(activation="gelu"), "ExpertArgs.activation: 'gelu' is not one of 'swiglu', 'clamped_swiglu'"),
    (lambda: RopeArgs(1e4, kind="dynamic"), "RopeArgs.kind: 'dynamic' is not one of 'default', 'yarn'"),
    (lambda: RopeArgs(1e4, kind="yarn"), "RopeArgs.scaling: NoneType for kind 'yarn' (wants YaRN)"),
    (lambda: RopeArgs(1e4, kind="yarn", scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192)), "wants YaRN"),
])
def test_unknown_kind_is_refused_when_built(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert message in str(e.value)


def test_layer_and_mlp_types_are_checked():
    fam = get_family("qwen3_moe")
    args = fam.args(fam.tiny_config)
    with pytest.raises(ValueError, match="ModelArgs.layer_types: 'full' is not one of 'full_attention'"):
        dataclasses.replace(args, layer_types=("full",) * args.num_hidden_layers)
    with pytest.raises(ValueError, match="ModelArgs.mlp_types: 'moe' is not one of 'sparse', 'dense'"):
        dataclasses.replace(args, mlp_types=("moe",) * args.num_hidden_layers)
    with pytest.raises(ValueError, match="ModelArgs.linear_attention: None"):
        dataclasses.replace(args, layer_types=("linear_attention",) * args.num_hidden_layers)


def test_scaled_rope_kind_follows_its_scaling():
    y = YaRN(4.0, 64)
    assert RopeArgs.scaled(1e4, y).kind == "yarn" and RopeArgs.scaled(1e4, None).kind == "default"
    assert RopeArgs.from_dict(json.loads(json.dumps(dataclasses.asdict(RopeArgs.scaled(1e4, y))))).scaling == y

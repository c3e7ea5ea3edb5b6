"""Bad input and bad candidates, table-driven: the oracle never blames the wrong party and
never dies on what it is checking.

Bad input (options, paths, checkpoints, lengths, plugins) exits 2 with one line naming the
problem, before any work, and writes no report. A malformed candidate output fails (or, if
it raised, errors) its own row; the other rows, the e2e and the gates are still measured.

The checks run in-process (`oracle.cli.main`): the same code path as the command, without
paying interpreter start-up per case; the unreadable-file case needs a process of its own.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import UNSUPPORTED, get_family
from oracle.source.seeded import tiny_checkpoint
from oracle.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"


# ------------------------------------------------------------------ checkpoint damage
def _weights(d: Path) -> dict:
    return load_file(d / "model.safetensors")


def _save(d: Path, w: dict) -> None:
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})


def nan_in_expert(d: Path) -> None:
    w = _weights(d)
    w[EXPERT][5, 7] = float("nan")
    _save(d, w)


def overflowing_expert(d: Path) -> None:
    """Finite weights whose fp32 reference overflows: expert 3 of layer 0 scaled by 1e30."""
    w = _weights(d)
    for p in ("gate_proj", "up_proj"):
        w[f"model.layers.0.mlp.experts.3.{p}.weight"] *= 1e30
    _save(d, w)


def shard_in_two(d: Path, index: bool = True) -> dict:
    """model.safetensors split into two shards (+ the index); returns the weight map."""
    w = _weights(d)
    names = sorted(w)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in parts.items():
        save_file({k: w[k] for k in keys}, d / shard, metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    weight_map = {k: s for s, keys in parts.items() for k in keys}
    if index:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def missing_shard_no_index(d: Path) -> None:
    shard_in_two(d, index=False)
    (d / "model-00002-of-00002.safetensors").unlink()


def index_names_missing_shard(d: Path) -> None:
    shard_in_two(d)
    (d / "model-00002-of-00002.safetensors").unlink()


def index_lists_absent_tensor(d: Path) -> None:
    wm = shard_in_two(d)
    wm["model.layers.9.mlp.gate.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def malformed_index(d: Path) -> None:
    shard_in_two(d)
    (d / "model.safetensors.index.json").write_text("{\"weight_map\": ")


def index_without_weight_map(d: Path) -> None:
    shard_in_two(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))


def index_names_a_path_elsewhere(d: Path) -> None:
    wm = shard_in_two(d)
    wm["model.embed_tokens.weight"] = "../../etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def duplicated_across_shards(d: Path) -> None:
    shard_in_two(d)
    first = load_file(d / "model-00001-of-00002.safetensors")
    second = load_file(d / "model-00002-of-00002.safetensors")
    second["model.embed_tokens.weight"] = first["model.embed_tokens.weight"]
    save_file(second, d / "model-00002-of-00002.safetensors", metadata={"format": "pt"})


def truncated_shard(d: Path) -> None:
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


def corrupt_shard(d: Path) -> None:
    p = d / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")  # a header length past the end of the file
    p.write_bytes(bytes(data))


def pickles_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")


def malformed_config(d: Path) -> None:
    (d / "config.json").write_text("{\"model_type\": \"olmoe\", ")


def config_not_an_object(d: Path) -> None:
    (d / "config.json").write_text("[1, 2]")


def config_not_utf8(d: Path) -> None:
    (d / "config.json").write_bytes(b"\xff\xfe{")


def config_without_model_type(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))


def config_with(**fields) -> Callable[[Path], None]:
    """config.json with these fields set (a dict value: merged into the field's dict)."""
    def damage(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in fields.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        (d / "config.json").write_text(json.dumps(cfg))
    return damage


def integer_weight(d: Path) -> None:
    w = _weights(d)
    w["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.int32)
    _save(d, w)


def missing_tensor(d: Path) -> None:
    w = _weights(d)
    del w["model.layers.1.self_attn.k_norm.weight"]
    _save(d, w)


def misshaped_tensor(d: Path) -> None:
    w = _weights(d)
    w["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    _save(d, w)


# ------------------------------------------------------------------ the table
@dataclass
class Case:
    id: str
    args: list[str]  # after `oracle`; {ckpt} is the damaged checkpoint copy, {tmp} the test's tmp dir
    exit: int
    message: str  # a substring of stderr (bad input) or of the JSON report (candidate faults)
    damage: Callable[[Path], None] | None = None
    rows: dict = field(default_factory=dict)  # (layer, kind) -> (status, substring of the row's metrics)
    report: bool = False  # True: a report is written (candidate faults); False: nothing is written


def check(*extra, family="olmoe", backend="eager"):
    return ["check", "--family", family, "--backend", backend, *extra]


def model_dir(*extra, **kw):
    return check("--model-dir", "{ckpt}", *extra, **kw)


FIRST_UNSUPPORTED = next(iter(UNSUPPORTED))

CASES = [
    # options: one schema per backend, checked before any work
    Case("option-value-not-allowed", check("--option", "partitioner=nope", backend="executorch"), 2,
         "backend executorch: --option partitioner=nope: allowed values are xnnpack, portable"),
    Case("option-unknown", check("--option", "bogus=1", backend="iree-llvm-cpu"), 2,
         "backend iree-llvm-cpu has no option 'bogus'"),
    Case("option-unknown-lists-known", check("--option", "bogus=1", backend="executorch"), 2,
         "known: partitioner, qlinear, qlinear_group_size, sample"),
    Case("option-ill-typed", check("--option", "group_size=big", "--precision", "q4", backend="mlx"), 2,
         "backend mlx: --group-size: expected int, got 'big'"),
    Case("option-export-only", check("--option", "qlinear=8da4w", backend="executorch"), 2,
         "applies to `oracle export`, not `oracle check`"),
    Case("option-not-key-value", check("--option", "partitioner"), 2, "--option expects KEY=VALUE"),
    Case("option-harness-owned", check("--option", "sampling=1"), 2, "set by the harness; use --sampling"),
    Case("option-on-eager", check("--group-size", "32"), 2, "backend eager has no option 'group_size'"),
    Case("device-on-eager", check("--option", "device=gpu"), 2, "device=gpu: allowed values are cpu, cuda"),
    Case("group-size-at-fp32", check("--group-size", "32", backend="mlx"), 2, "--group-size applies to q8/q4"),
    Case("device-gpu-without-one", check("--device", "gpu", backend="mlx"), 2, "mlx has no GPU backend"),
    Case("sampling-top-p", check("--sampling", "--top-p", "1.5"), 2, "top_p"),
    # output paths, before any work
    Case("json-unwritable", check("--json", "/proc/forbidden/r.json"), 2, "--json: cannot write /proc/forbidden/r.json"),
    Case("markdown-is-a-directory", check("--markdown", "{tmp}"), 2, "--markdown: {tmp} is a directory"),
    Case("json-under-a-file", check("--json", "{tmp}/afile/r.json"), 2, "--json: cannot write {tmp}/afile/r.json"),
    Case("matrix-report-dir-unwritable", ["matrix", "--families", "olmoe", "--report-dir", "/proc/forbidden/m"], 2,
         "--report-dir: cannot write /proc/forbidden/m"),
    Case("selftest-json-unwritable", ["selftest", "--family", "olmoe", "--json", "/proc/forbidden/s.json"], 2,
         "--json: cannot write"),
    # families, backends, precisions, lengths, plugins
    Case("unknown-family", check(family="llama"), 2, "unknown family 'llama'; known: qwen3_5_moe"),
    Case("deferred-family", check(family=FIRST_UNSUPPORTED), 2, f"family {FIRST_UNSUPPORTED!r} is not supported yet"),
    Case("unknown-backend", check(backend="nosuch"), 2, "unknown backend 'nosuch'"),
    Case("unknown-precision", check("--precision", "fp8"), 2, "unknown precision 'fp8'"),
    Case("precision-not-of-backend", check("--precision", "q4"), 2, "backend eager does not support precision q4"),
    Case("plugin-unimportable", check(backend="no_such_pkg.mod:BACKEND"), 2, "cannot import module 'no_such_pkg.mod'"),
    Case("plugin-attribute-missing", check(backend="examples.fp64_backend:NOPE"), 2, "has no attribute 'NOPE'"),
    Case("plugin-missing-protocol-member", check(backend="tests.plugins:NO_LOAD"), 2, "has no 'load'"),
    Case("prompt-len-zero", check("--prompt-len", "0"), 2, "must be a positive integer, got 0"),
    Case("decode-tokens-negative", check("--decode-tokens", "-3"), 2, "must be a positive integer, got -3"),
    Case("past-max-position-embeddings", model_dir("--prompt-len", "200", "--decode-tokens", "100"), 2,
         "prompt-len + decode-tokens = 300 exceeds max_position_embeddings 256"),
    # checkpoints
    Case("nan-in-expert-weight", model_dir(), 2, f"checkpoint tensor {EXPERT} in model.safetensors has 1 NaN/Inf",
         nan_in_expert),
    Case("reference-overflows", model_dir(), 2,
         "the HF fp32 reference itself produces NaN/Inf, first at layer 0 moe", overflowing_expert),
    Case("shard-missing-no-index", model_dir(), 2, "shard(s) missing: model-00002-of-00002.safetensors",
         missing_shard_no_index),
    Case("index-names-missing-shard", model_dir(), 2,
         "shard(s) listed in the index are missing: model-00002-of-00002.safetensors", index_names_missing_shard),
    Case("index-lists-absent-tensor", model_dir(), 2, "listed but not in any shard, e.g. model.layers.9.mlp.gate",
         index_lists_absent_tensor),
    Case("index-malformed", model_dir(), 2, "model.safetensors.index.json: unreadable index", malformed_index),
    Case("index-weight-map-not-an-object", model_dir(), 2,
         'unreadable index (no "weight_map" of tensor names to shard files)', index_without_weight_map),
    Case("index-names-a-path-elsewhere", model_dir(), 2,
         "shard '../../etc/passwd' is not the name of a .safetensors file beside it", index_names_a_path_elsewhere),
    Case("tensor-in-two-shards", model_dir(), 2, "tensor model.embed_tokens.weight is in two shards",
         duplicated_across_shards),
    Case("shard-truncated", model_dir(), 2, "truncated or corrupt safetensors file", truncated_shard),
    Case("shard-corrupt", model_dir(), 2, "truncated or corrupt safetensors file", corrupt_shard),
    Case("pickles-only", model_dir(), 2, "refused, safetensors only", pickles_only),
    Case("wrong-family-config", model_dir(family="mixtral"), 2,
         "model_type 'olmoe', not a mixtral checkpoint (that is family 'olmoe')"),
    Case("config-malformed", model_dir(), 2, "config.json: not valid JSON", malformed_config),
    Case("config-without-model-type", model_dir(), 2, "no 'model_type' key", config_without_model_type),
    Case("config-not-an-object", model_dir(), 2, "config.json: expected a JSON object, got list", config_not_an_object),
    Case("config-not-utf8", model_dir(), 2, "config.json: not UTF-8 text", config_not_utf8),
    Case("goldens-unknown-family", ["goldens", "check", "--family", "llama"], 2, "unknown family 'llama'"),
    # configs: types and consistency, per family, before any work (the file and the field named)
    Case("config-top-k-over-experts", model_dir(), 2,
         "{ckpt}/config.json: num_experts_per_tok (9) must be at most num_experts (8)", config_with(num_experts_per_tok=9)),
    Case("config-kv-heads-do-not-divide", model_dir(), 2,
         "config.json: num_attention_heads (4) must be a multiple of num_key_value_heads (3)",
         config_with(num_key_value_heads=3)),
    Case("config-size-zero", model_dir(), 2, "config.json: hidden_size must be positive, got 0", config_with(hidden_size=0)),
    Case("config-size-negative", model_dir(), 2, "config.json: num_experts must be positive, got -8",
         config_with(num_experts=-8)),
    Case("config-wrong-type", model_dir(), 2, "config.json: hidden_size: expected int, got str (value: '64')",
         config_with(hidden_size="64")),
    Case("config-deeper-than-checkpoint", model_dir(), 2,
         "config.json: num_hidden_layers 1000000000: the checkpoint has tensors of 2 layer(s)",
         config_with(num_hidden_layers=10**9)),
    Case("config-rope-theta-negative", model_dir(), 2, "config.json: rope_parameters.rope_theta must be positive, got -1",
         config_with(rope_parameters={"rope_theta": -1})),
    Case("config-rope-type-unsupported", model_dir(), 2, "config.json: rope_type 'dynamic' is not supported yet",
         config_with(rope_parameters={"rope_type": "dynamic", "factor": 2.0})),
    Case("config-hf-cannot-build", model_dir(), 2,  # HF's config class takes it, its model cannot be built
         "transformers cannot build OlmoeForCausalLM from {ckpt}/config.json (KeyError: 'swishy')",
         config_with(hidden_act="swishy")),
    Case("config-model-type-not-a-string", model_dir(), 2, "config.json: model_type must be a string, got 5",
         config_with(model_type=5)),
    Case("integer-weight", model_dir(), 2,
         "tensor layers.0.self_attn.q_proj.weight has dtype torch.int32, expected a floating-point tensor",
         integer_weight),
    Case("tensor-missing", model_dir(), 2, "missing tensor(s): layers.1.self_attn.k_norm.weight", missing_tensor),
    Case("tensor-misshaped", model_dir(), 2, "o_proj.weight has shape (64, 32), expected (64, 64)", misshaped_tensor),
    Case("config-missing", model_dir(), 2, "no config.json (expected an HF save_pretrained directory)",
         lambda d: (d / "config.json").unlink()),
    Case("model-dir-absent", check("--model-dir", "{tmp}/nowhere"), 2, "not a directory"),
    Case("family-missing-tiny", ["check", "--backend", "eager"], 2,
         "--family is required with the tiny checkpoint (or give --model-dir / --config)"),
    Case("family-unknown-model-type", ["check", "--backend", "eager", "--model-dir", "{ckpt}"], 2,
         "no family reads model_type 'longcat_flash': not supported yet, missing zero-computation experts",
         lambda d: (d / "config.json").write_text('{"model_type": "longcat_flash"}')),
    # candidate faults: that row fails (or errors), everything else is still measured
    Case("router-k-minus-1", check(backend="tests.plugins:ROUTER_K_MINUS_1"), 1,
         "call 0: weights shape [8, 1] vs reference [8, 2]", report=True,
         rows={(0, "router"): ("fail", "shape [8, 1] vs reference [8, 2]"), (1, "router"): ("pass", "")}),
    Case("foreign-arrays-accepted", check(backend="tests.plugins:FOREIGN_ARRAYS"), 0, '"status": "pass"',
         report=True, rows={(0, "router"): ("pass", ""), (0, "moe"): ("pass", ""), (1, "layer"): ("pass", "")}),
    Case("block-raises", check(backend="tests.plugins:RAISES_IN_ONE_BLOCK"), 1,
         "kernel launch failed", report=True,
         rows={(1, "attention"): ("error", "RuntimeError: kernel launch failed"), (1, "moe"): ("pass", "")}),
    Case("none-for-one-call", check(backend="tests.plugins:NONE_FOR_ONE_CALL"), 1, "call 2: None", report=True,
         rows={(0, "moe"): ("fail", "call 2: None where an array is expected"), (0, "router"): ("pass", "")}),
    Case("tuple-for-tensor", check(backend="tests.plugins:TUPLE_FOR_TENSOR"), 1, "a tuple of 2", report=True,
         rows={(0, "attention"): ("fail", "call 0: a tuple of 2 where one array is expected")}),
    Case("one-call-short", check(backend="tests.plugins:ONE_CALL_SHORT"), 1, "output(s) for", report=True,
         rows={(1, "layer"): ("fail", "8 output(s) for 9 call(s)")}),
    Case("e2e-logits-wrong-shape", check(backend="tests.plugins:DECODE_DROPS_LAST_LOGIT"), 1,
         "the last dimension must be the vocabulary (256)", report=True, rows={(0, "moe"): ("pass", "")}),
    Case("e2e-decode-raises", check(backend="tests.plugins:DECODE_RAISES"), 1,
         "step 3 (decode): RuntimeError: device lost", report=True, rows={(1, "layer"): ("pass", "")}),
    Case("every-block-raises", check(backend="tests.plugins:EVERY_BLOCK_RAISES"), 4,
         "every block raised; the first: 0 attention: RuntimeError", report=True),
]


def _fill(args: list[str], ckpt: Path, tmp: Path) -> list[str]:
    return [a.replace("{ckpt}", str(ckpt)).replace("{tmp}", str(tmp)) for a in args]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse and fail_input exit this way
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(get_family("olmoe"), 0), d)
    return d


def test_at_least_25_cases():
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # `tests.plugins` and `examples` import from the checkout
    if str(ROOT) not in sys.path:
        monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / "afile").write_text("a file, not a directory")
    if case.damage:
        case.damage(ckpt)
    report = tmp_path / "out" / "r.json"
    args = _fill(case.args, ckpt, tmp_path)
    if args[0] == "check" and "--json" not in args:
        args += ["--json", str(report)]
    code, out, err = run_main(args, capsys)
    message = _fill([case.message], ckpt, tmp_path)[0]
    assert code == case.exit, (out, err)
    if code != 4:  # a backend error prints the backend's own traceback; nothing else may
        assert "Traceback" not in err
    if not case.report:
        assert message in err, err
        assert len(err.strip().splitlines()) == 1, err  # one line, naming the problem
        # nothing written (the report's directory may have been created by the path check)
        assert not report.exists() and not [p for p in tmp_path.joinpath("out").rglob("*") if p.is_file()]
        return
    text = report.read_text()
    assert message in text
    doc = json.loads(text)
    rows = {(b["layer"], b["kind"]): b for b in doc["blocks"]}
    for key, (status, needle) in case.rows.items():
        assert rows[key]["status"] == status, rows[key]
        assert needle in json.dumps(rows[key]["metrics"])
    if case.exit == 1:  # contained: every row and the e2e were measured
        assert len(rows) == 10 and doc["e2e"] is not None and doc["error"] is None
        assert all(r["status"] in ("pass", "fail", "error") for r in rows.values())
        broken = [k for k, (s, _) in case.rows.items() if s != "pass"]
        if broken:
            assert (doc["worst"]["layer"], doc["worst"]["kind"]) == broken[0]


def test_unreadable_shard_is_bad_input(ckpt, tmp_path):
    """A shard the user cannot read (permissions): exit 2 naming the file. Root reads anything,
    so as root the check runs without the capabilities that let it (CAP_DAC_*)."""
    shard = ckpt / "model.safetensors"
    shard.chmod(0)
    def preexec():
        if os.geteuid() != 0:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, out of the bounding set
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                os._exit(77)
    report = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "oracle", "check", "--family", "olmoe", "--backend", "eager",
                        "--model-dir", str(ckpt), "--json", str(report)], cwd=ROOT, env=env,
                       capture_output=True, text=True, preexec_fn=preexec, timeout=300)
    if r.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here")
    assert r.returncode == 2, r.stderr
    assert f"{shard}: cannot read (Permission denied)" in r.stderr
    assert "Traceback" not in r.stderr and not report.exists()


def test_model_too_big_for_the_memory_is_refused(ckpt, tmp_path, capsys, monkeypatch):
    """A backend that would need more memory than there is refuses with exit 2 and its
    estimate, before the reference or any build: never an out-of-memory kill mid-build."""
    import oracle.memory

    monkeypatch.setattr(oracle.memory, "available_memory", lambda: 100 << 20)
    report = tmp_path / "out" / "r.json"
    code, out, err = run_main(["check", "--family", "olmoe", "--backend", "executorch", "--model-dir", str(ckpt),
                               "--json", str(report)], capsys)
    assert code == 2 and not report.exists(), err
    assert "executorch --precision fp32 would need about 2.0 GiB" in err and "0.1 GiB is available" in err, err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv("MOE_ORACLE_MEMORY_CHECK", "off")  # the user's override: the check runs
    code, out, err = run_main(["check", "--family", "olmoe", "--backend", "eager", "--model-dir", str(ckpt),
                               "--json", str(report)], capsys)
    assert code == 0 and report.exists(), err


# ------------------------------------------------------------------ config rules, per family
# each family's rules (models.COMMON_RULES + what its FAMILY declares), broken one at a time on its
# tiny config: the message names the config.json fields and their values
FAMILY_RULES = [
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok (9) must be at most num_local_experts (8)"),
    ("ernie4_5_moe", {"moe_k": 9}, "moe_k (9) must be at most moe_num_experts (8)"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group (5) must be at most n_group (4)"),
    ("deepseek_v3", {"n_group": 3}, "n_routed_experts (8) must be a multiple of n_group (3)"),
    ("glm4_moe", {"first_k_dense_replace": 7}, "first_k_dense_replace (7) must be within 0..num_hidden_layers (3)"),
    ("qwen3_5_moe", {"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries, num_hidden_layers is 4"),
    ("qwen3_5_moe", {"linear_num_key_heads": 3},
     "linear_num_value_heads (4) must be a multiple of linear_num_key_heads (3)"),
    ("qwen3_next", {"mlp_only_layers": [4]}, "mlp_only_layers names layer 4, outside 0..3 (num_hidden_layers 4)"),
    ("llama4", {"no_rope_layers": [1, 1]}, "no_rope_layers has 2 entries, num_hidden_layers is 4"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "rope_parameters.partial_rotary_factor (1.5) must be in (0, 1]"),
    ("phimoe", {"num_local_experts": 1, "num_experts_per_tok": 1}, "num_local_experts (1) must be at least 2"),
    ("granitemoe", {"logits_scaling": 0.0}, "logits_scaling must be positive, got 0.0"),
]


@pytest.mark.parametrize("family,fields,message", FAMILY_RULES, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in FAMILY_RULES])
def test_family_config_rule(family, fields, message):
    from models.checkpoint import CheckpointError

    f = get_family(family)
    f.args(f.tiny_config)  # the tiny config itself keeps every rule
    with pytest.raises(CheckpointError) as e:
        f.args({**f.tiny_config, **fields})
    assert str(e.value) == message


def test_inconsistent_config_is_refused_before_a_checkpoint_is_written(tmp_path, capsys):
    """--config a config.json of your own: checked before its seeded checkpoint is built."""
    f = get_family("deepseek_v3")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**f.tiny_config, "model_type": "deepseek_v3", "topk_group": 5}))
    code, out, err = run_main(["check", "--backend", "eager", "--config", str(path)], capsys)
    assert code == 2 and err == f"oracle: error: --config {path}: topk_group (5) must be at most n_group (4)\n", err


def test_damaged_saved_reference_is_refused(tmp_path, capsys):
    """A saved reference is what `oracle reference save` wrote, byte for byte (provenance.json
    records each file's sha256), or bad input: never a traceback from a structure it lacks."""
    ref = tmp_path / "ref"
    code, out, err = run_main(["reference", "save", "--family", "olmoe", "--out", str(ref)], capsys)
    assert code == 0, err
    (ref / "reference.json").write_text((ref / "reference.json").read_text().replace('"calls"', '"kalls"'))
    code, out, err = run_main(check("--reference", str(ref)), capsys)
    assert code == 2 and err == (f"oracle: error: --reference {ref}/reference.json: changed or damaged since it was "
                                 "saved (not the sha256 provenance.json records)\n"), err
    meta = json.loads((ref / "provenance.json").read_text())
    (ref / "provenance.json").write_text(json.dumps({**meta, "format": 1}))
    code, out, err = run_main(check("--reference", str(ref)), capsys)
    assert code == 2 and "format 1, this version reads 2 (save it again with `oracle reference save`)" in err, err


def test_validate_only_checks_every_input_and_runs_nothing(ckpt, tmp_path, capsys):
    """--validate-only: the same refusals as a check (exit 2, one line), or exit 0, one line saying what the check
    will need (memory, cache), and no report."""
    report = tmp_path / "r.json"
    code, out, err = run_main(["check", "--backend", "eager", "--model-dir", str(ckpt), "--json", str(report),
                               "--validate-only"], capsys)
    assert (code, err) == (0, "") and not report.exists()
    assert out.startswith("oracle: inputs valid (olmoe on eager): the check's memory about ") and out.count("\n") == 1
    assert "of cache beside the checkpoint" in out, out
    config_with(num_experts_per_tok=9)(ckpt)
    code, out, err = run_main(["check", "--backend", "eager", "--model-dir", str(ckpt), "--validate-only"], capsys)
    assert code == 2 and err == (f"oracle: error: {ckpt}/config.json: num_experts_per_tok (9) must be at most "
                                 "num_experts (8)\n"), err

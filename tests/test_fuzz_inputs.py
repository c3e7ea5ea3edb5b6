"""Every input the oracle reads, fuzzed: hypothesis mutates config.json (types, missing keys, zeros,
negatives, huge values, wrong model_type), safetensors headers (dtype, shape, offsets, the header's
length, truncation), the shard index, .pte / .vmfb bytes (and their weights and manifest), saved
references and prompts files, and runs `oracle check` on each.

Every case ends in exit 0, 1 or 2, with a report (0, 1) or one line naming the problem (2): never a
traceback (an exception escaping oracle.cli.main fails the case, and hypothesis shrinks it to the
smallest input that does it), an abort or a hang (HANG_S per case). A crash found here is fixed in
the code, with a clear message and exit 2, not in this file.

The checks run in-process (oracle.cli.main): a tiny checkpoint checks in about a tenth of a second
once warm. A check of a given program (--pte / --vmfb) runs `oracle check` in a child process
itself (exporters/shared/given.py: a program can crash its runtime), so those cases cost seconds each.

Budget: ORACLE_FUZZ_EXAMPLES cases per input (default SHORT, a third of it for the given programs;
derandomized: the same cases in every `make test`, 15-45 s for this file on 2 cores once the
programs are built, the first run filling the reference cache); the nightly workflow sets a long
budget, and then hypothesis draws new cases every night.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from models import FAMILY_NAMES, get_family
from oracle.source.seeded import tiny_checkpoint
from oracle.cli import main

SHORT = 10
EXAMPLES = int(os.environ.get("ORACLE_FUZZ_EXAMPLES", SHORT))
HANG_S = 300  # one case; the slowest legitimate one (a given program loaded twice, one child) takes seconds
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="ORACLE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# a case of a given program runs `oracle check` in a child process (exporters/shared/given.py: 3-5 s here)
GIVEN = settings(FUZZ, max_examples=max(2, EXAMPLES // 3))
FAMILIES = ("olmoe", "deepseek_v3", "qwen3_5_moe")  # plain attention; MLA + grouped routing; Gated DeltaNet


# ------------------------------------------------------------------ running the CLI
@contextlib.contextmanager
def time_limit(seconds: int):
    def hang(signum, frame):
        raise TimeoutError(f"a case ran past {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def oracle(*argv) -> tuple[int, str, str]:
    """`oracle ARGV` in-process: (exit code, stdout, stderr). Any exception other than SystemExit
    escapes: the traceback a user would have seen."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_limit(HANG_S):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def check_ends_cleanly(report: Path, *argv) -> int:
    """`oracle check ARGV --json REPORT`, asserting the contract; returns the exit code."""
    code, out, err = oracle("check", *argv, "--json", report)
    event(f"exit {code}")  # --hypothesis-show-statistics: how the cases ended
    assert code in (0, 1, 2), f"exit {code}: {err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(("oracle: error: ", "oracle check: error: ")), err
        assert not report.exists()
    else:
        assert json.loads(report.read_text())["status"] in ("pass", "fail", "xfail"), err
    return code


# ------------------------------------------------------------------ what mutations are made of
# the values a field is set to: wrong types, zeros, negatives, huge values, non-finite floats
VALUES = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 3, 7, 255, 2**31, 2**63, 10**30, -10**9, 0.5, 1e-30, 1e30]),
    st.integers(), st.floats(), st.text(max_size=6), st.lists(st.integers(-2, 8), max_size=6),
    st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "factor", "x"]),
                    st.one_of(st.integers(-3, 10**6), st.floats(), st.text(max_size=5)), max_size=3),
)
MODEL_TYPES = st.sampled_from(sorted({t for f in FAMILY_NAMES for t in get_family(f).model_types}
                                     | {"llama", "jamba", "", "OLMOE"}))
DELETE = object()


def paths(doc, prefix=(), depth: int = 3) -> list[tuple]:
    """Every key / index path into a JSON document (lists: their first four items)."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc[:4]) if isinstance(doc, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        if depth > 1:
            out += paths(v, prefix + (k,), depth - 1)
    return out


@st.composite
def mutated_json(draw, doc, special: dict | None = None):
    """`doc` with one to three of its fields set to another value, deleted, or a field added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        ps = paths(doc)
        if not ps or draw(st.integers(0, 9)) == 0:  # now and then a new field, or a document that is not an object
            if isinstance(doc, dict) and draw(st.booleans()):
                doc[draw(st.text(min_size=1, max_size=6))] = draw(VALUES)
            else:
                doc = draw(VALUES)
            continue
        p = draw(st.sampled_from(ps))
        parent = doc
        for k in p[:-1]:
            parent = parent[k]
        value = draw(st.one_of(st.just(DELETE), (special or {}).get(p[-1], VALUES), VALUES, nudged(parent[p[-1]])))
        if value is DELETE:
            del parent[p[-1]]
        else:
            parent[p[-1]] = value
    return doc


def nudged(v):
    """A value near `v` (a number scaled or moved by one, a flag flipped): often still valid, so that
    cases also reach the reference and the candidate, not only the refusals."""
    if isinstance(v, bool):
        return st.just(not v)
    if isinstance(v, (int, float)):
        return st.sampled_from([v + 1, v - 1, v * 2, v / 2 if isinstance(v, float) else v // 2, -v])
    return VALUES


def json_bytes(doc) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


@st.composite
def byte_damage(draw, size: int, head: int = 64):
    """How to damage a file of `size` bytes (a small value: what hypothesis prints of a failing case):
    ("truncate", n), ("write", [(offset, byte), ...]) often in its header, or ("random", bytes)."""
    how = draw(st.sampled_from(["truncate", "write", "write_head", "random"]))
    if how == "truncate":
        return how, draw(st.integers(0, max(size - 1, 0)))
    if how == "random":
        return how, draw(st.binary(max_size=4096))
    top = min(head, size) if how == "write_head" else size
    return "write", draw(st.lists(st.tuples(st.integers(0, top - 1), st.integers(0, 255)), min_size=1, max_size=16))


def damaged(data: bytes, damage: tuple) -> bytes:
    how, what = damage
    if how == "truncate":
        return data[:what]
    if how == "random":
        return what
    out = bytearray(data)
    for at, byte in what:
        out[at] = byte
    return bytes(out)


@st.composite
def damaged_bytes(draw, data: bytes, head: int = 64):
    return damaged(data, draw(byte_damage(len(data), head)))


@st.composite
def damaged_safetensors(draw, data: bytes):
    """A safetensors file with its header's JSON mutated (dtype, shape, data_offsets, entries), its
    header length wrong, or the file damaged as bytes."""
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    how = draw(st.sampled_from(["entry", "entry", "length", "bytes"]))
    if how == "bytes":
        return damaged(data, draw(byte_damage(len(data), head=8 + n)))
    if how == "length":
        return draw(st.sampled_from([0, 1, n - 1, n + 1, len(data), 2**63, 2**64 - 1])).to_bytes(8, "little") + data[8:]
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    special = {"dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I8", "BOOL", "U8", "F8_E4M3", "Q4", ""]),
               "shape": st.lists(st.sampled_from([0, 1, 2, 8, 64, -1, 2**40]), max_size=4),
               "data_offsets": st.lists(st.sampled_from([0, 1, 4, len(body) // 2, len(body), len(body) + 4, -4, 2**64]),
                                        min_size=0, max_size=3)}
    if draw(st.integers(0, 5)) == 0:
        del header[name]
    else:
        header[name] = draw(mutated_json(header[name], special))
    raw = json_bytes(header)
    return len(raw).to_bytes(8, "little") + raw + body


# ------------------------------------------------------------------ inputs to start from
@pytest.fixture(scope="module")
def tiny() -> dict:
    return {f: tiny_checkpoint(get_family(f), 0) for f in FAMILIES}


@contextlib.contextmanager
def workspace(src: Path | None = None):
    """A fresh directory (with a copy of the checkpoint `src` as ckpt/) for one case."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as d:
        d = Path(d)
        if src is not None:
            shutil.copytree(src, d / "ckpt")
        yield d


# ------------------------------------------------------------------ config.json
@FUZZ
@given(data=st.data())
def test_config_json(tiny, data):
    family = data.draw(st.sampled_from(FAMILIES))
    cfg = json.loads((tiny[family] / "config.json").read_text())
    doc = data.draw(mutated_json(cfg, {"model_type": MODEL_TYPES}))
    name_family = data.draw(st.booleans())
    with workspace(tiny[family]) as d:
        (d / "ckpt" / "config.json").write_bytes(json_bytes(doc))
        check_ends_cleanly(d / "r.json", "--backend", "eager", "--model-dir", d / "ckpt",
                           *(["--family", family] if name_family else []))


# ------------------------------------------------------------------ safetensors headers
@FUZZ
@given(data=st.data())
def test_safetensors_header(tiny, data):
    family = data.draw(st.sampled_from(FAMILIES))
    shard = tiny[family] / "model.safetensors"
    bad = data.draw(damaged_safetensors(shard.read_bytes()))
    with workspace(tiny[family]) as d:
        (d / "ckpt" / "model.safetensors").write_bytes(bad)
        check_ends_cleanly(d / "r.json", "--backend", "eager", "--model-dir", d / "ckpt")


# ------------------------------------------------------------------ the shard index
@pytest.fixture(scope="module")
def sharded(tiny, tmp_path_factory) -> Path:
    """Tiny OLMoE in two shards with model.safetensors.index.json (as save_pretrained shards)."""
    from tests.test_bad_inputs import shard_in_two

    d = tmp_path_factory.mktemp("sharded") / "ckpt"
    shutil.copytree(tiny["olmoe"], d)
    shard_in_two(d)
    return d


@FUZZ
@given(data=st.data())
def test_index_file(sharded, data):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = st.sampled_from(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                              "model-00003-of-00002.safetensors", "../config.json", "", "/etc/passwd", "config.json"])
    special = {k: shards for k in index["weight_map"]}
    raw = data.draw(st.one_of(st.builds(json_bytes, mutated_json(index, special)),
                              damaged_bytes(json_bytes(index))))
    with workspace(sharded) as d:
        (d / "ckpt" / "model.safetensors.index.json").write_bytes(raw)
        check_ends_cleanly(d / "r.json", "--backend", "eager", "--model-dir", d / "ckpt")


# ------------------------------------------------------------------ given programs (.pte, .vmfb)
def exported(backend: str, runtime: str, name: str, spec: dict, tmp_path_factory, **options) -> tuple[Path, list]:
    """(the directory `oracle export` writes for a check of `spec`, the check's arguments): the programs
    tests/test_given_programs.py exports, by its own helper (the same cached artifacts, which other files build)."""
    from oracle.backend import CheckSpec
    from tests import test_given_programs as given

    s = CheckSpec(backend=backend, **spec)
    program = given.exported(tmp_path_factory, backend, runtime, name, spec, **options)
    return program.parent, ["--family", s.family, "--prompt-len", str(s.prompt_len), "--decode-tokens", str(s.decode_tokens)]


@pytest.fixture(scope="module")
def pte_dir(tmp_path_factory) -> tuple[Path, list]:
    from tests.test_given_programs import PTE

    return exported("executorch", "executorch.runtime", "model.pte", PTE, tmp_path_factory, partitioner="portable")


@pytest.fixture(scope="module")
def vmfb_dir(tmp_path_factory) -> tuple[Path, list]:
    from tests.test_given_programs import VMFB

    return exported("iree-llvm-cpu", "iree.runtime", "model.vmfb", VMFB, tmp_path_factory)


def given_program(data, exported: tuple, program: str, weights: str, backend: str, flag: str):
    """One of the program, its weights file or its manifest damaged; `oracle check --FLAG`."""
    program_dir, argv = exported
    target = data.draw(st.sampled_from([program, program, weights, "manifest.json"]))
    raw = (program_dir / target).read_bytes()
    if target == "manifest.json":
        bad = data.draw(st.one_of(st.builds(json_bytes, mutated_json(json.loads(raw))), damaged_bytes(raw)))
    else:
        bad = damaged(raw, data.draw(byte_damage(len(raw))))
    with workspace() as d:
        shutil.copytree(program_dir, d / "prog")
        (d / "prog" / target).write_bytes(bad)
        check_ends_cleanly(d / "r.json", *argv, "--backend", backend, flag, d / "prog" / program)


@GIVEN
@given(data=st.data())
def test_pte_bytes(pte_dir, data):
    given_program(data, pte_dir, "model.pte", "model.ptd", "executorch", "--pte")


@GIVEN
@given(data=st.data())
def test_vmfb_bytes(vmfb_dir, data):
    given_program(data, vmfb_dir, "model.vmfb", "model.irpa", "iree-llvm-cpu", "--vmfb")


# ------------------------------------------------------------------ saved references
@pytest.fixture(scope="module")
def saved_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "olmoe"
    code, _, err = oracle("reference", "save", "--family", "olmoe", "--out", out)
    assert code == 0, err
    return out


@FUZZ
@given(data=st.data())
def test_saved_reference(saved_reference, data):
    target = data.draw(st.sampled_from(["provenance.json", "reference.json", "reference.safetensors"]))
    raw = (saved_reference / target).read_bytes()
    if target == "reference.safetensors":
        bad = data.draw(damaged_safetensors(raw))
    else:
        bad = data.draw(st.one_of(st.builds(json_bytes, mutated_json(json.loads(raw))), damaged_bytes(raw)))
    with workspace() as d:
        shutil.copytree(saved_reference, d / "ref")
        (d / "ref" / target).write_bytes(bad)
        check_ends_cleanly(d / "r.json", "--family", "olmoe", "--backend", "eager", "--reference", d / "ref")


# ------------------------------------------------------------------ prompts files
@pytest.fixture(scope="module")
def with_tokenizer(tiny, tmp_path_factory) -> Path:
    """Tiny OLMoE with a byte-level tokenizer (256 byte tokens: its vocabulary), as tests/test_prompts.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok") / "olmoe"
    shutil.copytree(tiny["olmoe"], d)
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(d))
    return d


TEXT = st.text(st.characters(blacklist_characters="\n\r"), min_size=1, max_size=30)
LINE = st.one_of(
    TEXT, TEXT,  # plain prompts twice as often: cases that tokenize and check, not only refusals
    st.builds(lambda v: json.dumps(v), st.one_of(st.fixed_dictionaries({"text": VALUES}),
                                                  st.fixed_dictionaries({"prompt": VALUES}), VALUES)),
    st.builds(lambda s: "{" + s, st.text(max_size=10)),
    st.just("x" * 300),  # longer than the positions with the decode steps
)


@FUZZ
@given(content=st.one_of(st.builds(lambda ls: "\n".join(ls).encode(), st.lists(LINE, min_size=1, max_size=4)),
                         st.binary(max_size=64)))
def test_prompts_file(with_tokenizer, content):
    with workspace() as d:
        (d / "prompts.txt").write_bytes(content)
        check_ends_cleanly(d / "r.json", "--backend", "eager", "--model-dir", with_tokenizer,
                           "--prompts", d / "prompts.txt")

"""One check: checkpoint -> HF fp32 reference -> candidate -> block rows, e2e, gates -> CheckResult."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from models import FAMILY_NAMES, UNSUPPORTED, family_for_model_type, get_family
from models.checkpoint import CheckpointError, dir_digest, read_config, read_weights, tiny_checkpoint
from oracle import goldens as golden_files
from oracle import thresholds
from oracle.backend import BackendError, CheckSpec, ModelSource, resolve
from oracle.distribution import distribution_metrics, judge_distribution
from oracle.metrics import as_f64, router_metrics, tensor_metrics, top2_margin
from oracle.reference import LAYER_KINDS, MODEL_KINDS, capture, load_hf_model
from oracle.sampling import sampling_gates
from oracle.result import E2E, BlockRow, CheckResult, GateRow, worst_row

PACKAGES = ("torch", "transformers", "safetensors", "numpy", "executorch", "iree-base-compiler",
            "iree-base-runtime", "iree-turbine", "mlx", "mlx-lm", "moe-oracle")


class InputError(ValueError):
    """Bad input: the CLI prints the message and exits 2; nothing is written."""


def provenance(spec: CheckSpec) -> dict:
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "versions": versions,
        "python": platform.python_version(),
        "host": {"name": platform.node(), "machine": platform.machine(), "system": platform.system(),
                 "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "seed": spec.seed,
        "thresholds_sha256": hashlib.sha256(thresholds.DEFAULT_PATH.read_bytes()).hexdigest(),
    }


def validate(spec: CheckSpec):
    """Everything about the spec that can be refused before any work; returns the backend."""
    if spec.family not in FAMILY_NAMES:
        if spec.family in UNSUPPORTED:
            raise InputError(f"family {spec.family!r} is not supported yet: missing {UNSUPPORTED[spec.family]}")
        raise InputError(f"unknown family {spec.family!r}; known: {', '.join(FAMILY_NAMES)}")
    for name in ("prompt_len", "decode_tokens"):
        if getattr(spec, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(spec, name)}")
    if spec.precision not in thresholds.precisions():
        raise InputError(f"unknown precision {spec.precision!r}; known: {', '.join(thresholds.precisions())}")
    try:
        backend = resolve(spec.backend)
    except BackendError as e:
        raise InputError(str(e)) from None
    supported = getattr(backend, "precisions", None)
    if supported is not None and spec.precision not in supported:
        raise InputError(f"backend {spec.backend} does not support precision {spec.precision} "
                         f"(supports {', '.join(supported)})")
    check_options = getattr(backend, "check_options", None)
    problem = check_options(spec) if check_options else None
    if problem:
        raise InputError(f"backend {spec.backend}: {problem}")
    return backend


def model_source(spec: CheckSpec) -> ModelSource:
    family = get_family(spec.family)
    try:
        model_dir = Path(spec.model_dir) if spec.model_dir else tiny_checkpoint(family, spec.seed)
        config = read_config(model_dir)
        mt = config["model_type"]
        if mt not in family.model_types:
            other = family_for_model_type(mt)
            hint = f" (that is family {other!r})" if other else (
                f" (not supported yet: missing {UNSUPPORTED[mt]})" if mt in UNSUPPORTED else "")
            raise InputError(f"{model_dir}/config.json has model_type {mt!r}, not a {spec.family} checkpoint{hint}")
        max_len = spec.prompt_len + spec.decode_tokens
        limit = config.get("max_position_embeddings")
        if limit and max_len > limit:
            raise InputError(f"prompt-len + decode-tokens = {max_len} exceeds max_position_embeddings {limit}")
        # every tensor checked (names, shapes, shards) before any expensive work
        args = family.validate(config, read_weights(model_dir), max_seq_len=max_len)
        return ModelSource(family, model_dir, config, args, dir_digest(model_dir))
    except CheckpointError as e:
        raise InputError(str(e)) from None


def prompt_tokens(spec: CheckSpec, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(spec.seed)
    return torch.randint(0, vocab, (spec.prompt_len,), generator=gen).tolist()


@functools.lru_cache(maxsize=4)
def reference_for(family_name: str, model_dir: str, sha: str, prompt: tuple, n: int):
    """The HF reference for this checkpoint and prompt: in memory, else from the disk cache
    (keyed by the checkpoint's sha256, prompt, steps, and the code and versions that capture
    it), else captured and saved."""
    from oracle import reference
    from oracle.artifacts import key_of, versions
    from models.checkpoint import cache_root

    code = hashlib.sha256(Path(reference.__file__).read_bytes()).hexdigest()
    key = key_of({"family": family_name, "sha": sha, "prompt": list(prompt), "n": n, "code": code,
                  **versions("torch", "transformers", "safetensors")})
    path = cache_root() / "references" / key
    ref = reference.load(path)
    if ref is None:
        family = get_family(family_name)
        ref = capture(load_hf_model(family, Path(model_dir)), family, list(prompt), n)
        path.parent.mkdir(parents=True, exist_ok=True)
        reference.save(ref, path)
    return ref


def dtype_name(x) -> str | None:
    """The dtype a candidate returned: torch and numpy arrays; None when unknown."""
    dt = getattr(x, "dtype", None)
    return None if dt is None else str(dt).replace("torch.", "")


def expected_dtype(spec) -> str | None:
    try:
        return thresholds.limits(spec.precision, "output", spec.family, spec.backend).get("dtype")
    except KeyError:
        return None


def compare_block(ref, key, outs, spec, layer_types) -> BlockRow:
    layer, kind = key
    lim = thresholds.limits(spec.precision, kind, spec.family, spec.backend)
    detail = layer_types[layer] if kind == "attention" else ""
    if kind == "router":
        ref_w = torch.cat([w for w, _ in ref.outputs[key]])
        ref_i = torch.cat([i for _, i in ref.outputs[key]])
        cand_w = np.concatenate([as_f64(w).reshape(-1, ref_w.shape[-1]) for w, _ in outs])
        cand_i = np.concatenate([np.asarray(i).reshape(-1, ref_i.shape[-1]) for _, i in outs])
        probs = torch.cat(ref.router_probs[layer])
        m = router_metrics(ref_w, ref_i, cand_w, cand_i, probs, lim["tie_gap"])
        status, ratio = thresholds.judge_router(m, lim)
    else:
        r = torch.cat([o.reshape(-1, o.shape[-1]) for o in ref.outputs[key]]).double()
        c = np.concatenate([as_f64(o).reshape(-1, as_f64(o).shape[-1]) for o in outs])
        keep = None
        if kind in ("moe", "layer") and r.shape[0] == c.shape[0]:
            # tokens whose reference routing is a near tie at this precision: a flipped
            # expert there is the precision's doing, reported as a count, not compared
            router_lim = thresholds.limits(spec.precision, "router", spec.family, spec.backend)
            # router calls = the sequence's calls, then the expert probes (moe has both, layer none)
            probs = torch.cat(ref.router_probs[layer])[: r.shape[0]].sort(dim=-1, descending=True).values
            k = ref.outputs[layer, "router"][0][1].shape[-1]
            keep = (probs[:, k - 1] - probs[:, k] >= router_lim["tie_gap"]).numpy()
            r, c = r[keep], c[keep]
        m = tensor_metrics(r, c, lim["atol"], lim["rtol"])
        want, got = expected_dtype(spec), dtype_name(outs[0]) if outs else None
        if want and got and got != want:  # e.g. an unconditional cast that changes the output dtype
            m["dtype_mismatch"] = f"{got} (expected {want})"
        if keep is not None:
            m["tie_tokens_excluded"] = int((~keep).sum())
            if m.get("first_divergence"):  # back to the token index of the whole sequence
                fd = m["first_divergence"]
                fd["index"][0] = int(np.flatnonzero(keep)[fd["index"][0]])
        status, ratio = thresholds.judge_tensor(m, lim)
    return BlockRow(layer, kind, status, "isolated", m, lim, ratio, detail)


def run_e2e(ref, cand, spec) -> E2E:
    lim = thresholds.limits(spec.precision, "e2e", spec.family, spec.backend)
    P = ref.prompt_len
    steps, cand_tokens, ties, first, dtypes = [], [], [], None, set()
    ref_rows, cand_rows = [], []  # every position's logits, for the distribution metrics
    for k in range(len(ref.logits)):
        if k == 0:
            raw = cand.prefill(ref.tokens[:P])
            out = as_f64(raw)
            out = out.reshape(-1, out.shape[-1])
            r = ref.logits[0][-out.shape[0]:]
        else:
            raw = cand.decode(ref.tokens[P + k - 1], P + k - 1)
            out = as_f64(raw).reshape(1, -1)
            r = ref.logits[k]
        dtypes.add(dtype_name(raw))
        ref_rows.append(as_f64(r).reshape(-1, out.shape[-1]))
        cand_rows.append(out)
        m = tensor_metrics(r, out, lim["atol"], lim["rtol"])
        status, ratio = thresholds.judge_tensor(m, lim)
        ref_tok, margin = int(r[-1].argmax()), top2_margin(r[-1])
        cand_tok = int(np.nanargmax(out[-1])) if np.isfinite(out[-1]).any() else -1
        cand_tokens.append(cand_tok)
        token_status = "match"
        if cand_tok != ref_tok:
            token_status = "tie" if margin < lim["tie_margin"] else "mismatch"
            if token_status == "tie":
                ties.append(k)
            if first is None:
                first = {"step": k, "position": P + k - 1 if k else P - 1, "reference_token": ref_tok,
                         "candidate_token": cand_tok, "reference_margin": margin, "tie": token_status == "tie"}
        steps.append({"step": k, "max_abs": m.get("max_abs"), "rel_l2": m.get("rel_l2"),
                      "nonfinite": m["nonfinite"], "ratio": ratio, "logits_status": status,
                      "reference_margin": margin, "reference_token": ref_tok,
                      "candidate_token": cand_tok, "token": token_status,
                      "first_divergence": m.get("first_divergence")})
    exact = all(s["token"] == "match" for s in steps)
    ok = all(s["logits_status"] == "pass" and s["token"] != "mismatch" for s in steps)
    distribution = None
    if "kl_mean" in lim:  # quantized precisions: judged by the logits' distribution, tokens reported
        distribution = distribution_metrics(np.concatenate(ref_rows), np.concatenate(cand_rows))
        distribution["status"], distribution["ratio"] = judge_distribution(distribution, lim)
        ok = distribution["status"] == "pass"
    e2e = E2E("pass" if ok else "fail", ref.tokens[:P], ref.tokens[P:], cand_tokens, exact, steps, lim,
              first, ties, distribution)
    want, got = expected_dtype(spec), sorted(d for d in dtypes if d)
    gate = None
    if want and got:
        gate = GateRow("logits_dtype", "pass" if got == [want] else "fail", ", ".join(got), want,
                       "the logits keep the model's declared dtype (no unconditional cast)")
    return e2e, gate


def run_check(spec: CheckSpec, backend=None, progress=None, goldens: bool = True) -> CheckResult:
    """Run one check. Raises InputError for bad input; a backend failure is status 'error'.
    goldens=False leaves out the golden gates (how `oracle goldens freeze` checks)."""
    progress = progress or (lambda stage, done=0, total=0: None)
    t0 = time.perf_counter()
    timings = {}
    if backend is None:
        backend = validate(spec)
    result = CheckResult(spec=asdict(spec), status="pass", provenance=provenance(spec))
    ok, reason = backend.availability()
    if not ok:
        result.status, result.skipped_reason = "skipped", reason
        return result
    progress("checkpoint")
    src = model_source(spec)
    result.provenance["checkpoint"] = {"dir": str(src.model_dir), "sha256": src.checkpoint_sha256,
                                       "tiny": spec.model_dir is None}
    timings["checkpoint_s"] = time.perf_counter() - t0

    progress("reference")
    t = time.perf_counter()
    prompt = prompt_tokens(spec, src.args.vocab_size)
    try:
        ref = reference_for(spec.family, str(src.model_dir), src.checkpoint_sha256, tuple(prompt),
                            spec.decode_tokens)
    except CheckpointError as e:
        raise InputError(f"the HF reference cannot load {src.model_dir}: {e}") from None
    timings["reference_s"] = time.perf_counter() - t
    result.reference = reference_margins(ref, src.args.num_experts_per_tok)

    stage = "load"
    try:
        progress("load")
        t = time.perf_counter()
        cand = backend.load(src, spec)
        timings["load_s"] = time.perf_counter() - t
        info = dict(getattr(cand, "info", {}) or {})
        artifacts = info.pop("artifacts", [])
        result.provenance["backend"] = info
        result.provenance["artifacts"] = [{"name": a["name"], "sha256": a["sha256"]} for a in artifacts]
        result.cache = {"artifacts": [{k: a[k] for k in ("name", "cached", "build_s", "path")} for a in artifacts],
                        "all_cached": bool(artifacts) and all(a["cached"] for a in artifacts)}

        stage = "blocks"
        t = time.perf_counter()
        keys = ref.block_keys()
        modes = getattr(cand, "block_modes", {})
        for n, key in enumerate(keys):
            progress("blocks", n, len(keys))
            mode = modes.get(key[1], getattr(cand, "block_mode", "isolated"))
            outs = cand.run_block(key[0], key[1], ref.inputs[key])
            if outs is None:
                result.blocks.append(BlockRow(key[0], key[1], "n/a", mode, {}, {}, 0.0, "not isolated by backend"))
                continue
            row = compare_block(ref, key, outs, spec, src.args.layer_types)
            row.mode = mode
            result.blocks.append(row)
        timings["blocks_s"] = time.perf_counter() - t

        stage = "e2e"
        progress("e2e")
        t = time.perf_counter()
        result.e2e, dtype_gate = run_e2e(ref, cand, spec)
        if dtype_gate:
            result.gates.append(dtype_gate)
        timings["e2e_s"] = time.perf_counter() - t
        stage = "gates"
        gates = getattr(cand, "gates", None)
        if gates is not None:
            result.gates += list(gates())
        sampling = spec.options.get("sampling")
        if sampling is not None:
            stage = "sampling"
            progress("sampling")
            t = time.perf_counter()
            result.gates += sampling_gates(ref, cand, float(sampling["temperature"]), float(sampling["top_p"]),
                                           spec.seed, thresholds.limits(spec.precision, "e2e")["tie_margin"])
            timings["sampling_s"] = time.perf_counter() - t
        structures = getattr(cand, "structures", None)
        if structures is not None:
            result.structures = dict(structures())
        if goldens:
            tok = golden_files.token_gate(spec, result.e2e.candidate_tokens)
            result.gates += ([tok] if tok else []) + golden_files.structure_gates(spec, result.structures)
    except Exception as e:  # the backend crashed: this check is an error, not the run
        result.error = f"{stage}: {type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-8))

    w = worst_row(result.blocks)  # rows measured before a crash still localise
    result.worst = asdict(w) if w else None
    failed = (w is not None or (result.e2e and result.e2e.status == "fail")
              or any(g.status == "fail" for g in result.gates))
    result.status = "error" if result.error else "fail" if failed else "pass"
    timings["total_s"] = time.perf_counter() - t0
    result.timings = timings
    return result


def reference_margins(ref, k: int) -> dict:
    """How far the reference is from ties: token top-2 logit margins, router k-th vs (k+1)-th gap."""
    P = ref.prompt_len
    margins = [top2_margin(lg[-1]) for lg in ref.logits]
    gaps = []
    for probs in ref.router_probs.values():
        p = torch.cat(probs).sort(dim=-1, descending=True).values
        gaps.append(float((p[:, k - 1] - p[:, k]).min()))
    return {"min_token_margin": min(margins), "token_margins": margins,
            "min_router_gap": min(gaps) if gaps else None, "prompt_len": P,
            "expert_coverage": {str(k): v for k, v in ref.coverage.items()}}


__all__ = ["run_check", "CheckSpec", "InputError", "GateRow"]

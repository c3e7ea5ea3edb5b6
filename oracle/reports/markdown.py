"""Renderings of a CheckResult dict (the JSON document): markdown for PR comments."""

from __future__ import annotations

from pathlib import Path

from oracle.reports.result import Status, place


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _where(row: dict) -> str:
    detail = f" ({row['detail']})" if row.get("detail") else ""
    return f"{place(row['layer'])} {row['kind']}{detail}"


def _metric_line(row: dict) -> str:
    m = row["metrics"]
    if "exception" in m:
        return f"the candidate raised: {m['exception']}"
    if "invalid_output" in m:
        return f"invalid output: {m['invalid_output']}"
    if row["kind"] == "router":
        return (f"top-k agreement {_fmt(m.get('topk_agreement'))}, weight max_abs {_fmt(m.get('weight_max_abs'))}"
                f" (limit {_fmt(row['limits'].get('weight_atol'))})")
    if "shape_mismatch" in m:
        return f"shape mismatch: {m['shape_mismatch']}"
    s = (f"max_abs {_fmt(m.get('max_abs'))}, rel_l2 {_fmt(m.get('rel_l2'))} (limit {_fmt(row['limits'].get('rel_l2'))}),"
         f" cosine {_fmt(m.get('cosine'))}")
    if m.get("nonfinite"):
        s += f", **{m['nonfinite']} NaN/Inf**"
    return s


def _blocks(all_rows: list, worst: dict | None, top: int) -> list[str]:
    lines = []
    rows = [r for r in all_rows if r["status"] != Status.NA]
    if all_rows and not rows:
        return [f"Blocks: none compared ({len(all_rows)} n/a: {all_rows[0].get('detail') or 'not isolated'})"]
    failing = sum(r["status"] in (Status.FAIL, Status.ERROR) for r in rows)
    lines.append(f"Blocks: {len(rows) - failing}/{len(rows)} pass ({rows[0]['mode'] if rows else 'isolated'})")
    if worst:
        lines.append(f"Localised fault: **{_where(worst)}**: {_metric_line(worst)}")
    noise = any("noise_max_abs" in r["metrics"] or "noise_weight_max_abs" in r["metrics"] for r in rows)
    # reduced precisions: the candidate's error beside HF's own at this precision (oracle/verdict/noise.py);
    # in-situ rows: beside HF fp32's on the candidate's own upstream (oracle/verdict/insitu.py)
    upstream = not noise and any("upstream_max_abs" in r["metrics"] or "upstream_weight_max_abs" in r["metrics"]
                                 for r in rows)
    prefix, label = ("upstream_", "upstream") if upstream else ("noise_", "HF")
    beside = noise or upstream  # the two columns: that error, and the candidate's as a multiple of it
    extra = (f"| {label} max_abs | x {label} " if beside else "", "|---|---" if beside else "")
    lines += ["", f"| block | status | max_abs | rel_l2 | limit | ratio {extra[0]}|", f"|---|---|---|---|---|---{extra[1]}|"]

    def key(r):
        ratio = r["ratio"]
        return -(float("inf") if isinstance(ratio, str) else ratio)

    for r in sorted(rows, key=key)[:top]:
        m = r["metrics"]
        if "exception" in m or "invalid_output" in m:
            lines.append(f"| {_where(r)} | {r['status']} | {_metric_line(r)} | | | inf |" + (" | |" if beside else ""))
            continue
        if r["kind"] == "router":
            vals = (m.get("weight_max_abs"), f"agree {_fmt(m.get('topk_agreement'))}", r["limits"].get("weight_atol"))
        else:
            vals = (m.get("max_abs"), m.get("rel_l2"), r["limits"].get("rel_l2"))
        cols = ""
        if beside:
            h = m.get(f"{prefix}weight_max_abs") if r["kind"] == "router" else m.get(f"{prefix}max_abs")
            x = vals[0] / h if isinstance(h, float) and h > 0 and isinstance(vals[0], float) else None
            cols = f" {_fmt(h) if h is not None else ''} | {_fmt(x) if x is not None else ''} |"
        lines.append(f"| {_where(r)} | {r['status']} | {_fmt(vals[0])} | {_fmt(vals[1])} | {_fmt(vals[2])} |"
                     f" {_fmt(r['ratio'])} |{cols}")
    excluded = [r for r in rows if r["metrics"].get("excluded_over_quarter")]
    if excluded:  # a verdict on few tokens is said, not hidden
        lines.append("")
        lines += [f"Note: {_where(r)} compared few tokens: {r['metrics']['excluded_over_quarter']} (router near ties"
                  " or rerouted by the candidate's router)" for r in excluded]
    return lines


def _drill(d: dict | None) -> list[str]:
    """The points inside drilled blocks (oracle/drill/points.py), in program order, the first divergence in bold."""
    if not d:
        return []
    lines = []
    if d.get("error"):
        lines += ["", f"Drill: not run ({d['error']})"]
    for b in d.get("blocks", []):
        built = f", {b['build_s']:.1f} s of it building the points program" if b.get("build_s") else ""
        lines += ["", f"Drill: {b['verdict']} ({b['seconds']:.1f} s{built})"]
        if not b["points"]:
            continue
        lines += ["", "| point | status | max_abs | rel_l2 | ratio |", "|---|---|---|---|---|"]
        for p in b["points"]:
            m, name = p["metrics"], f"`{p['name']}`"
            if p["name"] == b["first_divergence"]:
                name = f"**{name}**"
            ratio = _fmt(p["ratio"]) if p["status"] != Status.NA else "n/a"
            lines.append(f"| {name} | {p['status']} | {_fmt(m.get('max_abs', '-'))} | {_fmt(m.get('rel_l2', '-'))} | "
                         f"{ratio}{' (' + p['reason'] + ')' if p['reason'] else ''} |")
    return lines


def _e2e(e: dict | None) -> list[str]:
    lines = []
    if e:
        worst = max((s["max_abs"] for s in e["steps"] if isinstance(s["max_abs"], float)), default=0.0)
        if e.get("error"):
            lines += ["", f"The candidate raised at e2e {e['error']}; the later steps were not run."]
        lines += ["", f"e2e: **{e['status']}**, tokens {'exact' if e['token_exact'] else 'NOT exact'}"
                      f" ({len(e['reference_tokens'])} greedy tokens), logits max_abs {_fmt(worst)}"
                      + (f", ties at steps {e['ties']}" if e["ties"] else "")]
        if e.get("measured_noise"):
            lines.append(f"Beyond the fixed e2e table: {e['measured_noise']}.")
        lines += _routing(e.get("routing"))
        d = e.get("distribution")
        if d:
            lines.append(f"Logits distribution: **{d['status']}**, KL mean {_fmt(d['kl_mean'])} (p99 {_fmt(d['kl_p99'])},"
                         f" max {_fmt(d['kl_max'])}), same top-1 {_fmt(d['same_top1'])}"
                         + (f" ({d['top1_ties']} near-tie position(s) not counted)" if d.get("top1_ties") else "")
                         + ", max abs delta-p"
                         f" {_fmt(d['delta_p_max_abs'])} over {d['positions']} positions (tokens reported, not required)")
        fm = e.get("first_mismatch")
        if fm:
            lines.append(f"First divergence: step {fm['step']} (position {fm['position']}): reference token"
                         f" {fm['reference_token']}, candidate {fm['candidate_token']}, reference top-2 margin"
                         f" {_fmt(fm['reference_margin'])}{' (near tie)' if fm['tie'] else ''}")
    return lines


def _routing(r: dict | None) -> list[str]:
    """The e2e routing replay (oracle/verdict/replay.py): what the candidate's routers and indexers chose."""
    return _experts(r) + _indexer(r.get("indexer")) if r else []


def _experts(r: dict) -> list[str]:
    """What the candidate's routers chose, judged."""
    if not r["recorded"]:
        return [f"Routing: not recorded ({r['why']}): the steps are judged against the reference's own routing"]
    diffs = r["differences"]
    if not diffs:
        return [f"Routing: the candidate's routers chose the reference's experts at every position of every step "
                f"({len(r['layers'])} MoE layer(s))"]
    follows = f", {r['follows']} following from an earlier one" if r.get("follows") else ""
    quant = (f", {r['quantization']} beyond the bound from the quantized weights (their loss, judged by the "
             "logits' distribution)" if r.get("quantization") else "")
    lines = [f"Routing: {len(diffs)} difference(s) from the reference's experts: {r['ties']} tie(s) within the "
             f"bound measured there{follows}{quant}, {r['divergences']} router divergence(s)"
             + ("; the steps judged against HF fp32 with the candidate's experts forced (routing-aligned), the "
                "plain comparison beside" if r["aligned"] else ""), "",
             "| step | layer | position | differs in | reference experts | candidate experts | gap | tie bound | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += _difference_rows(diffs, lambda d: [d.get("what", "experts"), d["reference"], d["candidate"]])
    if r.get("not_aligned"):
        lines.append(f"Not replayed: {r['not_aligned']}.")
    if r.get("plain"):
        worst = max(p["max_abs"] for p in r["plain"])
        lines.append(f"Against the plain reference (no routing aligned) the logits differ by up to {_fmt(worst)}.")
    return lines


def _indexer(r: dict | None) -> list[str]:
    """Sparse attention's key selection (oracle/verdict/selection.py), judged like the routers' experts."""
    if not r:
        return []
    if not r["recorded"]:
        return [f"Indexer: not recorded ({r['why']})"]
    diffs = r["differences"]
    if not diffs:
        return [f"Indexer: the candidate's indexers selected the reference's keys for every query of every step "
                f"({len(r['layers'])} sparse-attention layer(s))"]
    quant = f", {r['quantization']} from the quantized weights" if r.get("quantization") else ""
    lines = [f"Indexer: {len(diffs)} query position(s) where the candidate selected other keys: {r['ties']} tie(s) "
             f"within the bound{quant}, {r['divergences']} indexer divergence(s)"
             + (f", {r['follows']} downstream of one" if r.get("follows") else "")
             + ("; the steps judged against HF fp32 with the candidate's keys (and experts) forced" if r.get("forced")
                else ""), "",
             "| step | layer | position | keys only the reference kept | keys only the candidate kept | gap | tie bound "
             "| verdict |", "|---|---|---|---|---|---|---|---|"]
    return lines + _difference_rows(diffs, lambda d: [sorted(set(d["reference"]) - set(d["candidate"])),
                                                      sorted(set(d["candidate"]) - set(d["reference"]))])


def _difference_rows(diffs: list, middle) -> list[str]:
    """A table row per routing or key difference (the first 12): step, layer, position, `middle(d)`'s cells,
    gap, tie bound, verdict; then how many more the JSON lists."""
    lines = []
    for d in diffs[:12]:
        verdict = "**divergence**" if d["verdict"] == "divergence" else d["verdict"]
        cells = [d["call"], d["layer"], d["position"], *middle(d), _fmt(d["gap"]), _fmt(d["bound"]), verdict]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if len(diffs) > 12:
        lines.append(f"... and {len(diffs) - 12} more (the JSON lists every one)")
    return lines


def _weights(w: dict | None) -> list[str]:
    """The weight check of a shipped file (oracle/verdict/conversion.py), and its failing tensors."""
    from oracle.verdict.conversion import summary_line

    if not w:
        return []
    if w.get("error") or w.get("note"):
        return ["", f"**Weights** (the shipped file against the original, tensor by tensor): **{w['status']}**: "
                    f"{w.get('error') or w.get('note')}"]
    lines = ["", f"**Weights** (the shipped file against the original, tensor by tensor, within its format's "
                 f"rounding): **{w['status']}**: {summary_line(w)}"]
    bad = [r for r in w["rows"] if r["status"] == Status.FAIL]
    if bad:
        lines += ["", "| tensor | holds | format | where | over the bound | largest excess | systematic scale |",
                  "|---|---|---|---|---|---|---|"]
        for r in bad[:12]:
            s = r.get("systematic") or {}
            sys_text = (f"{s['scale_error']:+.3%} (limit ±{_fmt(100 * s['limit'])}%)" if "scale_error" in s else "")
            lines.append(f"| {r['name']} | {r['label']} | {r['format']} | {r.get('where') or r.get('note') or ''} | "
                         f"{r['over']} | {_fmt(r['max_excess'])} | {sys_text} |")
        if len(bad) > 12:
            lines.append(f"... and {len(bad) - 12} more (the JSON has every tensor)")
    return lines


def _shipped(q: dict) -> list[str]:
    mods = ", ".join(f"{k}: {n} modules" for k, n in (q.get("modules") or {}).items()) or "no quantized module"
    what = "Shipped directory" if Path(str(q["shipped_dir"])).is_dir() else "Shipped"
    lines = [f"{what} `{q['shipped_dir']}`: {q.get('format', '')} {q.get('kind', '')} ({mods})."]
    if q.get("built"):
        lines.append(q["built"] + ".")
    if q.get("note"):
        lines.append(q["note"][0].upper() + q["note"][1:] + ".")
    if q.get("from_original"):  # tensors the format cannot carry, in HF's reference from the original
        lines.append(q["from_original"][0].upper() + q["from_original"][1:] + ".")
    return lines


def _invariance(rows: list | None) -> list[str]:
    """The invariance rows (oracle/verdict/invariance.py): each against the same backend's e2e path."""
    if not rows:
        return []
    out = ["", "Invariance (against this backend's own e2e path):", "", "| row | status | max_abs | ratio | where | detail |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        w = r.get("where") or {}
        where = f"step {w['step']} position {w['position']} ({w['run']})" if w and r.get("max_abs") else ""
        rt = r.get("routing") or {}
        if rt.get("first_divergence"):
            d = rt["first_divergence"]
            where += f"; router divergence layer {d['layer']} position {d['position']} ({d['run']})"
        elif rt.get("first_difference"):
            d = rt["first_difference"]
            where += f"; routing differs first at layer {d['layer']} position {d['position']} ({d['run']})"
        same = " (bit-identical)" if r.get("identical") else ""
        num = lambda x: "" if x is None else _fmt(x)  # noqa: E731
        out.append(f"| {r['name']} | {r['status']}{same} | {num(r.get('max_abs'))} | {num(r.get('ratio'))} | "
                   f"{where} | {r.get('detail', '')} |")
    return out + [""]


def markdown(doc: dict, top: int = 5) -> str:
    spec = doc["spec"]
    icon = {Status.PASS: "✅", Status.FAIL: "❌", Status.XFAIL: "⚠️", Status.SKIPPED: "⏭️", Status.ERROR: "💥"}.get(doc["status"], "")
    src = spec.get("model_dir") or (spec.get("config") and spec["config"] + (f" --layers {spec['layers']}" if spec.get("layers") else "")) or "tiny"
    lines = [f"### {icon} oracle check `{spec['family']}` on `{spec['backend']}` ({spec['precision']}, {src}):"
             f" **{doc['status']}**", ""]
    if doc["status"] == Status.SKIPPED:
        return "\n".join(lines + [f"Skipped: {doc['skipped_reason']}", ""])
    if doc["status"] == Status.ERROR:
        first = (doc.get("error") or "").splitlines()[:1]
        weights = _weights((doc.get("quantization") or {}).get("weights"))
        return "\n".join(lines + [f"Backend error: `{first[0] if first else ''}`", ""] + (weights + [""] if weights else []))
    ckpt = (doc.get("provenance") or {}).get("checkpoint") or {}
    if ckpt.get("release_format"):  # a checkpoint as released in a quantized format
        lines += [f"Release format: {ckpt['release_format']}, {ckpt['release_read']}.", ""]
        if ckpt.get("arithmetic"):
            lines += [f"Arithmetic {ckpt['arithmetic']}.", ""]
    schedule = ((doc.get("provenance") or {}).get("backend") or {}).get("schedule")
    if schedule:  # a checkpoint streamed from disk (oracle/schedule.py)
        lines += [f"Schedule: {schedule}.", ""]
    ex = doc.get("expected")
    q = doc.get("quantization")
    if ex:
        lines += [f"Known divergence ({ex['family']} on {ex['backend']}, {ex['package']} {ex['versions']}): "
                  f"**{ex['verdict']}**. Upstream: {ex['reference']}", ""]
        if doc.get("error"):  # expected to fail where it loads: its runtime's own words, and the file's weights
            first = doc["error"].splitlines()[:1]
            return "\n".join(lines + [f"Candidate error: `{first[0] if first else ''}`", ""]
                             + (_weights(q.get("weights")) + [""] if q else []))
    if q:
        lines += _shipped(q) + _weights(q.get("weights"))
    if q and q.get("implementation"):
        lines += ["", f"**Implementation error** (the candidate vs HF on the shipped weights dequantized, "
                      f"{q.get('limits', spec['precision'])} limits): does the runtime compute the model it was given?", ""]
    lines += _blocks(doc["blocks"], doc.get("worst"), top) + _drill(doc.get("drill")) + _e2e(doc.get("e2e"))
    rows = (q or {}).get("rows")
    if rows:
        how = ("the chosen bits and group size on these weights, not the backend's doing: reported, not judged"
               if rows["status"] == Status.REPORTED else "judged end to end, by the logits' distribution")
        lines += ["", f"**Quantization error** (HF on the original weights vs HF on the dequantized ones, at the "
                      f"{rows['precision']} limits): **{rows['status']}** ({how})"]
        if rows.get("error"):
            lines.append(f"It could not be measured: `{rows['error']}`")
        else:
            over = rows.get("over_table")
            lines += [""] + _blocks(rows["blocks"], None, top) + _e2e(rows.get("e2e"))
            if over and rows.get("explained"):  # the weights were shown to be a correct quantization
                lines.append(f"Largest block loss over the fixed {rows['precision']} table: {_where(over)}: "
                             f"{_metric_line(over)}; explained: {rows['explained']}")
            elif over:  # no weight check says what it is: reported against the fixed table, not judged
                lines.append(f"Largest block loss over the fixed {rows['precision']} table (reported, not judged: "
                             f"no weight check shows the weights to be a correct quantization): "
                             f"{_where(over)}: {_metric_line(over)}")
    ps = doc.get("prompts")
    if ps:
        exact = sum(p["token_exact"] for p in ps["per_prompt"])
        lines += ["", f"Prompts: **{ps['status']}**, {ps['count']} prompt(s), "
                      f"{sum(p['status'] == Status.PASS for p in ps['per_prompt'])} pass end to end, {exact} token-exact"]
        d, pp = ps.get("distribution"), ps.get("perplexity")
        if d:
            lines.append(f"Over all prompts: KL mean {_fmt(d.get('kl_mean'))} (p99 {_fmt(d.get('kl_p99'))}, max "
                         f"{_fmt(d.get('kl_max'))}), same top-1 {_fmt(d.get('same_top1'))} over {d.get('positions')} positions"
                         + (f", judged: {d['status']}" if d.get("status") else ""))
        if pp:
            lines.append(f"Perplexity of the prompts' own next tokens: candidate {_fmt(pp['candidate'])}, reference "
                         f"{_fmt(pp['reference'])}, ratio {pp['ratio']:.6f} ({pp['positions']} positions)")
    lines += _invariance(doc.get("invariance"))
    for g in doc.get("gates", []):
        lines.append(f"Gate {g['name']}: {g['status']} ({_fmt(g['value'])} vs limit {_fmt(g['limit'])})"
                     + (f" {g['message']}" if g.get("message") else ""))
    return "\n".join(lines) + "\n"

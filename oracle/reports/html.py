"""report.html: the matrix summary, and per check a plot of the error of every block
against its limit, the e2e tokens side by side (first divergence highlighted) and the
provenance. Self-contained: plots are embedded PNGs."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from oracle.reports.result import Status

KIND_STYLE = {"attention": "o-", "router": "s--", "moe": "^-", "mlp": "v-", "layer": "d-", "final_norm": "*", "logits": "P"}
CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f2f2f2}.pass{color:#18794e;font-weight:600}.fail{color:#c62828;font-weight:600}
.error{color:#8e24aa;font-weight:600}.skipped{color:#777;font-weight:600}.xfail{color:#b26a00;font-weight:600}
.tok td{font-family:monospace;text-align:center}.div{background:#ffcdd2;font-weight:700}.tie{background:#fff3c4}
section{border-top:2px solid #ddd;margin-top:24px;padding-top:8px}small{color:#666}
.grid td.cell{text-align:center;min-width:90px}.grid td.cell a{color:inherit;text-decoration:none;font-weight:600}
.c-pass{background:#c8e6c9;color:#18794e}.c-fail{background:#ffcdd2;color:#c62828}.c-error{background:#e1bee7;color:#6a1b9a}
.c-skipped{background:#eeeeee;color:#666}.c-xfail{background:#ffe0b2;color:#8d4f00}.none{color:#bbb}
"""


def _esc(x) -> str:
    return html.escape(str(x))


def _ratio(x) -> float:
    return x if isinstance(x, (int, float)) else math.inf


def error_plot(doc: dict) -> str:
    """PNG (base64) of each block's ratio to its limit, per layer and kind; 1 is the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [b for b in doc["blocks"] if b["status"] != Status.NA]
    n_layers = 1 + max((b["layer"] for b in rows if b["layer"] is not None), default=-1)
    fig, ax = plt.subplots(figsize=(8.5, 3.2), dpi=100)
    for kind, style in KIND_STYLE.items():
        pts = [((n_layers if b["layer"] is None else b["layer"]), max(_ratio(b["ratio"]), 1e-6)) for b in rows
               if b["kind"] == kind]
        if pts:
            xs, ys = zip(*sorted(pts))
            ys = [min(y, 1e6) for y in ys]
            ax.plot(xs, ys, style, label=kind, markersize=6)
    ax.axhline(1.0, color="#c62828", linestyle=":", linewidth=1.5, label="limit")
    ax.set_yscale("log")
    ax.set_ylabel("error / limit")
    ax.set_xticks(range(n_layers + 1), [str(i) for i in range(n_layers)] + ["model"])
    ax.set_xlabel("layer")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def drill_plot(block: dict) -> str:
    """PNG (base64) of a drilled block's points (oracle/drill/points.py): each point's ratio to its limit, in
    program order; the first divergence in red, n/a points left out; 1 is the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in block["points"] if p["status"] != Status.NA]
    fig, ax = plt.subplots(figsize=(8.5, 2.8), dpi=100)
    xs = range(len(pts))
    ys = [min(max(_ratio(p["ratio"]), 1e-6), 1e6) for p in pts]
    colors = ["#c62828" if p["name"] == block["first_divergence"] else
              "#ef9a9a" if p["status"] == Status.FAIL else "#2e7d32" for p in pts]
    ax.bar(xs, ys, color=colors)
    ax.axhline(1.0, color="#c62828", linestyle=":", linewidth=1.5)
    ax.set_yscale("log")
    ax.set_ylabel("error / limit")
    ax.set_xticks(list(xs), [p["name"] for p in pts], rotation=45, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def tokens_table(e: dict) -> str:
    first = (e.get("first_mismatch") or {}).get("step")
    ties = set(e.get("ties") or [])
    head = "".join(f"<th>{k}</th>" for k in range(len(e["reference_tokens"])))

    def cells(tokens):
        out = []
        for k, t in enumerate(tokens):
            cls = "div" if k == first else "tie" if k in ties else ""
            out.append(f'<td class="{cls}">{_esc(t)}</td>')
        return "".join(out)

    return (f'<table class="tok"><tr><th>step</th>{head}</tr><tr><th>reference</th>{cells(e["reference_tokens"])}'
            f'</tr><tr><th>candidate</th>{cells(e["candidate_tokens"])}</tr></table>')


def check_section(doc: dict) -> str:
    spec = doc["spec"]
    title = f"{spec['family']} / {spec['backend']} / {spec['precision']}"
    parts = [f'<section id="{_esc(title)}"><h2>{_esc(title)}: <span class="{doc["status"]}">'
             f'{doc["status"]}</span></h2>']
    if doc["status"] == Status.SKIPPED:
        return "".join(parts) + f"<p>Skipped: {_esc(doc.get('skipped_reason'))}</p></section>"
    if doc.get("error"):
        parts.append(f"<pre>{_esc(doc['error'][:2000])}</pre>")
    ex = doc.get("expected")
    if ex:
        parts.append(f"<p class='{'xfail' if doc['status'] == Status.XFAIL else 'fail'}'>Known divergence: "
                     f"{_esc(ex['verdict'])} ({_esc(ex['package'])} {_esc(ex['versions'])}; {_esc(ex['reference'])})</p>")
    if doc.get("blocks"):
        parts.append(f'<img alt="error per layer and block kind" src="data:image/png;base64,{error_plot(doc)}">')
        w = doc.get("worst")
        if w:
            parts.append(f"<p>Localised fault: <b>{'model' if w['layer'] is None else 'layer ' + str(w['layer'])}"
                         f" {_esc(w['kind'])}</b> ({_esc(_fmt(w['ratio']))}x its limit)</p>")
    for block in (doc.get("drill") or {}).get("blocks", []):  # the points inside (oracle/drill/points.py)
        parts.append(f"<h3>Drill: {_esc(block['verdict'])}</h3>")
        if any(p["status"] != Status.NA for p in block["points"]):
            parts.append(f'<img alt="error per point inside the block" src="data:image/png;base64,{drill_plot(block)}">')
    e = doc.get("e2e")
    if e:
        parts.append(f"<h3>End to end: <span class='{e['status']}'>{e['status']}</span></h3>{tokens_table(e)}")
        fm = e.get("first_mismatch")
        if fm:
            parts.append(f"<p>First divergence at step {fm['step']}: reference {fm['reference_token']}, candidate "
                         f"{fm['candidate_token']}, reference top-2 margin {_fmt(fm['reference_margin'])}"
                         f"{' (near tie)' if fm['tie'] else ''}</p>")
    q = doc.get("quantization")
    if q:  # a shipped directory: the rows above are the implementation error; the quantization error apart
        rows = q.get("rows") or {}
        parts.append(f"<h3>Shipped directory {_esc(q.get('shipped_dir'))}: {_esc(q.get('kind'))}</h3>"
                     f"<p>The rows above: the implementation error (the candidate vs HF on the dequantized weights, "
                     f"{_esc(q.get('limits', spec['precision']))} limits). "
                     + (f"Quantization error (HF original vs HF dequantized, at the "
                        f"{_esc(rows.get('precision'))} limits; judged end to end unless reported): "
                        f"<span class='{_esc(rows.get('status'))}'>{_esc(rows.get('status'))}</span>, worst block "
                        f"{_esc(_fmt(max((b['ratio'] for b in rows.get('blocks', []) if isinstance(b['ratio'], float)), default=0.0)))}"
                        f"x the fixed table (reported, not judged)." if rows else _esc(q.get("note", ""))) + "</p>")
    ps = doc.get("prompts")
    if ps and ps.get("perplexity"):
        pp = ps["perplexity"]
        parts.append(f"<p>{ps['count']} prompt(s): <span class='{ps['status']}'>{ps['status']}</span>; perplexity "
                     f"candidate {_esc(_fmt(pp['candidate']))} / reference {_esc(_fmt(pp['reference']))}</p>")
    if doc.get("gates"):
        parts.append("<h3>Gates</h3><table><tr><th>gate</th><th>status</th><th>value</th><th>limit</th></tr>"
                     + "".join(f"<tr><td>{_esc(g['name'])}</td><td class='{g['status']}'>{g['status']}</td>"
                               f"<td>{_esc(g['value'])}</td><td>{_esc(g['limit'])}</td></tr>" for g in doc["gates"])
                     + "</table>")
    prov = doc.get("provenance", {})
    vers = ", ".join(f"{k} {v}" for k, v in sorted(prov.get("versions", {}).items()))
    ck = prov.get("checkpoint", {})
    host = prov.get("host", {})
    parts.append(f"<h3>Provenance</h3><table><tr><th>versions</th><td>{_esc(vers)}</td></tr>"
                 f"<tr><th>host</th><td>{_esc(host.get('name'))} {_esc(host.get('machine'))}, "
                 f"{_esc(host.get('cpus'))} CPUs</td></tr>"
                 f"<tr><th>checkpoint</th><td>{_esc(ck.get('sha256', '')[:16])} "
                 f"({'tiny, seed ' + str(prov.get('seed')) if ck.get('tiny') else _esc(ck.get('dir'))})</td></tr>"
                 f"<tr><th>executor</th><td>{_esc(prov.get('backend', {}).get('executor', ''))}</td></tr></table>")
    return "".join(parts) + "</section>"


def grid_html(summary: dict) -> str:
    """One table per precision, families down and backends across, each cell coloured by its
    status with the worst block's ratio, linking to the check's section."""
    from oracle.reports.summary import cell_text, grid

    out = []
    for g in grid(summary):
        head = "".join(f"<th>{_esc(b)}</th>" for b in g["backends"])
        body = []
        for f, cells in zip(g["families"], g["cells"]):
            tds = "".join(
                "<td class='cell none'>·</td>" if c is None else
                f"<td class='cell c-{_esc(c['status'])}'><a href='#{_esc(c['family'] + ' / ' + c['backend'] + ' / ' + c['precision'])}'>"
                f"{_esc(cell_text(c))}</a></td>" for c in cells)
            body.append(f"<tr><th>{_esc(f)}</th>{tds}</tr>")
        out.append(f"<h3>{_esc(g['precision'])}</h3><table class='grid'><tr><th>family</th>{head}</tr>{''.join(body)}</table>")
    return "".join(out)


def render_html(summary: dict, report_dir: Path) -> str:
    c = summary["counts"]
    rows = "".join(
        f"<tr><td><a href='#{_esc(r['family'] + ' / ' + r['backend'] + ' / ' + r['precision'])}'>"
        f"{_esc(r['family'])}</a></td><td>{_esc(r['backend'])}</td><td>{_esc(r['precision'])}</td>"
        f"<td class='{r['status']}'>{r['status']}</td><td>{_esc(r['reason'] or '')}</td></tr>"
        for r in summary["rows"])
    sections = []
    for r in summary["rows"]:
        path = Path(report_dir) / r["json"] if r.get("json") else None
        if path and path.is_file():
            sections.append(check_section(json.loads(path.read_text())))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>oracle report</title><style>{CSS}</style>"
            f"</head><body><h1>moe-oracle report</h1><p>{c[Status.PASS]} pass, {c[Status.FAIL]} fail, {c[Status.ERROR]} error, "
            f"{c[Status.SKIPPED]} skipped, {c.get(Status.XFAIL, 0)} expected failure(s)</p>{grid_html(summary)}"
            f"<h3>All checks</h3><table><tr><th>family</th><th>backend</th><th>precision</th>"
            f"<th>status</th><th>reason</th></tr>{rows}</table>{''.join(sections)}</body></html>\n")


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)

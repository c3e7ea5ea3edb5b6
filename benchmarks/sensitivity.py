"""The smallest perturbation the oracle detects, per precision: one expert's weights scaled by
(1 + d) (the most routed-to expert of the last MoE layer), and every rotary frequency of every
attention layer scaled by (1 + d) (rope theta slightly off), injected into the eager production
model. For each d the check runs and the perturbation counts as detected when a block row or the
e2e row fails. Prints a markdown table (docs/noise.md holds the measured one).

    python benchmarks/sensitivity.py [--families olmoe,mixtral] [--weights normal,trained]
"""

from __future__ import annotations

import argparse
import time

import torch

from exporters.torch.eager import EagerBackend
from oracle.backend import CheckSpec
from oracle.check import run_check

DELTAS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def scale_expert(d):
    def inject(model):
        layer = [ly for ly in model.layers if hasattr(ly.mlp, "experts")][-1]
        e = int(layer.mlp.gate.weight.norm(dim=1).argmax())
        with torch.no_grad():
            layer.mlp.experts.gate_up_proj[e] *= 1 + d
            layer.mlp.experts.down_proj[e] *= 1 + d
    return inject


def scale_rope(d):
    def inject(model):
        with torch.no_grad():
            for ly in model.layers:
                rope = getattr(getattr(ly, "attn", None), "rope", None)
                if rope is not None and hasattr(rope, "inv_freq"):
                    rope.inv_freq.mul_(1 + d)
    return inject


PERTURBATIONS = {"expert scale": scale_expert, "rope frequencies": scale_rope}


def smallest_detected(family, precision, weights, make) -> tuple[float | None, str]:
    for d in DELTAS:
        backend = EagerBackend(name=f"eager+{d}", transform=make(d), transform_id=f"sens-{d}")
        r = run_check(CheckSpec(family=family, backend="eager", precision=precision, weights=weights), backend)
        if r.status == "fail":
            where = f"{r.worst['kind']} L{r.worst['layer']}" if r.worst else "e2e"
            return d, where
    return None, ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="olmoe,mixtral,qwen3_moe")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--weights", default="normal,trained")
    a = ap.parse_args()
    print("| family | weights | precision | perturbation | smallest d detected | first failing row |")
    print("|---|---|---|---|---|---|")
    t0 = time.time()
    for fam in a.families.split(","):
        for w in a.weights.split(","):
            for p in a.precisions.split(","):
                for name, make in PERTURBATIONS.items():
                    d, where = smallest_detected(fam, p, w, make)
                    print(f"| {fam} | {w} | {p} | {name} | {'not at 0.1' if d is None else f'{d:g}'} | {where} |",
                          flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

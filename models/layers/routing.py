"""Expert selection, the part of routing every family configures (ModelArgs.router):
shared by the production router (models/layers/) and the reference, which records each
token's *selection scores* (what the family's own top-k ranks) to measure near ties and to
find a probe token for every expert.

Shapes: N tokens, E experts, G groups of E/G experts.
"""

from __future__ import annotations

import torch

from models.args import ModelArgs


def scores(logits, a: ModelArgs):
    """Routing scores [N, E] fp32: softmax over all experts, a sigmoid per expert, or the logits
    themselves (sparsemixer: the weights are computed from them by sparsemixer_weights)."""
    if a.router.scoring == "sigmoid":
        return torch.sigmoid(logits.float())
    if a.router.scoring == "sparsemixer":
        return logits.float()
    if a.router.scoring == "sqrtsoftplus":  # DeepSeek-V4: in the logits' dtype, as HF's SqrtSoftplusActivation
        return torch.nn.functional.softplus(logits).sqrt().float()
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def choice_scores(logits, probs, a: ModelArgs):
    """What the family's choice ranks [N, E] before its correction bias: the scores `probs`, or the fp32 logits
    (RouterArgs.choice_on "logits": Kolibri-1)."""
    return logits.float() if a.router.choice_on == "logits" else probs


def group_scores(choice, a: ModelArgs):
    """[N, E] -> [N, G]: each group's score, the sum of its best two (DeepSeek-V3) or its best (V2)."""
    grouped = choice.view(choice.shape[0], a.router.n_group, -1)
    if a.router.group_score == "max":
        # amax, not a top-1 topk: IREE 3.13's llvm-cpu fails to compile that one here ('linalg.generic'
        # op write affecting operations on global resources ...). amax lowers to max.dim, which the MLX
        # delegate does not take (measured on glm4_moe's group choice): V2's only user, whose MLX
        # program stops first at its MLA cache write
        return grouped.amax(dim=-1)
    return grouped.topk(2, dim=-1).values.sum(dim=-1)


def selection(probs, bias, a: ModelArgs):
    """The scores the top-k ranks [N, E]: probs (+ the correction bias, which decides the choice
    and never the weights), -inf outside the topk_group best groups when n_group > 1."""
    choice = probs + bias if bias is not None else probs
    r = a.router
    if r.n_group > 1:
        g = group_scores(choice, a)  # [N, G]
        # the kept groups: those at or above the topk_group-th group score (a comparison, not a
        # scatter of the top groups' indices: the MLX delegate takes no scatter)
        kth = torch.topk(g, r.topk_group, dim=-1).values[:, -1:]
        choice = outside_groups_masked(choice, g >= kth, a)
    return choice


def outside_groups_masked(choice, keep, a: ModelArgs):
    """[N, E] scores, -inf in the groups `keep` [N, G] (bool) leaves out (0: RouterArgs.group_mask_zero)."""
    keep = keep[:, :, None].expand(-1, -1, a.num_experts // a.router.n_group).reshape(choice.shape)
    return choice.masked_fill(~keep, 0.0 if a.router.group_mask_zero else float("-inf"))


def grouped(a: ModelArgs) -> bool:
    """Does the group limit decide anything (some groups left out)?"""
    return a.router.n_group > 1 and a.router.topk_group < a.router.n_group


def group_gap(probs, bias, a: ModelArgs):
    """[N]: the topk_group-th minus the next group's score (inf without a group limit): a group
    choice this close is as fragile as an expert choice."""
    if not grouped(a):
        return torch.full(probs.shape[:1], float("inf"))
    g = torch.sort(group_scores(probs + bias if bias is not None else probs, a), dim=-1, descending=True).values
    return g[:, a.router.topk_group - 1] - g[:, a.router.topk_group]


def group_alternative(probs, bias, a: ModelArgs, k: int):
    """[N, k]: the experts the top-k takes had the group choice gone the other way at its margin (the
    weakest kept group exchanged for the best left out): what a router whose group choice is a near
    tie (group_gap within the tie bound) may legitimately take instead."""
    choice = probs + bias if bias is not None else probs
    g = group_scores(choice, a)  # [N, G]
    order = torch.sort(g, dim=-1, descending=True).indices
    keep = order[:, : a.router.topk_group].clone()
    keep[:, -1] = order[:, a.router.topk_group]
    kept = torch.zeros_like(g, dtype=torch.bool).scatter_(1, keep, True)
    return torch.topk(outside_groups_masked(choice, kept, a), k, dim=-1).indices


def mask_margin(logits, k: int, eps: float):
    """[N]: how far sparsemixer's masks are from deciding otherwise, in logit units: for each of
    the k choices (the best, then the best of the others), the smallest |(m - s) - 2 eps max(|s|, m)|
    over the experts still in its softmax (m the chosen logit). An expert this close to the
    threshold is in or out of a choice's softmax by rounding: its weight is a near tie."""
    logits = logits.float()
    rest, margins = logits, []
    for _ in range(k):
        m = rest.max(dim=-1, keepdim=True).values
        d = ((m - logits) - 2 * eps * logits.abs().clamp(min=m)).abs()
        margins.append(d.masked_fill(rest == float("-inf"), float("inf")).min(dim=-1).values)
        rest = rest.masked_fill(rest == m, float("-inf"))
    return torch.stack(margins, dim=-1).min(dim=-1).values


def mask_flipped(logits, idx, eps: float):
    """[N, k]: sparsemixer's weights of the experts `idx` with each token's nearest mask decision taken
    the other way (the expert nearest a choice's threshold, mask_margin's, moved in or out of that
    choice's softmax): what a router whose mask is a near tie may legitimately weigh instead."""
    logits = logits.float()
    E, k = logits.shape[-1], idx.shape[-1]
    every = torch.arange(E, device=idx.device)
    rest, alts, margins = logits, [], []
    for j in range(k):
        hit = idx[:, j : j + 1] == every  # [N, E]
        m = torch.where(hit, logits, 0.0).sum(-1, keepdim=True)
        factor = logits.abs().clamp(min=m)
        out = (m - logits) / factor > 2 * eps  # left out of choice j's softmax
        d = ((m - logits) - 2 * eps * factor).abs().masked_fill((rest == float("-inf")) | hit, float("inf"))
        toggled = every == d.argmin(dim=-1, keepdim=True)
        p = torch.softmax(rest.masked_fill(out ^ toggled, float("-inf")), dim=-1)
        alts.append(torch.where(hit, p, 0.0).sum(-1))
        margins.append(d.min(dim=-1).values)
        rest = rest.masked_fill(hit, float("-inf"))
    alts, margins = torch.stack(alts, dim=-1), torch.stack(margins, dim=-1)  # [N, k]
    nearest = (torch.arange(k, device=idx.device) == margins.argmin(dim=-1, keepdim=True)) & torch.isfinite(margins)
    return torch.where(nearest, alts, sparsemixer_weights(logits, idx, eps))


def weight_alternative(scores, idx, a: ModelArgs):
    """[N, k]: the weights of the experts `idx` had the nearest decision that sets them (weight_gap's)
    gone the other way; None where no discrete decision sets the weights."""
    return mask_flipped(scores, idx, a.router.jitter_eps) if weighs_discretely(a) else None


def weighs_discretely(a: ModelArgs) -> bool:
    """Does a discrete decision set the top-k weights (sparsemixer's masks)?"""
    return a.router.scoring == "sparsemixer"


def weight_gap(probs, a: ModelArgs):
    """[N]: the margin of the decisions that set the weights (mask_margin: top-2 whatever k says),
    in the units of the selection scores (sparsemixer's are its logits)."""
    return mask_margin(probs, 2, a.router.jitter_eps)


def pick(probs, idx):
    """probs [N, E] at idx [N, k] -> [N, k], without a gather (the MLX delegate takes none): each
    row's one matching expert, summed with zeros (exact)."""
    hit = idx[..., None] == torch.arange(probs.shape[-1], device=idx.device)  # [N, k, E]
    return torch.where(hit, probs[:, None, :], 0.0).sum(dim=-1)


def sparsemixer_weights(logits, idx, eps: float):
    """PhiMoE's sparsemixer at inference, top-2 [N, 2]: idx[:, 0] is the best logit, idx[:, 1] the
    best of the others. Choice j's weight is its softmax probability among the experts whose logit
    is within 2 eps of it (relative: (m - s) / max(|s|, m) <= 2 eps, m its logit), the experts
    chosen before it left out. Comparisons, masked_fill and sums only (no scatter, no gather, no
    boolean and: IREE 3.13 does not legalize aten.__and__ on i1)."""
    E = logits.shape[-1]
    out, rest = [], logits  # rest: the logits, -inf where an earlier choice is
    for j in range(idx.shape[-1]):
        hit = idx[:, j : j + 1] == torch.arange(E, device=idx.device)  # [N, E]
        m = torch.where(hit, logits, 0.0).sum(-1, keepdim=True)  # the chosen logit [N, 1]
        factor = logits.abs().clamp(min=m)
        p = torch.softmax(rest.masked_fill((m - logits) / factor > 2 * eps, float("-inf")), dim=-1)
        out.append(torch.where(hit, p, 0.0).sum(-1))
        rest = rest.masked_fill(hit, float("-inf"))
    return torch.stack(out, dim=-1)


def topk_weights(probs, idx, a: ModelArgs, norm: bool | None = None):
    """The weights of the experts `idx` [N, k] from the routing scores [N, E] (`scores`): their scores,
    renormalised over the k (norm_topk_prob, with norm_topk_min's floor), times routed_scaling_factor;
    sparsemixer's from its logits. The production router's weights (models/layers/) and a forced
    selection's in the routing-aligned reference (oracle/verdict/replay.py). `norm`: renormalise or not, where a
    router instance decides (a seeded fault drops it: models/faults/); default the config's."""
    r = a.router
    norm = r.norm_topk_prob if norm is None else norm
    if r.scoring == "sparsemixer":
        return sparsemixer_weights(probs, idx, r.jitter_eps)
    w = pick(probs, idx)
    if norm and r.norm_topk_min:
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=r.norm_topk_min)
    elif norm and r.norm_p != 1.0:  # DBRX's moe_normalize_expert_weights
        w = w / torch.linalg.vector_norm(w, ord=r.norm_p, dim=-1, keepdim=True)
    elif norm:
        w = w / (w.sum(dim=-1, keepdim=True) + r.norm_eps)
    return w * r.routed_scaling_factor

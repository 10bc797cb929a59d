"""White-box probe: capture the module's Q, K, V projections and find which formula its output follows.

The module's ``nn.Linear`` submodules are hooked; those fed with the input are the projections
(one fused or three separate), the last one fed with something else is the output projection.
The attention is then recomputed from the captured Q, K, V under the correct definition and under
each known bug; the formula that reproduces the module's output names the bug.

Shape legend: B batch, H heads, L length, E embed dim, D = E // H head dim.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

_ROLE_PATTERNS = {
    "q": re.compile(r"(^|[._])(q|wq|query|queries|q_proj|to_q|query_proj)$"),
    "k": re.compile(r"(^|[._])(k|wk|key|keys|k_proj|to_k|key_proj)$"),
    "v": re.compile(r"(^|[._])(v|wv|value|values|v_proj|to_v|value_proj)$"),
}


@dataclass
class Capture:
    q: Tensor  # (B, L, E)
    k: Tensor
    v: Tensor
    out_proj: nn.Linear | None
    how: str


def capture(module: nn.Module, call: Callable[[], Tensor], x: Tensor) -> Capture | str:
    """Run ``call`` with hooks on every nn.Linear; return the projections or why they were not found."""
    calls: list[tuple[str, nn.Linear, Tensor, Tensor]] = []
    handles = []
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(
                lambda mod, inp, out, name=name: calls.append((name, mod, inp[0].detach(), out.detach()))))
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    if not calls:
        return "no nn.Linear submodule was called (projections done another way)"
    from_x = [(n, m, o) for n, m, i, o in calls if i.shape == x.shape and torch.equal(i, x)]
    others = [(n, m) for n, m, i, _ in calls if not (i.shape == x.shape and torch.equal(i, x))]
    out_proj = others[-1][1] if others else None
    e = x.shape[-1]
    if len(from_x) == 1:
        name, m, o = from_x[0]
        rest = o.shape[-1] - e
        if rest <= 0 or rest % 2:
            return f"one projection {name!r} of width {o.shape[-1]} is not a fused q/k/v of embed dim {e}"
        q, k, v = o.split([e, rest // 2, rest // 2], dim=-1)
        return Capture(q, k, v, out_proj, f"fused projection {name!r} split as [q | k | v]")
    if len(from_x) == 3:
        roles: dict[str, Tensor] = {}
        for name, _, o in from_x:
            for role, pat in _ROLE_PATTERNS.items():
                if pat.search(name) and role not in roles:
                    roles[role] = o
        if len(roles) == 3:
            how = "separate projections, recognised by name"
        else:
            roles = dict(zip("qkv", (o for _, _, o in from_x), strict=True))
            how = "separate projections, taken in call order as q, k, v"
        return Capture(roles["q"], roles["k"], roles["v"], out_proj, how)
    return f"{len(from_x)} projections of the input were found; expected 1 (fused) or 3 (q, k, v)"


def _heads(t: Tensor, h: int) -> Tensor:
    b, length, e = t.shape
    return t.reshape(b, length, h, e // h).transpose(1, 2)  # (B, H, L, D)


def _masked(s: Tensor, keep: Tensor | None) -> Tensor:
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def variants(cap: Capture, h: int, keep: Tensor | None) -> dict[str, list[tuple[str, Callable[[], Tensor]]]]:
    """Candidate outputs (before the output projection), by finding id; "correct" is the definition.

    keep: bool (B, 1, L, L) or None, True = may attend.
    """
    e = cap.q.shape[-1]
    d = e // h
    qh, kh, vh = (_heads(t.double(), h) for t in (cap.q, cap.k, cap.v))
    b, _, length, _ = qh.shape
    scores = qh @ kh.transpose(-1, -2)  # (B, H, L, L)

    def merge(o: Tensor) -> Tensor:
        return o.transpose(1, 2).reshape(b, length, e)

    def soft(scale: float, dim: int = -1) -> Tensor:
        return torch.softmax(_masked(scores * scale, keep), dim=dim).nan_to_num(0)

    out: dict[str, list[tuple[str, Callable[[], Tensor]]]] = {
        "correct": [("softmax(QK^T / sqrt(D)) V", lambda: merge(soft(1 / math.sqrt(d)) @ vh))],
        "missing-scale": [("softmax(QK^T) V, no 1/sqrt(D)", lambda: merge(soft(1.0) @ vh))],
        "wrong-scale": [("scaled by 1/D", lambda: merge(soft(1 / d) @ vh))],
        "softmax-dim": [("softmax over the query dimension", lambda: merge(soft(1 / math.sqrt(d), -2) @ vh))],
        "matmul-order": [("weights transposed before V", lambda: merge(soft(1 / math.sqrt(d)).transpose(-1, -2) @ vh))],
    }
    if h > 1:
        out["wrong-scale"].append(("scaled by 1/sqrt(E) (embed dim, not head dim)",
                                   lambda: merge(soft(1 / math.sqrt(e)) @ vh)))
        out["head-merge"] = [("heads merged with view/reshape without transposing back",
                              lambda: (soft(1 / math.sqrt(d)) @ vh).reshape(b, length, e))]
    if h == 1:
        out["softmax-dim"].append(("softmax over the batch dimension",
                                   lambda: merge(soft(1 / math.sqrt(d), 0) @ vh)))
        if length == d:
            out["matmul-order"].append(("V @ weights instead of weights @ V",
                                        lambda: merge(vh @ soft(1 / math.sqrt(d)))))
    if keep is not None:
        out["mask-after-softmax"] = [("mask applied to the weights after softmax (not renormalised)",
                                      lambda: merge(torch.softmax(scores / math.sqrt(d), -1) * keep @ vh))]
    return out


def identify(cap: Capture, module_out: Tensor, heads: list[int], keep: Tensor | None,
             rtol: float = 1e-3) -> tuple[str | None, dict]:
    """(finding id or None if correct, evidence). Raises LookupError if no formula matches."""
    target = module_out.double()
    scale = 1 + target.abs().max().item()
    best: tuple[float, str, str, int] | None = None
    for h in heads:
        if cap.q.shape[-1] % h or cap.k.shape[-1] != cap.q.shape[-1]:
            continue
        for fid, forms in variants(cap, h, keep).items():
            for desc, fn in forms:
                try:
                    cand = fn()
                    if cap.out_proj is not None:
                        w = cap.out_proj.weight.double()
                        bias = None if cap.out_proj.bias is None else cap.out_proj.bias.double()
                        cand = nn.functional.linear(cand, w, bias)
                except RuntimeError:
                    continue
                if cand.shape != target.shape:
                    continue
                err = (cand - target).abs().max().item() / scale
                if best is None or err < best[0]:
                    best = (err, fid, desc, h)
                if fid == "correct" and err < rtol:
                    return None, {"formula": desc, "heads": h, "relative error": err}
    if best is not None and best[0] < rtol:
        return best[1], {"matches": best[2], "heads": best[3], "relative error": best[0]}
    raise LookupError("no known formula reproduces the output" +
                      ("" if best is None else f" (closest: {best[2]}, relative error {best[0]:.2g})"))

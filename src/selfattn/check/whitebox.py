"""White-box probe: capture the module's Q, K, V projections and find which formula its output follows.

Every linear map the module applies (``nn.Linear`` or ``F.linear``, transformers' ``Conv1D``, the
packed projections of ``nn.MultiheadAttention``) is recorded while the module runs; those fed with
the input are the projections (one fused or three separate), the last one fed with something else
is the output projection. The softmax inputs are recorded too. The attention is then recomputed
from the captured Q, K, V under the definition and under each known bug, with rotary positions when
plain Q, K do not fit; the formula that reproduces the module's output names the bug. A module
whose scores differ from Q K^T / sqrt(D) by a term that depends only on (head, query, key) has a
relative-position bias.

Shape legend: B batch, H query heads, G kv heads, L length, E embed dim, D head dim.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["Capture", "capture", "identify", "qkv_heads"]

_ROLE_PATTERNS = {
    "q": re.compile(r"(^|[._])(q|wq|query|queries|q_proj|to_q|query_proj)$"),
    "k": re.compile(r"(^|[._])(k|wk|key|keys|k_proj|to_k|key_proj)$"),
    "v": re.compile(r"(^|[._])(v|wv|value|values|v_proj|to_v|value_proj)$"),
}
_ROPE_BASES = (10000.0, 500000.0, 1000000.0)

Project = Callable[[Tensor], Tensor]  # (..., E_in) float64 -> (..., E_out) float64


@dataclass
class Capture:
    """The module's projections of x and what it fed to softmax, from one run."""

    q: Tensor  # (B, L, E)
    k: Tensor  # (B, L, G * D)
    v: Tensor  # (B, L, G * D)
    out_proj: Project | None
    how: str
    softmax_in: list[Tensor] = field(default_factory=list)  # each (..., L, L), last dim normalised


def _linear(weight: Tensor, bias: Tensor | None) -> Project:
    w, b = weight.detach().double(), None if bias is None else bias.detach().double()
    return lambda t: nn.functional.linear(t, w, b)


def _module_map(module: nn.Module) -> Project:
    twin = copy.deepcopy(module).double()
    return lambda t: twin(t)


class _Recorder(TorchFunctionMode):
    """Records F.linear, softmax and nn.MultiheadAttention's functional core while the module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linears: list[tuple[str, Tensor, Tensor, Project]] = []  # (name, input, output, map)
        self.softmax_in: list[Tensor] = []
        self.mha: list[tuple[Tensor, Tensor, Tensor, Tensor, Project]] = []  # (input, q, k, v, out map)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is nn.functional.linear:
            self.linears.append(("F.linear", args[0].detach(), out.detach(), _linear(args[1], args[2] if len(args) > 2
                                                                                    else kwargs.get("bias"))))
        elif func in (torch.softmax, Tensor.softmax, nn.functional.softmax) and isinstance(args[0], Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim in (-1, args[0].dim() - 1):
                self.softmax_in.append(args[0].detach())
        elif func is nn.functional.multi_head_attention_forward:
            self._mha(args, kwargs)
        return out

    def _mha(self, args: tuple, kwargs: dict) -> None:
        a = inspect.signature(nn.functional.multi_head_attention_forward).bind(*args, **kwargs).arguments
        if a.get("use_separate_proj_weight") or a["in_proj_weight"] is None:
            return
        w, b, e = a["in_proj_weight"].detach(), a["in_proj_bias"], a["embed_dim_to_check"]
        bs = [None] * 3 if b is None else b.detach().split(e)
        q, k, v = (nn.functional.linear(t.transpose(0, 1), wi, bi)
                   for t, wi, bi in zip((a["query"], a["key"], a["value"]), w.split(e), bs, strict=True))
        self.mha.append((a["query"].transpose(0, 1).detach(), q, k, v,
                         _linear(a["out_proj_weight"], a["out_proj_bias"])))


def capture(module: nn.Module, call: Callable[[], Tensor], x: Tensor) -> Capture | str:
    """Run ``call`` recording the module's linear maps; return the projections or why they were not found."""
    rec = _Recorder()
    handles = []
    for name, m in module.named_modules():  # weight-carrying leaves that do not go through F.linear (Conv1D)
        weight = getattr(m, "weight", None)
        if not isinstance(m, nn.Linear) and not list(m.children()) and isinstance(weight, Tensor) and weight.dim() == 2:
            handles.append(m.register_forward_hook(lambda mod, inp, out, name=name: rec.linears.append(
                (name, inp[0].detach(), out.detach(), _module_map(mod)))))
    try:
        with torch.no_grad(), rec:
            call()
    finally:
        for h in handles:
            h.remove()
    for xin, q, k, v, out_map in rec.mha:
        if xin.shape == x.shape and torch.equal(xin, x):
            return Capture(q, k, v, out_map, "nn.MultiheadAttention's packed in-projection", rec.softmax_in)
    if not rec.linears:
        return "no linear map was applied (projections done another way)"

    def is_x(t: Tensor) -> bool:
        return t.shape == x.shape and torch.equal(t, x)

    from_x = [(n, o) for n, i, o, _ in rec.linears if is_x(i)]
    others = [p for _, i, _, p in rec.linears if not is_x(i)]
    out_proj = others[-1] if others else None
    e = x.shape[-1]
    if len(from_x) == 1:
        name, o = from_x[0]
        rest = o.shape[-1] - e
        if rest <= 0 or rest % 2:
            return f"one projection {name!r} of width {o.shape[-1]} is not a fused q/k/v of embed dim {e}"
        q, k, v = o.split([e, rest // 2, rest // 2], dim=-1)
        return Capture(q, k, v, out_proj, f"fused projection {name!r} split as [q | k | v]", rec.softmax_in)
    if len(from_x) == 3:
        roles = _by_name(module, rec, x)
        if roles is not None:
            return Capture(roles["q"], roles["k"], roles["v"], out_proj, "separate projections, recognised by name",
                           rec.softmax_in)
        q, k, v = (o for _, o in from_x)
        return Capture(q, k, v, out_proj, "separate projections, taken in call order as q, k, v", rec.softmax_in)
    return f"{len(from_x)} projections of the input were found; expected 1 (fused) or 3 (q, k, v)"


def _by_name(module: nn.Module, rec: _Recorder, x: Tensor) -> dict[str, Tensor] | None:
    """q, k, v from nn.Linear submodules named like query/key/value, recomputed on x; None if not all three."""
    roles: dict[str, Tensor] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and m.in_features == x.shape[-1]:
            for role, pat in _ROLE_PATTERNS.items():
                if pat.search(name) and role not in roles:
                    with torch.no_grad():
                        roles[role] = m(x)
    return roles if len(roles) == 3 else None


def _heads(t: Tensor, h: int) -> Tensor:
    b, length, e = t.shape
    return t.reshape(b, length, h, e // h).transpose(1, 2)  # (B, H, L, D)


def _rope(t: Tensor, base: float, interleaved: bool) -> Tensor:
    """Rotary positions 0..L-1 applied to t (B, H, L, D): rotate-half (Llama) or interleaved pairs."""
    d, length = t.shape[-1], t.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(length, dtype=torch.float64)[:, None] * inv  # (L, D/2)
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), -1).flatten(-2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    half = torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1)
    return t * cos + half * sin


def _masked(s: Tensor, keep: Tensor | None) -> Tensor:
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _variants(qh: Tensor, kh: Tensor, vh: Tensor, keep: Tensor | None,
              raw: Tensor | None) -> dict[str, list[tuple[str, Callable[[], Tensor]]]]:
    """Candidate outputs (B, L, E) before the output projection, by finding id; "correct" is the definition.

    qh (B, H, L, D); kh, vh (B, H, L, D) (kv heads already repeated); keep (B, 1, L, L) bool or None;
    raw: the mask the module was given, as float (B, 1, L, L), for masks applied after the softmax.
    """
    b, h, length, d = qh.shape
    e = h * d
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
        out["softmax-dim"].append(("softmax over the batch dimension", lambda: merge(soft(1 / math.sqrt(d), 0) @ vh)))
        if length == d:
            out["matmul-order"].append(("V @ weights instead of weights @ V",
                                        lambda: merge(vh @ soft(1 / math.sqrt(d)))))
    if keep is not None:
        plain = torch.softmax(scores / math.sqrt(d), -1)
        out["mask-after-softmax"] = [("mask multiplied into the weights after softmax (not renormalised)",
                                      lambda: merge(plain * keep @ vh))]
        if raw is not None:
            out["mask-after-softmax"].append(("mask added to the weights after softmax",
                                              lambda: merge((plain + raw) @ vh)))
    return out


def _score_fit(cap: Capture, qh: Tensor, kh: Tensor) -> float:
    """Best correlation of Q K^T (B, H, L, L) with a captured softmax input, over its finite, unmasked entries."""
    scores = qh @ kh.transpose(-1, -2)
    best = -1.0
    for s in cap.softmax_in:
        if s.numel() != scores.numel():
            continue
        s = s.double().reshape(scores.shape)
        seen = torch.isfinite(s) & (s > -1e3)
        if seen.sum() < 4:
            continue
        a, b = s[seen] - s[seen].mean(), scores[seen] - scores[seen].mean()
        best = max(best, float((a @ b) / (a.norm() * b.norm() + 1e-30)))
    return best


def _project(cap: Capture, cand: Tensor) -> Tensor:
    return cand if cap.out_proj is None else cap.out_proj(cand)


def qkv_heads(cap: Capture, h: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """(q, k, v) as (B, H, L, D) float64 with ``h`` query heads, kv heads repeated (GQA); None if h does not fit."""
    e, kw = cap.q.shape[-1], cap.k.shape[-1]
    if e % h or kw % (e // h):
        return None
    g = kw // (e // h)
    if h % g:
        return None
    qh, kh, vh = _heads(cap.q.double(), h), _heads(cap.k.double(), g), _heads(cap.v.double(), g)
    return qh, kh.repeat_interleave(h // g, 1), vh.repeat_interleave(h // g, 1)


def _position_forms(qh: Tensor, kh: Tensor) -> list[tuple[str | None, Tensor, Tensor]]:
    forms: list[tuple[str | None, Tensor, Tensor]] = [(None, qh, kh)]
    if qh.shape[-1] % 2:  # rotary positions rotate pairs of features
        return forms
    for base in _ROPE_BASES:
        for inter in (False, True):
            how = f"rotary positions ({'interleaved pairs' if inter else 'rotate-half'}, base {base:g})"
            forms.append((how, _rope(qh, base, inter), _rope(kh, base, inter)))
    return forms


def identify(cap: Capture, module_out: Tensor, heads: list[int], keep: Tensor | None, raw: Tensor | None = None,
             known_bias: Tensor | None = None, rtol: float = 1e-3) -> tuple[str | None, dict]:
    """Which formula the module's output follows.

    Args:
        cap: the captured projections.
        module_out: (B, L, E) the module's output in the captured run.
        heads: head counts to try.
        keep: (B, 1, L, L) bool or None, True = may attend (the mask the module was given, as keep).
        raw: (B, 1, L, L) float or None, the mask's values as the module received them.
        known_bias: (H, L, L) the relative-position bias found in a run without mask; with a mask,
            only that bias is accepted (a mask is itself a term of (query, key)).
        rtol: largest error, relative to 1 + max |output|, that counts as a match.

    Returns:
        (finding id, or None when the output follows the definition; evidence with "formula" or
        "matches", "heads", "relative error", and "positions" when rotary positions or a
        relative-position bias were found; "_bias", the (H, L, L) bias, for the caller only).

    Raises:
        LookupError: no formula reproduces the output; the message names the closest one.
    """
    target = module_out.double()
    scale = 1 + target.abs().max().item()
    best: tuple[float, str, str, int, str | None] | None = None
    for positions_needed in (False, True):
        for h in heads:
            split = qkv_heads(cap, h)
            if split is None:
                continue
            qh, kh, vh = split
            forms = _position_forms(qh, kh)
            if positions_needed:  # only the rotary form whose scores best fit the softmax input: bugs are tried on it
                forms = sorted(forms[1:], key=lambda f: -_score_fit(cap, f[1], f[2]))[:1 if cap.softmax_in else None]
            for positions, qp, kp in forms[:1] if not positions_needed else forms:
                for fid, candidates in _variants(qp, kp, vh, keep, raw).items():
                    for desc, fn in candidates:
                        try:
                            cand = _project(cap, fn())
                        except RuntimeError:
                            continue
                        if cand.shape != target.shape:
                            continue
                        err = (cand - target).abs().max().item() / scale
                        label = desc if positions is None else f"{desc}, with {positions}"
                        if best is None or err < best[0]:
                            best = (err, fid, label, h, positions)
                        if fid == "correct" and err < rtol:
                            return None, {"formula": label, "heads": h, "relative error": err,
                                          **({"positions": positions} if positions else {})}
        if best is not None and best[0] < rtol:
            return best[1], {"matches": best[2], "heads": best[3], "relative error": best[0],
                             **({"positions": best[4]} if best[4] else {})}
    bias = _relative_bias(cap, target, heads, keep, known_bias, scale, rtol)
    if bias is not None:
        return None, bias
    raise LookupError("no known formula reproduces the output" +
                      ("" if best is None else f" (closest: {best[2]}, relative error {best[0]:.2g})"))


def _relative_bias(cap: Capture, target: Tensor, heads: list[int], keep: Tensor | None, known: Tensor | None,
                   scale: float, rtol: float) -> dict | None:
    """Evidence of a relative-position bias: the softmax input minus Q K^T / sqrt(D) depends only on
    (head, query, key) (with a mask: equals ``known``), and softmax(that input) V reproduces the
    output; None otherwise."""
    if keep is not None and known is None:
        return None
    for s in cap.softmax_in:
        for h in heads:
            split = qkv_heads(cap, h)
            if split is None:
                continue
            qh, kh, vh = split
            b, _, length, _ = qh.shape
            if b < 2 or s.shape[-2:] != (length, length) or s.numel() != b * h * length * length:
                continue
            s4 = s.double().reshape(b, h, length, length)
            plain = qh @ kh.transpose(-1, -2) / math.sqrt(qh.shape[-1])
            seen = torch.isfinite(s4) & (s4 > -1e4) & (True if keep is None else keep)
            if not seen.any():
                continue
            diff = torch.where(seen, s4 - plain, torch.zeros((), dtype=torch.float64))
            ref = diff[:1] if known is None else known[None]
            size = 1 + diff.abs().max().item()
            if (diff - ref).abs().masked_fill(~seen, 0).max().item() > rtol * size or diff.abs().max().item() < rtol:
                continue
            out = _project(cap, (torch.softmax(s4, -1).nan_to_num(0) @ vh).transpose(1, 2).reshape(b, length, -1))
            err = (out - target).abs().max().item() / scale
            if out.shape == target.shape and err < rtol:
                return {"formula": "softmax(QK^T / sqrt(D) + bias(head, query, key)) V", "heads": h,
                        "relative error": err, "positions": "a relative-position bias (depends only on query, key)",
                        "_bias": diff[0]}
    return None

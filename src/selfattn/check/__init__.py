"""The attention doctor: run a user's attention module and certify it, or name each bug.

``selfattn.check(module)`` (or ``selfattn check file.py:Class``) runs black-box probes (shapes,
batch independence, permutation equivariance, mask convention and isolation, causality, fully
masked rows, extreme logits, half precision, eval determinism, gradients) and a white-box probe
(Q, K, V captured from the module's nn.Linear layers, the attention recomputed under the correct
definition and under each known bug). It depends on the public selfattn API only.

Shape legend: B batch, L length, E embed dim, H heads.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from . import whitebox
from .target import (
    Caller,
    CannotRun,
    accepts_mask,
    build,
    dependency,
    embed_dim_of,
    find_call_style,
    load_class,
    num_heads_of,
)

__all__ = ["FINDING_IDS", "CannotRun", "Finding", "Report", "check"]

FIXES = {
    "batch-mixing": "Keep the batch dimension apart: transpose only the last two dims (k.transpose(-2, -1)), "
                    "never the whole tensor (.T), and normalise over keys only.",
    "missing-scale": "Divide the scores by sqrt(head_dim) before the softmax.",
    "wrong-scale": "Scale the scores by 1/sqrt(head_dim), the size of one head's q/k vectors "
                   "(not head_dim, not embed_dim).",
    "softmax-dim": "Take the softmax over the keys: torch.softmax(scores, dim=-1).",
    "matmul-order": "Compute weights @ V (weights: (..., Lq, Lk), V: (..., Lk, D)), not V @ weights or "
                    "weights^T @ V.",
    "head-merge": "Merge heads with out.transpose(1, 2).reshape(B, L, E) (transpose before view/reshape).",
    "mask-ignored": "Apply the mask to the scores before the softmax (scores.masked_fill(~visible, -inf)).",
    "mask-inverted": "Flip the mask polarity (or fix the convention you documented): keep = may attend.",
    "mask-after-softmax": "Mask the scores before the softmax, so the weights of visible keys sum to 1.",
    "causal-leak": "Hide exactly the future: visible when j <= i (torch.ones(L, L).tril() as keep-mask); "
                   "the diagonal must stay visible.",
    "nan-on-masked-row": "Give rows with no visible key an output of 0 (or use a finite fill), e.g. "
                         "selfattn.attention, which returns 0 there.",
    "half-precision-overflow": "Fill masked scores with a dtype-safe value (torch.finfo(scores.dtype).min "
                               "or -inf with a guard for empty rows), not a float32 constant like -1e9.",
    "non-finite": "Subtract the row max before exp (torch.softmax does) and keep the scores finite.",
    "dropout-in-eval": "Use nn.Dropout (or F.dropout(..., training=self.training)) so eval() turns it off.",
    "no-grad": "Don't detach or compute under no_grad inside forward; every parameter should get a gradient.",
    "not-equivariant": "Without positions or masks, attention must commute with permuting the tokens; "
                       "look for reshapes that mix positions (if the module adds positions, this is expected).",
    "wrong-output-shape": "Return (B, L, E) for input (B, L, E).",
    "shape-dependent": "The module runs only for some shapes: look for .T, view() or matmuls whose sizes match "
                       "only by accident.",
}
FINDING_IDS = tuple(FIXES)

# A white-box diagnosis explains these black-box symptoms, which are then not reported twice.
_EXPLAINS = {
    "softmax-dim": {"batch-mixing", "not-equivariant", "causal-leak", "nan-on-masked-row", "mask-ignored"},
    "matmul-order": {"batch-mixing", "not-equivariant", "causal-leak", "shape-dependent", "wrong-output-shape",
                     "mask-ignored"},
    "head-merge": {"batch-mixing", "not-equivariant", "causal-leak", "mask-ignored"},
    "batch-mixing": {"not-equivariant", "shape-dependent", "wrong-output-shape", "causal-leak", "mask-ignored"},
    "mask-after-softmax": {"mask-ignored"},
    "causal-leak": {"mask-ignored"},  # a row the broken causal mask empties sees padding too
    "dropout-in-eval": {"batch-mixing", "not-equivariant", "mask-ignored", "causal-leak"},  # random outputs
}

_RTOL = 1e-4


@dataclass
class Finding:
    id: str
    message: str
    evidence: dict
    fix: str


@dataclass
class Report:
    passed: bool
    inferred: dict
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "inferred": self.inferred, "findings": [asdict(f) for f in self.findings]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    @property
    def ids(self) -> set[str]:
        return {f.id for f in self.findings}


def _close(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= _RTOL * (1 + b.abs().max())).all())


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / (1 + b.abs().max()))


class _Doctor:
    def __init__(self, module: nn.Module, built: str | None, *, mask_convention: str | None, causal: bool,
                 seed: int) -> None:
        self.m = module.eval()
        self.findings: dict[str, Finding] = {}
        self.inferred: dict = {"module": type(module).__name__}
        if built:
            self.inferred["built as"] = built
        self.declared = mask_convention
        self.causal_required = causal
        self.e = embed_dim_of(module, 16)
        self.inferred["embed_dim"] = self.e
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, fid: str, message: str, evidence: dict) -> None:
        if fid not in self.findings:
            self.findings[fid] = Finding(fid, message, evidence, FIXES[fid])

    def randn(self, *shape: int) -> Tensor:
        return torch.randn(*shape, generator=self.gen)

    # -- shapes and calling --------------------------------------------------------------------
    def shapes(self) -> Tensor:
        e = self.e
        shapes = [(3, 7), (2, 5), (1, 6), (2, e), (1, e)] + ([(e, e)] if e <= 64 else [])
        ran, failed, wrong = [], [], []
        self.style = ""
        reasons = []
        for b, length in shapes:
            x = self.randn(b, length, e)
            if not self.style:
                style, why = find_call_style(self.m, x)
                if not style:
                    failed.append(((b, length, e), why))
                    reasons.append(why)
                    continue
                self.style = style
                self.call = Caller(self.m, style)
            try:
                with torch.no_grad():
                    out = self.call(x)
            except Exception as err:
                failed.append(((b, length, e), f"{type(err).__name__}: {err}"))
                continue
            (ran if tuple(out.shape) == (b, length, e) else wrong).append(((b, length, e), tuple(out.shape)))
        if not ran and not wrong:
            last = reasons[-1] if reasons else failed[-1][1]
            raise CannotRun(f"the module failed on every input shape tried: {last}")
        self.inferred["call"] = "forward(x)" if self.style == "x" else "forward(q, k, v) with q = k = v = x"
        self.inferred["output"] = "tensor (or first item of a tuple)"
        if wrong:
            self.add("wrong-output-shape", "the output shape differs from the input shape (B, L, E)",
                     {"input -> output": {str(i): str(o) for i, o in wrong}})
        if failed and (ran or wrong):
            lined_up = all(len({*s}) < 3 for s, _ in ran + wrong)  # two of B, L, E coincide
            evidence = {"runs for": [str(s) for s, _ in ran + wrong],
                        "fails for": {str(s): why[:200] for s, why in failed}}
            if lined_up:
                self.add("batch-mixing", "the module runs only when batch, length and embed sizes line up: "
                         "it mixes the batch or sequence dimension with another", evidence)
            else:
                self.add("shape-dependent", "the module runs for some valid shapes and fails for others", evidence)
        good = [s for s, _ in ran]
        if not good:
            raise CannotRun("the module never returned a (B, L, E) output; see wrong-output-shape")
        b, length, e = good[0] if (3, 7, e) not in good else (3, 7, e)
        self.inferred["probe shape"] = (b, length, e)
        return self.randn(b, length, e)

    # -- black-box probes ----------------------------------------------------------------------
    def determinism(self, x: Tensor) -> None:
        with torch.no_grad():
            a, b = self.call(x), self.call(x)
        if not torch.equal(a, b):
            self.add("dropout-in-eval", "two calls in eval mode on the same input differ: something random "
                     "(dropout) is still active", {"max difference": float((a - b).abs().max())})

    def finite(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            out = self.call(x)
        if not torch.isfinite(out).all():
            self.add("non-finite", "the output has NaN or inf on ordinary random input",
                     {"non-finite values": int((~torch.isfinite(out)).sum())})
        big = x * 50
        with torch.no_grad():
            out_big = self.call(big)
        if torch.isfinite(out).all() and not torch.isfinite(out_big).all():
            self.add("non-finite", "large logits (input x 50) give NaN or inf",
                     {"non-finite values": int((~torch.isfinite(out_big)).sum())})
        return out

    def batch_independence(self, x: Tensor, out: Tensor) -> None:
        if x.shape[0] < 2:
            return
        x2 = x.clone()
        x2[0] = self.randn(*x.shape[1:])
        with torch.no_grad():
            out2 = self.call(x2)
            try:
                single = self.call(x[1:2])
            except Exception as err:
                self.add("batch-mixing", "the module fails on one batch item alone but runs on the batch",
                         {"error on x[1:2]": f"{type(err).__name__}: {err}"[:200]})
                return
        if not _close(out2[1:], out[1:]) or not _close(single, out[1:2]):
            self.add("batch-mixing", "changing one batch item changes the output of another",
                     {"change in other items": _rel(out2[1:], out[1:]),
                      "item alone vs in batch": _rel(single, out[1:2])})

    def causality(self, x: Tensor) -> Tensor:
        dep = dependency(self.call, x)
        length = dep.shape[0]
        upper = torch.ones(length, length, dtype=torch.bool).triu(1)
        seen_future = dep & upper
        hidden = ~dep & ~upper  # past or self hidden
        if not seen_future.any():
            self.inferred["causal"] = True
            if hidden.any():
                self.add("causal-leak", "the causal mask hides more than the future (the diagonal or past keys)",
                         {"hidden (query, key) pairs with key <= query": hidden.nonzero().tolist()[:10]})
        else:
            self.inferred["causal"] = False
            if seen_future.sum() < upper.sum() or self.causal_required:
                self.add("causal-leak", "queries see future keys" +
                         ("" if self.causal_required else " (some future keys are hidden, others not)"),
                         {"future (query, key) pairs seen": seen_future.nonzero().tolist()[:10]})
        return dep

    def equivariance(self, x: Tensor, out: Tensor, dep: Tensor) -> None:
        if not dep.all():
            return  # some keys are hidden (causal or local attention): permutations need not commute
        perm = torch.randperm(x.shape[1], generator=self.gen)
        with torch.no_grad():
            out_p = self.call(x[:, perm])
        if not _close(out_p, out[:, perm]):
            self.add("not-equivariant", "permuting the input tokens does not permute the output the same way",
                     {"relative difference": _rel(out_p, out[:, perm])})

    def mask_convention(self, x: Tensor, dep: Tensor) -> None:
        if not accepts_mask(self.m, self.style):
            self.inferred["mask"] = "not accepted"
            return
        b, length, _ = x.shape
        i = torch.arange(length)
        keep = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)  # a band: no module has it built in
        keep_b = keep.expand(b, length, length)
        tried = {}
        for shape in ("BLL", "LL", "B1LL"):
            caller = Caller(self.m, self.style, shape, "keep")
            mask = caller.module_mask(keep_b)
            try:
                d = dependency(lambda t, c=caller, mk=mask: c(t, mk), x)
            except Exception as err:
                tried[shape] = f"{type(err).__name__}: {err}"[:160]
                continue
            eye = torch.eye(length, dtype=torch.bool)  # a row always depends on its own query
            as_keep, as_ignore = (keep & dep) | eye, (~keep & dep) | eye
            rows = (keep & dep).any(-1) & (~keep & dep).any(-1)  # rows where the two readings differ
            with torch.no_grad():
                changed = not _close(caller(x, mask), self.call(x))
            if torch.equal(d[rows], as_keep[rows]):
                convention = "keep"
            elif torch.equal(d[rows], as_ignore[rows]):
                convention = "ignore"
            elif not changed:
                tried[shape] = "accepted, but changed nothing"
                continue
            else:  # the mask acts, but leaks (e.g. applied after the softmax): the white box tells
                convention = self.declared or "keep"
                tried[shape] = "accepted; its effect matches neither convention, assumed " + convention
            self.mask_caller = Caller(self.m, self.style, shape, convention)
            self.inferred["mask"] = {"shape": {"BLL": "(B, L, L)", "LL": "(L, L)", "B1LL": "(B, 1, L, L)"}[shape],
                                     "convention": "True/1 = may attend" if convention == "keep" else "True = masked"}
            if shape in tried:
                self.inferred["mask"]["note"] = tried[shape]
            if self.declared and self.declared != convention:
                self.add("mask-inverted", f"you declared the '{self.declared}' convention, but the module treats "
                         f"the mask the other way ('{convention}')",
                         {"row 3 sees keys (declared mask keeps 1, 2, 3)": d[3].nonzero().flatten().tolist()})
            return
        if any("changed nothing" in v for v in tried.values()):
            self.add("mask-ignored", "the module accepts a mask but its output does not depend on it", tried)
        self.inferred["mask"] = {"not understood": tried}

    def masked_probes(self, x: Tensor, out: Tensor) -> None:
        caller = getattr(self, "mask_caller", None)
        if caller is None:
            return
        b, length, _ = x.shape
        n = length - 2
        keep = torch.ones(b, length, length, dtype=torch.bool)
        keep[0, :, n:] = False  # item 0: the last two keys are padding
        x2 = x.clone()
        x2[0, n:] = self.randn(length - n, x.shape[2])
        with torch.no_grad():
            a, c = caller(x, caller.module_mask(keep)), caller(x2, caller.module_mask(keep))
        if not _close(c[0, :n], a[0, :n]):
            self.add("mask-ignored", "changing padded (masked) keys changes the outputs of real tokens",
                     {"relative change": _rel(c[0, :n], a[0, :n])})
        dead = keep.clone()
        dead[:, 1] = False  # row 1 sees no key
        with torch.no_grad():
            o = caller(x, caller.module_mask(dead))
        self.dead_mask = caller.module_mask(dead)
        if not torch.isfinite(o).all():
            self.add("nan-on-masked-row", "a query row whose keys are all masked gives NaN or inf",
                     {"non-finite outputs": int((~torch.isfinite(o)).sum()), "masked row": 1})

    def half_precision(self, x: Tensor) -> None:
        notes = {}
        caller = getattr(self, "mask_caller", None)
        with torch.no_grad():
            ref_plain = self.call(x)
            ref_masked = caller(x, self.dead_mask) if caller is not None else None
        for dtype in (torch.float16, torch.bfloat16):
            m = copy.deepcopy(self.m).to(dtype).eval()
            for with_mask in ((False, True) if caller is not None else (False,)):
                label = f"{str(dtype)[6:]}{' with mask' if with_mask else ''}"
                c = Caller(m, self.style, caller.mask_shape if caller else None, caller.convention if caller else None)
                ref = ref_masked if with_mask else ref_plain
                try:
                    with torch.no_grad():
                        out = c(x.to(dtype), self.dead_mask) if with_mask else c(x.to(dtype))
                except Exception as err:
                    notes[label] = f"raises {type(err).__name__}: {err}"[:200]
                    continue
                if torch.isfinite(ref).all() and not torch.isfinite(out).all():
                    self.add("half-precision-overflow", f"in {label} the output has NaN or inf where float32 is "
                             "finite", {"dtype": label, "non-finite values": int((~torch.isfinite(out)).sum())})
                else:
                    notes[label] = f"ok (max difference to float32 {_rel(out.float(), ref):.2g})"
        self.inferred["half precision"] = notes

    def gradients(self, x: Tensor) -> None:
        m = self.m
        m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = self.call(xg)
        if not out.requires_grad:
            self.add("no-grad", "the output carries no gradient", {})
            return
        out.float().square().sum().backward()
        missing = [n for n, p in m.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
        if missing or xg.grad is None or not xg.grad.any():
            self.add("no-grad", "some parameters (or the input) receive no gradient",
                     {"parameters without gradient": missing, "input gets gradient": xg.grad is not None})
        m.zero_grad(set_to_none=True)

    # -- white box -----------------------------------------------------------------------------
    def white_box(self, x: Tensor) -> None:
        hint = num_heads_of(self.m)
        heads = [hint] if hint else [h for h in (1, 2, 4, 8, 16, 32) if self.e % h == 0]
        caller = getattr(self, "mask_caller", None)
        runs: list[tuple[str, Tensor | None]] = [("without mask", None)]
        if caller is not None:
            b, length, _ = x.shape
            i = torch.arange(length)
            keep = (i[None, :] <= i[:, None]).expand(b, length, length)
            runs.append(("with a causal mask", keep))
        if self.inferred.get("causal"):
            length = x.shape[1]
            own = torch.ones(length, length, dtype=torch.bool).tril()
            runs = [(label, own if k is None else k & own) for label, k in runs]
        results = {}
        for label, keep in runs:
            passes_mask = label != "without mask"

            def call(keep: Tensor | None = keep, passes_mask: bool = passes_mask) -> Tensor:
                return caller(x, caller.module_mask(keep)) if passes_mask else self.call(x)

            cap = whitebox.capture(self.m, call, x)
            if isinstance(cap, str):
                self.inferred["white box"] = f"skipped: {cap}"
                return
            with torch.no_grad():
                out = call()
            k4 = None if keep is None else keep.reshape(-1, 1, *keep.shape[-2:])
            try:
                fid, evidence = whitebox.identify(cap, out, heads, k4)
            except LookupError as err:
                results[label] = str(err)
                continue
            results[label] = "matches the definition" if fid is None else f"matches {fid}: {evidence.get('matches')}"
            if fid is not None:
                self.add(fid, f"the output follows a known bug ({label}): {evidence['matches']}",
                         {**evidence, "projections": cap.how})
        self.inferred["white box"] = results

    def report(self) -> Report:
        for fid, explained in _EXPLAINS.items():  # in order: the most specific diagnosis first
            if fid in self.findings:
                for other in sorted(explained & set(self.findings)):
                    self.findings[fid].evidence.setdefault("also seen", {})[other] = self.findings.pop(other).evidence
        findings = list(self.findings.values())
        return Report(passed=not findings, inferred=self.inferred, findings=findings)


def check(target: nn.Module | type | str, *, init: dict | None = None, embed_dim: int = 16,
          mask_convention: str | None = None, causal: bool = False, seed: int = 0) -> Report:
    """Run every probe on an attention module and return a :class:`Report`.

    Args:
        target: a module instance, an nn.Module subclass, or "path/to/file.py:ClassName"
            (the file is imported and run, never modified).
        init: constructor keyword arguments for a class; default: try the usual signatures
            with ``embed_dim``.
        mask_convention: "keep" (True/1 = may attend) or "ignore" (True = masked), if the
            module documents one; a module that behaves the other way gets ``mask-inverted``.
        causal: the module must be causal (queries never see later keys).
        seed: seed of the random probe inputs.

    Raises:
        CannotRun: the module could not be loaded, built or called at all.

    Example:
        >>> report = selfattn.check(MyAttention(64))
        >>> report.passed, [f.id for f in report.findings]
    """
    if mask_convention not in (None, "keep", "ignore"):
        raise ValueError(f"mask_convention must be 'keep', 'ignore' or None, got {mask_convention!r}")
    built = None
    if isinstance(target, str):
        target = load_class(target)
    if isinstance(target, type):
        target, built = build(target, init, embed_dim)
    if not isinstance(target, nn.Module):
        raise TypeError(f"check needs an nn.Module, a class or 'file.py:Class', got {type(target).__name__}")
    was_training = target.training
    grads = {n: p.grad for n, p in target.named_parameters()}  # the probes' backward must not eat these
    doc = _Doctor(target, built, mask_convention=mask_convention, causal=causal, seed=seed)
    try:
        return _run(doc, seed)
    finally:
        target.train(was_training)
        for n, p in target.named_parameters():
            p.grad = grads.get(n)


def _run(doc: _Doctor, seed: int) -> Report:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        x = doc.shapes()
        with torch.no_grad():
            out = doc.call(x)
        length = x.shape[1]
        dep = torch.ones(length, length, dtype=torch.bool)
        probes = [
            ("eval determinism", lambda: doc.determinism(x)),
            ("finite outputs", lambda: doc.finite(x)),
            ("batch independence", lambda: doc.batch_independence(x, out)),
            ("causality", lambda: doc.causality(x)),
            ("permutation equivariance", lambda: doc.equivariance(x, out, dep)),
            ("mask convention", lambda: doc.mask_convention(x, dep)),
            ("padding and masked rows", lambda: doc.masked_probes(x, out)),
            ("half precision", lambda: doc.half_precision(x)),
            ("gradients", lambda: doc.gradients(x)),
            ("white box", lambda: doc.white_box(x)),
        ]
        for name, probe in probes:
            try:
                result = probe()
            except Exception as err:  # a probe the module cannot take is reported, not fatal
                doc.inferred.setdefault("probes that raised", {})[name] = f"{type(err).__name__}: {err}"[:200]
                continue
            if name == "causality":
                dep = result
    return doc.report()


def render(report: Report, console) -> None:  # console: rich.console.Console
    """Print a readable report."""
    from rich.panel import Panel
    from rich.table import Table

    status = "[green]PASSED[/green]: no finding" if report.passed else \
        f"[red]{len(report.findings)} finding(s)[/red]"
    inferred = Table(show_header=False, box=None)
    for k, v in report.inferred.items():
        inferred.add_row(f"[bold]{k}[/bold]", json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))
    console.print(Panel(inferred, title="what the doctor inferred"))
    for f in report.findings:
        body = f"{f.message}\n\n[bold]evidence[/bold]: {json.dumps(f.evidence, default=str)[:1500]}\n\n" \
               f"[bold]fix[/bold]: {f.fix}"
        console.print(Panel(body, title=f"[red]{f.id}[/red]"))
    console.print(status)

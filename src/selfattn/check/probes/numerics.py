"""The doctor's numeric probes: half precision measured against float32, gradients against finite differences.

Half precision: a float16 and a bfloat16 copy of the module must run, stay finite and agree with the
float32 output (with and without a mask) within a tolerance derived from the dtype's epsilon and the
output's scale. Gradients: every parameter the call uses, and the input, get a gradient, and
autograd's directional derivative along random directions equals the finite difference of the
outputs, computed on the float64 copy (so a hand-written backward that is off shows).

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..findings import (
    HALF_PRECISION_MISMATCH,
    HALF_PRECISION_OVERFLOW,
    NO_GRAD,
    STATE_DEPENDENT,
    WRONG_GRADIENT,
    Finding,
)
from ..subject.building import cast_module, copy_module, name_role, norm_role
from ..subject.caller import Caller, module_state, restore
from ..subject.context import Context, Outcome, empty_row_keep, padded_rows, padding_keep, raised_inside_doctor, rel
from ..subject.flex import NO_BACKWARD_HERE, flex_written_out

__all__ = ["HALF_ULPS", "gradients", "half_precision"]

# A half-precision output may differ from float32's by this many epsilons of its dtype, relative to
# (1 + the largest |output|): the rounding of the projections, the scores and the weighted sum.
HALF_ULPS = 16
_PLATFORM = ("not implemented for", "does not support", "unsupported")
_OVERFLOW = ("value cannot be converted", "overflow")
_MIXED = ("expected scalar type", "mixed dtype", "must have the same dtype", "expected both", "dtype",
          "Expected query, key, and value to have the same")


def _eval(m: nn.Module) -> nn.Module:
    """``m`` in eval mode (some modules' ``train()`` returns None, so ``m.eval()`` is not chained)."""
    m.eval()
    return m


def _fix_for(err: Exception) -> str | None:
    """The fix text for a half-precision exception, when it is not the -1e9 overflow the catalogue's fix names."""
    text = str(err)
    if any(s in text for s in _OVERFLOW):
        return None
    if any(s in text for s in _MIXED):
        return ("An operation mixes float16/bfloat16 with float32 (a parameter, buffer or constant made in float32, "
                f"or an explicit .float()): {type(err).__name__}: {text[:160]}. Make it in the input's dtype "
                "(x.dtype) or cast its result back, so the module runs in the dtype it is given.")
    return (f"The module raises in half precision ({type(err).__name__}: {text[:160]}) where float32 runs; look at "
            "the operation the traceback names and keep it in the input's dtype.")


def half_precision(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """A copy in float16 and bfloat16 must run, stay finite and agree with float32.

    Args:
        ctx: the probe context.
        masked: the caller from :func:`~selfattn.check.probes.masking.mask_convention`; when given, each
            dtype is also run with a mask that leaves a query row (key-only masks: a sequence) without keys.

    Returns:
        Note half precision (per dtype: the difference to float32 and the tolerance); findings
        half-precision-overflow (raises, or NaN/inf where float32 is finite; the fix follows the
        exception seen) and half-precision-mismatch (finite but further from float32 than the
        dtype's rounding explains: a mask or a term dropped in half precision).
    """
    x32 = ctx.x.float()
    exact = ctx.x.dtype != torch.float32  # a float64 or half module: its float64 copy is the reference
    reference = ctx.exact_of(ctx.call) if exact else ctx.call
    ref_dtype = ctx.analysis_x.dtype if exact else torch.float32
    b, length = x32.shape[:2]
    keeps: dict[str, Tensor] = {}
    if masked is not None and masked.switch is None:
        keeps = {" with mask": padding_keep(b, length), " with an empty row": empty_row_keep(b, length,
                                                                                               masked.key_only)}
    refs: dict[str, Tensor] = {}
    with torch.no_grad():
        refs[""] = reference(x32.to(ref_dtype)).double()
        if masked is not None:
            rm = ctx.exact_of(masked) if exact else masked
            for suffix, keep in list(keeps.items()):
                try:
                    refs[suffix] = rm(x32.to(ref_dtype), rm.module_mask(keep)).double()
                except Exception as err:  # a mask the module refuses in full precision too (a row with no key)
                    if raised_inside_doctor(err):
                        raise
                    keeps.pop(suffix)
    notes: dict[str, str] = {}
    overflow: dict[str, str] = {}
    mismatch: dict[str, str] = {}
    fix: str | None = None
    for dtype in (torch.float16, torch.bfloat16):
        # as module.half() / .bfloat16() cast it: floating-point tensors only (.to(dtype) would also cast a complex
        # buffer, such as rotary's freqs_cis, to a real one and drop its imaginary part)
        m = ctx.module if ctx.x.dtype == dtype else \
            _eval(cast_module(copy_module(ctx.module), dtype))
        tol = HALF_ULPS * torch.finfo(dtype).eps
        base_err = None
        for suffix, ref in refs.items():
            if not torch.isfinite(ref).all():
                continue
            label = f"{str(dtype)[6:]}{suffix}"
            try:
                with torch.no_grad():
                    if suffix and masked is not None:
                        sent = masked.module_mask(keeps[suffix], dtype)
                        try:
                            out = masked.for_module(m)(x32.to(dtype), sent)
                        except Exception as err:  # a bool mask that the module turns into a float32 term
                            if not isinstance(sent, Tensor) or sent.dtype != torch.bool or raised_inside_doctor(err):
                                raise
                            try:
                                out = masked.for_module(m)(x32.to(dtype), sent.to(dtype))
                            except Exception:  # not that either: what the bool mask raised is the module's error
                                raise err from None
                            notes[f"{label} as 0/1"] = (
                                f"the bool mask raises ({type(err).__name__}: {err}"[:160] + "); the same mask as "
                                f"{str(dtype)[6:]} 0/1 values runs: the module takes float masks in its dtype")
                    else:
                        out = ctx.call.for_module(m)(x32.to(dtype))
            except Exception as err:  # float32 runs: the half copy should too
                text = f"{type(err).__name__}: {err}"
                said = str(err).lower()  # "not implemented for 'Half'", torch.fft's "Unsupported dtype Half"
                if any(s in said for s in _PLATFORM) and ("half" in said or "bfloat16" in said):
                    notes[label] = f"not run: {text[:160]} (an operation this device lacks in {str(dtype)[6:]})"
                    continue
                overflow[label] = f"raises {text}"[:200]
                fix = fix or _fix_for(err)
                continue
            judged = out
            if suffix and (padded := padded_rows(ctx.call, out)) is not None:
                # the doctor's mask added to a model's padding carried in another argument (each filled with its
                # dtype's minimum) overflows to -inf where both hide a key: the model never adds the two, and the
                # rows it pads are its own (the plain run, with the model's padding alone, judges them)
                judged = out[~padded]
            if not torch.isfinite(judged).all():
                if exact and suffix and masked is not None and \
                        not _finite_in_float32(ctx, masked, x32, keeps[suffix], judged.shape, out.shape):
                    # the float64 reference is finite, but a float32 copy called the same way is not: the NaN is
                    # the module's own on rows with no key (nn.MultiheadAttention's fast path), not its dtype's
                    notes[label] = "non-finite as in float32 called the same way (rows with no visible key)"
                    continue
                overflow[label] = f"{int((~torch.isfinite(out)).sum())} non-finite values"
                continue
            if suffix == " with an empty row":  # finite is all that is asked: a row with every key masked has no
                continue  # value to agree on (an additive fill shifts the whole row, which half precision rounds)
            if suffix == " with mask" and out.dim() == 3 and out.shape[:2] == keeps[suffix].shape[:2]:
                # the padded tokens' own rows are not compared: their keys may all be hidden once the module's own
                # pattern (a window) is added, a row with no value to agree on
                real = keeps[suffix].to(out.device).any(-2)  # (B, L): a key some query may see is a real token
                out, ref = out[real], ref[real]
            elif not suffix and (padded := padded_rows(ctx.call, out)) is not None:
                # rows the model pads through its bias (every key at its fill) are not compared
                out, ref = out[~padded], ref[~padded.to(ref.device)]
            err_rel = rel(out, ref)
            allowed = tol if base_err is None else max(tol, 4 * base_err)
            notes[label] = f"max difference to float32 {err_rel:.2g} (tolerance {allowed:.2g})"
            if err_rel > allowed:
                mismatch[label] = notes[label]
            if not suffix:
                base_err = err_rel
    found = Outcome[None](notes={"half precision": {**notes, **overflow}})
    if overflow:
        finding = Finding.of(HALF_PRECISION_OVERFLOW, "in half precision the module raises or gives NaN/inf where "
                             "float32 runs and is finite", overflow)
        if fix is not None:
            finding.fix = fix
        found.findings.append(finding)
    if mismatch:
        masked_only = all(" with " in label for label in mismatch)
        found.findings.append(Finding.of(HALF_PRECISION_MISMATCH, "in half precision the output differs from "
                                         "float32's by more than the dtype's rounding" +
                                         (": only with a mask, so the mask is lost in half precision" if masked_only
                                          else ""), mismatch))
    if notes and not overflow and not mismatch and all(str(v).startswith("not run") for v in notes.values()):
        # every half-precision run refused by the device (an operation it lacks in float16 and bfloat16): reported,
        # not held against the module, and not said to be verified either
        found.coverage["half_precision"] = "not applicable: the device lacks an operation of the module in float16 " \
                                           "and bfloat16 (see inferred)"
    elif not notes and not overflow:
        found.coverage["half_precision"] = "not verified: no half-precision run was possible on this device"
    return found


def _finite_in_float32(ctx: Context, masked: Caller, x32: Tensor, keep: Tensor, judged: torch.Size,
                       whole: torch.Size) -> bool:
    """Is a float32 copy of a half or float64 module, called with ``keep``'s mask as its half copy is (not through
    the float64 reference's path), finite where its half copy was judged? True when it cannot be run."""
    try:
        m32 = _eval(cast_module(copy_module(ctx.module), torch.float32))
        with torch.no_grad():
            out = masked.for_module(m32)(x32, masked.module_mask(keep, torch.float32))
    except Exception:  # a copy that does not run in float32: the half copy's NaN stands
        return True
    if out.shape != whole:
        return True
    if judged != whole and (padded := padded_rows(ctx.call, out)) is not None:
        out = out[~padded]
    return bool(torch.isfinite(out).all())


class _UsedParameters(TorchFunctionMode):
    """Records the parameters any torch operation receives while the module runs, and the lowest floating-point
    precision any operation computes in (a float64 copy may still run its softmax in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()
        self.mapped: set[int] = set()  # 2-D parameters used as the weight of F.linear (a fused in_proj_weight)
        self.lowest = torch.float64
        self.inputs: tuple[Tensor, ...] = ()  # the run's input: a detached tensor made without it is noted
        self.detached_weights = False  # a tensor made from the parameters alone was detached (DoRA's weight norm)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if getattr(func, "__name__", "") == "linear" and isinstance(weight, nn.Parameter) and weight.dim() == 2:
            self.mapped.add(id(weight))
        stack = [*args, *kwargs.values()]
        while stack:
            a = stack.pop()
            if isinstance(a, nn.Parameter):
                self.ids.add(id(a))
            elif isinstance(a, (list, tuple)):
                stack.extend(a)
        name = getattr(func, "__name__", "")
        if name in ("detach", "detach_") and self.inputs and not self.detached_weights and args and \
                isinstance(args[0], Tensor) and args[0].is_floating_point() and args[0].requires_grad and \
                args[0].grad_fn is not None:
            try:
                with torch._C.DisableTorchFunction():
                    reached = torch.autograd.grad(args[0].sum(), self.inputs, retain_graph=True, allow_unused=True)
                self.detached_weights = all(g is None for g in reached)
            except RuntimeError:  # a graph autograd cannot walk back from here: nothing is said of it
                pass
        out = func(*args, **kwargs)
        if isinstance(out, Tensor) and out.is_floating_point() and \
                torch.finfo(out.dtype).eps > torch.finfo(self.lowest).eps:
            self.lowest = out.dtype
        return out


@contextlib.contextmanager
def _moved(call: Caller, used: list[tuple[str, nn.Parameter]], size: float, gen: torch.Generator) -> Iterator[None]:
    """Every used parameter moved by noise of ``size`` relative to its largest entry while the block runs; the
    parameters are restored and the gradients cleared after it."""
    saved = [p.detach().clone() for _, p in used]
    try:
        with torch.no_grad():
            for _, p in used:
                p.add_(size * (1 + p.abs().max()) * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p))
        call.module.zero_grad(set_to_none=True)
        yield
    finally:
        with torch.no_grad():
            for (_, p), s in zip(used, saved, strict=True):
                p.copy_(s)
        call.module.zero_grad(set_to_none=True)


def _grads_after_noise(call: Caller, x: Tensor, weights: Tensor, used: list[tuple[str, nn.Parameter]],
                       gen: torch.Generator) -> dict[str, Tensor | None]:
    """The used parameters' gradients once every one is moved by a little noise (a gate that starts at 0 blocks
    its neighbours' gradients only at that point); the parameters are restored."""
    with _moved(call, used, 1e-2, gen):
        (call(x).double() * weights).sum().backward()
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in used}


def _off_the_point(call: Caller, x: Tensor, weights: Tensor, used: list[tuple[str, nn.Parameter]], on_input: bool,
                   step: float, gen: torch.Generator) -> tuple[float, float, float]:
    """:func:`_directional` (on the input, or on the parameters) with every used parameter moved by a little noise,
    autograd's gradient taken there too; the parameters are restored. Where pre-activations are exactly 0 (a bias
    initialised at 0 on a zero input), no finite difference sees the one-sided derivative autograd takes."""
    with _moved(call, used, 1e-3, gen):
        xg = x.clone().requires_grad_()
        (call(xg).double() * weights).sum().backward()
        if on_input:
            dx = xg.grad.detach().clone() if xg.grad is not None else torch.zeros_like(x)
            return _directional(call, x, weights, dx, [], step, gen)
        params = [(p, p.grad.detach().clone()) for _, p in used if p.grad is not None]
        return _directional(call, x, weights, None, params, step, gen)


def _cancelled(call: Caller, x: Tensor, weights: Tensor, used: list[tuple[str, nn.Parameter]],
               grads: Mapping[str, Tensor], gen: torch.Generator, rounding: float = 1e-10) -> list[str]:
    """Of the module's own learned tensors (:func:`_standalone`), those whose float64 gradient is only rounding of 0,
    here and off the draw: the output does not depend on them (a term the same for every key of a row, which the
    softmax cancels: attention sinks added to every score instead of being a column of their own). ``rounding``: the
    largest such gradient, relative to the largest of all (larger where the module computes a step in float32)."""
    top = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    module = call.module
    tiny = [n for n, g in grads.items()
            if g.numel() and _standalone(module, n) and float(g.abs().max()) <= rounding * top]
    if not tiny:
        return []
    after = _grads_after_noise(call, x, weights, used, gen)
    top = max((float(g.abs().max()) for g in after.values() if g is not None and g.numel()), default=0.0)
    return [n for n in tiny if (g := after.get(n)) is None or float(g.abs().max()) <= rounding * top]


def _still_zero(call: Caller, x: Tensor, weights: Tensor, used: list[tuple[str, nn.Parameter]], zero: list[str],
                gen: torch.Generator) -> list[str]:
    """Of the parameters ``zero`` whose gradient was exactly 0, those that still get 0 off the draw."""
    after = _grads_after_noise(call, x, weights, used, gen)
    return [n for n in zero if (g := after.get(n)) is None or not g.any()]


def _is_conv1d(mod: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers', or a copy of it): a linear map whose weight is (in, out), applied as
    ``addmm(bias, x, weight)``."""
    weight = getattr(mod, "weight", None)
    return type(mod).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.dim() == 2 and \
        isinstance(getattr(mod, "nf", None), int) and weight.shape[1] == mod.nf


def _as_rows(grads: Mapping[str, Tensor | None], columns: set[str]) -> dict[str, Tensor | None]:
    """The gradients with each weight named in ``columns`` transposed, so that its output features are rows."""
    return {n: g.T if n in columns and g is not None else g for n, g in grads.items()}


def _blocks(rows: Tensor) -> bool:
    """Whether the True entries of a (N,) bool tensor are runs of one length, at least 2."""
    runs, length = [], 0
    for flag in [*rows.tolist(), False]:
        if flag:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return len(set(runs)) == 1 and runs[0] >= 2


def _dead_rows(grads: Mapping[str, Tensor | None], linear: set[str]) -> dict[str, str]:
    """Weights of linear maps (names in ``linear``: an ``nn.Linear``'s, or a parameter F.linear was given) a block
    of whose rows (output features) gets exactly no gradient while the others do: name -> the rows. A projection's
    outputs that never reach the output (the values of a fused qkv projection when the keys are used in their
    place) are blocks of rows, one or several of one length (a third, a head's features). Tables such as
    embeddings, whose unused rows are by design, are not such weights, and neither are rows scattered one by one
    (units of an MLP that its ReLU leaves dead on a fixed input, as Swin v2's position-bias MLP)."""
    out = {}
    for name, g in grads.items():
        if g is None or g.dim() < 2 or any(n != 1 for n in g.shape[2:]) or name not in linear:
            continue  # a 1 x 1 convolution's (out, in, 1, 1) weight is a linear map's too
        dead = (g.reshape(g.shape[0], -1) == 0).all(1)
        count = int(dead.sum())
        # or one run of a head's size at least, however small beside the rest (the values of PaLM's fused
        # q | k | v | feed-forward projection, one key-value head beside a wide feed-forward part)
        one_run = count >= 4 and _blocks(dead) and bool(dead[int(dead.nonzero()[0]):][:count].all())
        if 0 < count < g.shape[0] and (count >= max(2, g.shape[0] // 8) or one_run) and _blocks(dead):
            rows = dead.nonzero().flatten().tolist()
            out[name] = f"{count} of {g.shape[0]} rows (output features) get no gradient, rows {rows[0]}-{rows[-1]}"
    return out


# autograd's refusals of in-place operations (in the forward: on a view of a multi-output function such as split
# or unbind, on a leaf; in the backward: on a tensor saved for it) and of results written into buffers the module
# allocates (`torch.bmm(w, v, out=buf)`): the module runs, but only under no_grad or inference_mode (inference code
# such as nanoGPT forks with q.mul_(scale) on a split view, kernels ported from C with preallocated outputs)
_IN_PLACE_REFUSALS = ("is being modified inplace", "is being used in an in-place operation",
                      "has been modified by an inplace operation",
                      "arguments don't support automatic differentiation")


# autograd's error when a backward reaches a graph an earlier backward freed: in a module's own state, an earlier
# call's history (a buffer updated in place from a value that requires grad)
_KEPT_HISTORY = "backward through the graph a second time"


def _autograd_refuses_in_place(err: RuntimeError) -> bool:
    return any(s in str(err) for s in _IN_PLACE_REFUSALS)


def _objective(call: Caller, x: Tensor, weights: Tensor) -> Tensor:
    return (call(x).double() * weights).sum()


# the attribute under which an adapter keeps the layer it wraps (peft's LoRA, IA3 and DoRA layers)
_BASE = "base_layer"


def _idle_projections(module: nn.Module, used: set[int]) -> list[str]:
    """The q, k or v projections (nn.Linear layers named for the role: ``key``, ``k_proj``, ``to_v``) the call never
    used while it used their siblings (the Linear layers of the same parent module), none of them named for that
    role: a key or value taken from another projection (``k = self.query(x)``). Layers named otherwise (a
    cross-attention ``to_k_context``, a gate, an optional output projection) may be left out on purpose, and a
    part of the module the call does not run at all (an adapter that runs one submodule) has no used sibling."""
    groups: dict[str, list[tuple[str, bool, tuple[Tensor, int, int]]]] = {}
    for path, mod in module.named_modules():
        # an nn.Linear, or a Keras Dense / EinsumDense; frozen ones too (used or not is read from the run, not from
        # gradients: the base layers under LoRA are frozen)
        if (found := _projection(mod, frozen=True)) is not None:
            if path.rpartition(".")[2] == _BASE:  # a wrapper's layer (peft's LoRA: q_proj.base_layer) is the
                path = path.rpartition(".")[0]  # wrapper's projection, beside the plain ones of its parent
            parent = path.rpartition(".")[0]
            if path.rpartition(".")[2].isdigit():  # one head's projection in a per-head list (``k_layers[i]``)
                parent = parent.rpartition(".")[0]
            groups.setdefault(parent, []).append((path, id(found[0]) in used, found))
    idle = []
    for group in groups.values():
        played = [_projection_role(p) for p, u, _ in group if u]
        # a used projection of no named role may be a fused q/k/v one (wider out than in, from the widest input); an
        # output projection (E -> E, or from one head's width when the heads are averaged) or a gate is not
        widest = max(m[1] for _, _, m in group)
        fused = any(_projection_role(p) is None and m[2] >= 2 * m[1] == 2 * widest for p, u, m in group if u)
        if not played or fused or all(r is None for r in played):
            continue
        idle += [p for p, u, _ in group if not u and (role := _projection_role(p)) is not None and role not in played]
    return sorted({*idle, *_idle_clones(module, used), *_idle_heads(module, used), *_idle_outputs(module, used),
                   *_idle_position_maps(module, used), *_idle_qualified_roles(module, used),
                   *_unbuilt_projections(module, used)})  # a position projection may be found by two rules


def _unbuilt_projections(module: nn.Module, used: set[int]) -> list[str]:
    """Keras ``Dense`` / ``EinsumDense`` layers named for a q, k or v role that were never built (a Keras layer makes
    its weights on its first call: never called) while a sibling named for another role was used."""
    idle = []
    for path, mod in module.named_modules():
        children = [(n, c) for n, c in mod.named_children() if type(c).__name__ in ("Dense", "EinsumDense")]
        played = {name_role(n) for n, c in children if (found := _projection(c)) is not None and id(found[0]) in used}
        played.discard(None)
        idle += [f"{path}.{n}" if path else n for n, c in children if getattr(c, "built", True) is False and
                 (role := name_role(n)) is not None and role not in played and played]
    return idle


_POSITION_WORDS = frozenset({"pos", "position", "positions", "positional"})


def _idle_position_maps(module: nn.Module, used: set[int]) -> list[str]:
    """The position projection (an nn.Linear named for positions: a Conformer's ``linear_pos``, ``pos_proj``) of a
    module whose own position terms (its learned ``pos_bias_u`` / ``pos_bias_v``, Transformer-XL's ``r_w_bias``,
    ``r_r_bias``) the call used, when it never used the projection: the position embeddings taken as they came."""
    idle = []
    for path, mod in module.named_modules():
        terms = [p for n, p in mod.named_parameters(recurse=False)
                 if p.requires_grad and ("pos" in n.lower() or n.lower() in ("r_w_bias", "r_r_bias"))]
        if not any(id(p) in used for p in terms):
            continue
        for name, child in mod.named_children():
            words = {w for w in re.split(r"[_\d]+", name.lower()) if w}
            if isinstance(child, nn.Linear) and words & _POSITION_WORDS and child.weight.requires_grad and \
                    id(child.weight) not in used:
                idle.append(f"{path}.{name}" if path else name)
    return idle


def _idle_qualified_roles(module: nn.Module, used: set[int]) -> list[str]:
    """The projections named for a role and a qualifier (``pos_k``, ``key_global``, ``k_content_proj``: one q, k or v
    word beside other words) the call never used while it used a sibling of the same qualifier named for another
    role: TUPE's position keys taken from the position queries' projection (``pos_q`` on both sides), a global
    token's keys taken from the local ``key`` beside ``query_global``."""
    idle = []
    for path, mod in module.named_modules():
        groups: dict[str, list[tuple[str, str, bool]]] = {}
        for name, child in mod.named_children():
            words = [w for w in re.split(r"[_\d]+", name.lower()) if w]
            roles = [(i, r) for i, w in enumerate(words) for r in ("q", "k", "v") if name_role(w) == r]
            if len(roles) != 1 or not isinstance(child, nn.Linear) or not child.weight.requires_grad or \
                    name_role(name) is not None:
                continue  # no qualifier (k_proj, to_k): the sibling rule's
            at, role = roles[0]
            group = "_".join("*" if i == at else w for i, w in enumerate(words))
            groups.setdefault(group, []).append((f"{path}.{name}" if path else name, role, id(child.weight) in used))
        for found in groups.values():
            played = {role for _, role, touched in found if touched}
            idle += [n for n, role, touched in found if not touched and played and role not in played]
    return idle


_OUTPUT_NAMES = frozenset({"to_out", "out_proj", "o_proj", "o", "proj", "c_proj", "wo", "w_o", "dense", "fc_o",
                           "w_h"})  # w_h: the Temporal Fusion Transformer's, over the heads' mean
_FUSED_NAMES = frozenset({"qkv", "to_qkv", "c_attn", "in_proj", "query_key_value", "wqkv", "qkv_proj"})
# keys and values packed in one projection, beside a query projection of its own
_FUSED_KV_NAMES = frozenset({"kv", "to_kv", "kv_proj", "key_value", "wkv", "kv_linear", "to_key_value"})


def _used_role(name: str) -> str | None:
    """The role a used projection named ``name`` plays for the output-projection rule: "qk" for a fused qkv one, "k"
    for keys and values packed together, else its name's role."""
    lowered = name.lower()
    return "qk" if lowered in _FUSED_NAMES else "k" if lowered in _FUSED_KV_NAMES else name_role(name)


def _unwrapped(mod: nn.Module) -> nn.Module:
    """The layer an adapter wraps (peft's LoRA keeps it as ``base_layer``), else ``mod``."""
    base = getattr(mod, _BASE, None)
    return base if isinstance(base, nn.Module) and _linear(base) else mod


def _idle_outputs(module: nn.Module, used: set[int]) -> list[str]:
    """The output projections (an nn.Linear named for that, ``to_out``, ``out_proj``, ``c_proj``, ``wo``, TFT's ``w_h``,
    or the first Linear of an ``nn.Sequential`` or ``nn.ModuleList`` so named, diffusers' ``to_out[0]``) of a module
    whose q and k
    (or fused qkv) projections the call used, its own or those of a core among its children, when it used none of
    them: the attention returned without the projection it holds. A module that used one of its output projections
    (a joint attention's ``to_out`` beside the context stream's ``to_add_out``) has none idle."""
    idle = []
    for path, mod in module.named_modules():
        roles, outputs = set(), []
        for name, wrapper in mod.named_children():
            child = _unwrapped(wrapper)  # a LoRA wrapper's base layer stands for it
            words = [w for w in re.split(r"[_\d]+", name.lower()) if w]
            named_out = name.lower() in _OUTPUT_NAMES or "out" in words or "output" in words
            if isinstance(child, (nn.Sequential, nn.ModuleList)) and named_out:
                first = next((i for i, c in enumerate(child) if _linear(_unwrapped(c))), None)
                if first is not None:
                    outputs.append((f"{name}.{first}", id(_unwrapped(child[first]).weight) in used))
                continue
            if isinstance(child, nn.ModuleList) and any(_linear(c) and id(c.weight) in used
                                                        for c in child):
                roles.add(_projection_role(f"{name}.0"))  # per-head projections (TFT's q_layers, k_layers)
                if len(child) == 3 and all(isinstance(c, nn.Linear) and c.weight.shape == child[0].weight.shape
                                           for c in child) and sum(id(c.weight) in used for c in child) >= 2:
                    roles.add("qk")  # q, k and v as clones in a list, the output projection apart (BERT-pytorch's)
                continue
            if not _linear(child):  # an attention core of the block's: its projections count too
                inner = [(n, _unwrapped(c)) for n, c in child.named_children()]
                roles |= {_used_role(n) for n, c in inner if _linear(c) and id(c.weight) in used}
                if named_out:  # an output block of its own (BERT's BertSelfOutput: dense, then a norm)
                    dense = next(((n, c) for n, c in inner if _linear(c)), None)
                    if dense is not None:
                        outputs.append((f"{name}.{dense[0]}", id(dense[1].weight) in used))
                continue
            # frozen layers too (the base layers under LoRA): used or not is read from the run
            touched = id(child.weight) in used
            if named_out:
                outputs.append((name, touched))
            elif touched:
                roles.add(_used_role(name))
        if outputs and ("qk" in roles or {"q", "k"} <= roles) and not any(touched for _, touched in outputs):
            idle += [f"{path}.{name}" if path else name for name, _ in outputs]
    return idle


def _idle_heads(module: nn.Module, used: set[int]) -> list[str]:
    """The members of a per-head projection list named for a role (``k_layers``, ``v_heads``) that the call never used
    while it used another member of the list: every head taking one head's projection (``self.k_layers[0]``)."""
    idle = []
    for path, mod in module.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2 or _projection_role(f"{path}.0") is None or \
                not all(isinstance(c, nn.Linear) and c.weight.requires_grad for c in mod):
            continue
        touched = [id(c.weight) in used for c in mod]
        if any(touched):
            idle += [f"{path}.{i}" for i, t in enumerate(touched) if not t]
    return idle


def _projection_role(path: str) -> str | None:
    """The role a Linear's name gives it; one of a per-head list takes the list's name, read in the singular
    (``k_layers.2``: k)."""
    head, _, last = path.rpartition(".")
    if not last.isdigit():
        return name_role(path)
    listed = head.rpartition(".")[2]
    return name_role(listed) or (name_role(listed[:-1]) if listed.endswith("s") else None)


def _idle_clones(module: nn.Module, used: set[int]) -> list[str]:
    """q, k, v (and output) projections held as 3 or 4 copies of one Linear in an ``nn.ModuleList`` (the Annotated
    Transformer's ``clones(nn.Linear(d, d), 4)``), named by their place only: one of them the call never used while
    it used another (a key or value taken from another copy: ``v = self.linears[1](value)``; the last, the output
    projection, never applied)."""
    idle = []
    for path, mod in module.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) not in (3, 4) or \
                not all(isinstance(c, nn.Linear) and c.weight.shape == mod[0].weight.shape for c in mod):
            continue
        touched = [id(c.weight) in used for c in mod]
        if sum(touched) >= 2:  # q and k at least: the list is the attention's projections
            idle += [f"{path}.{i}" for i, t in enumerate(touched) if not t and mod[i].weight.requires_grad]
    return idle


def _idle_weights(module: nn.Module, used: set[int]) -> list[str]:
    """The q, k or v weights held as raw parameters (a matrix named for the role once ``weight``, ``kernel`` or ``w``
    is dropped: ``k_proj_weight``, ``key_kernel``, ``wk``) the call never used while it used a sibling weight named
    for another role: keys projected with the queries' weights (``k_proj_weight=self.q_proj_weight`` given to
    F.multi_head_attention_forward, or an einsum with ``self.query_kernel`` for the keys)."""
    idle = []
    for path, mod in module.named_modules():
        found = []
        for name, p in mod.named_parameters(recurse=False):
            words = [w for w in re.split(r"[_\d]+", name.lower()) if w and w not in ("weight", "kernel", "w")]
            role = name_role("_".join(words)) if words and p.dim() >= 2 and p.requires_grad else None
            if role is not None:
                found.append((f"{path}.{name}" if path else name, role, id(p) in used))
        played = {role for _, role, touched in found if touched}
        idle += [n for n, role, touched in found if not touched and played and role not in played]
    return sorted(idle)


# Keras 3 layers (on its torch backend) whose variables are a layer's weights, not a module's own learned tensors
_KERAS_LAYERS = frozenset({"Dense", "EinsumDense", "LayerNormalization", "RMSNormalization", "Embedding", "Conv1D",
                           "Conv2D", "GroupNormalization", "ReversibleEmbedding"})


def _linear(mod: nn.Module) -> bool:
    """An nn.Linear, or a layer that is one: another library's (fairscale's and Megatron's ``ColumnParallelLinear`` /
    ``RowParallelLinear``: no submodules, a 2-D ``weight`` parameter (out, in), named a Linear or giving its
    ``in_features``), GPT-2's ``Conv1D`` (weight (in, out)) or a convolution over one position (``nn.Conv1d`` of
    kernel 1)."""
    if isinstance(mod, nn.Linear) or _is_conv1d(mod) or _pointwise(mod):
        return True
    weight = getattr(mod, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 2 and not isinstance(mod, nn.Embedding) and \
        not any(True for _ in mod.children()) and (type(mod).__name__.endswith("Linear") or
                                                    isinstance(getattr(mod, "in_features", None), int))


def _projection(mod: nn.Module, frozen: bool = False) -> tuple[Tensor, int, int] | None:
    """(weight, in features, out features) of a Linear (:func:`_linear`) or a Keras ``Dense`` / ``EinsumDense`` (its
    kernel's torch parameter), when it is trained (or ``frozen``: also when not, as a base layer under LoRA); else
    None."""
    if _linear(mod):
        weight = mod.weight
        if not isinstance(weight, Tensor) or not (weight.requires_grad or frozen):
            return None
        if _is_conv1d(mod):  # GPT-2's Conv1D: (in, out)
            return weight, weight.shape[0], weight.shape[1]
        return weight, weight.shape[1], weight.shape[0]
    kernel = getattr(getattr(mod, "kernel", None), "value", None)
    if type(mod).__name__ in ("Dense", "EinsumDense") and isinstance(kernel, nn.Parameter) and kernel.dim() >= 2 \
            and kernel.requires_grad:
        return kernel, kernel.shape[0], kernel[0].numel()
    return None


def _pointwise(mod: nn.Module) -> bool:
    """An ``nn.Conv1d`` or ``nn.Conv2d`` of kernel 1, stride 1 and one group: a Linear over the channels of each
    position."""
    return isinstance(mod, (nn.Conv1d, nn.Conv2d)) and set(mod.kernel_size) == {1} and set(mod.stride) == {1} and \
        mod.groups == 1


def _submodule(module: nn.Module, path: str) -> nn.Module:
    """The submodule at the dotted ``path`` (a TorchScript module has no ``get_submodule``: attributes are walked)."""
    for part in path.split(".") if path else ():
        module = getattr(module, part)
    return module


def _standalone(module: nn.Module, name: str) -> bool:
    """Is the parameter ``name`` a module's own learned tensor (an attention sink, a temperature, a table), not the
    weight or bias of a layer (a key projection's bias gets a gradient of 0 in every module: q . b_k is the same for
    every key) and not named a bias?"""
    path, _, last = name.rpartition(".")
    owner = _submodule(module, path)
    if "/" in last and isinstance(owner, nn.ParameterDict):  # a Keras layer's variable ("key/bias") in its
        path = path.rpartition(".")[0]  # _torch_params: read as the layer's own, by its last name
        owner, last = _submodule(module, path), last.rpartition("/")[2]
        if type(owner).__name__ in _KERAS_LAYERS:
            return False
    layers = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
              nn.MultiheadAttention)
    words = [w for w in re.split(r"[_\d]+", last.lower()) if w and w not in ("b", "bias", "weight", "kernel", "w")]
    joined = "_".join(words)  # bk, key_b, b_k: a raw projection's bias
    projection = bool(words) and (name_role(joined) is not None or (
        joined[:1] == "b" and len(words) == 1 and name_role(joined[1:]) is not None))
    # a bias named for no role and laid out per head (Transformer-XL's r_w_bias, a Conformer's pos_bias_u) is a
    # learned term of its own, not a projection's bias
    term = "bias" in last.lower() and bool(words) and not projection and \
        dict(module.named_parameters()).get(name, torch.empty(0)).dim() >= 2
    return not isinstance(owner, layers) and not _is_conv1d(owner) and ("bias" not in last.lower() or term) and \
        not projection and not _is_norm(owner)


_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _is_norm(mod: nn.Module) -> bool:
    """A normalisation layer with parameters: torch's, or one named so (a hand-written RMSNorm)."""
    return (isinstance(mod, _NORMS) or "norm" in type(mod).__name__.lower()) and any(
        p.requires_grad for p in mod.parameters(recurse=False))


def _idle_twins(module: nn.Module, used: set[int]) -> list[str]:
    """A module's own learned tensors (not a layer's weight or bias) the call never used while it used another of
    the same shape held beside them: one of a pair taken for both (a Conformer's pos_bias_u added to q for the
    position term too, pos_bias_v left unused; Transformer-XL's r_w_bias and r_r_bias)."""
    idle = []
    for path, mod in module.named_modules():
        own = [(f"{path}.{n}" if path else n, p) for n, p in mod.named_parameters(recurse=False)
               if p.requires_grad and p.dim() >= 1 and p.numel()]  # an empty one (0 memory slots) holds nothing
        own = [(n, p) for n, p in own if _standalone(module, n) or "bias" in n.rpartition(".")[2].lower()]
        for name, p in own:
            twins = [(n, q) for n, q in own if n != name and q.shape == p.shape]
            # a pair only, named as one (pos_bias_u and pos_bias_v, r_w_bias and r_r_bias): a third tensor of the
            # shape may serve an optional input (XLNet's r_s_bias, for segments), and tensors named apart may be
            # alternatives an option chooses between (a logit scale or a temperature)
            if id(p) not in used and len(twins) == 1 and id(twins[0][1]) in used and \
                    _one_word_apart(name, twins[0][0]) and not _standalone_layer(mod):
                idle.append(name)
    return sorted(idle)


def _one_word_apart(a: str, b: str) -> bool:
    """Do two parameter names differ in exactly one of their words (``pos_bias_u`` and ``pos_bias_v``)?"""
    wa, wb = re.split(r"[_.]", a.lower()), re.split(r"[_.]", b.lower())
    return len(wa) == len(wb) > 1 and sum(x != y for x, y in zip(wa, wb, strict=True)) == 1


def _standalone_layer(mod: nn.Module) -> bool:
    """Is ``mod`` a layer whose weight and bias are its own business (a Linear's bias may be disabled by its use)?"""
    return isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
                            nn.MultiheadAttention)) or _is_conv1d(mod) or _is_norm(mod)


def _idle_norms(module: nn.Module, used: set[int]) -> list[str]:
    """The q or k normalisations (``k_norm``, ``q_ln``) the call never used while it used their sibling named for the
    other role: keys normalised by the queries' norm (``k = self.q_norm(k)``)."""
    groups: dict[str, list[tuple[str, str, bool]]] = {}
    for path, mod in module.named_modules():
        if _is_norm(mod) and (role := norm_role(path)) is not None:
            touched = any(id(p) in used for p in mod.parameters(recurse=False))
            groups.setdefault(path.rpartition(".")[0], []).append((path, role, touched))
    idle = []
    for group in groups.values():
        played = {role for _, role, touched in group if touched}
        idle += [path for path, role, touched in group if not touched and played and role not in played]
    return sorted(idle)


def gradients(ctx: Context) -> Outcome[None]:
    """Every parameter the call uses and the input get a gradient (else: no-grad), and autograd's gradient
    equals the finite-difference derivative of the output along random directions (else: wrong-gradient).

    Runs on the float64 copy when there is one (finite differences then resolve a 1e-6 relative error);
    otherwise on the module in its dtype, with a tolerance for its rounding. Parameters the call never
    touches (an adapter that runs one part of a larger module) are not required to get a gradient.
    """
    try:
        found = _gradients(ctx)
        kept = _kept_history(ctx) if ctx.analysis.replaced and not found.findings else None
        if kept is not None:
            found.findings.append(kept)
        return found
    except NotImplementedError as err:
        if not NO_BACKWARD_HERE.search(str(err)):
            raise
        ctx.analysis.module.zero_grad(set_to_none=True)
        # FlexAttention has no backward on CPU: the gradients are taken through its semantics written out in plain
        # operations, which tells which parameters the output depends on and checks the module's own backward
        with flex_written_out(ctx.analysis.module):
            found = _gradients(ctx)
        found.notes["gradients through"] = f"flex_attention written out in plain operations ({str(err)[:120]})"
        return found
    except RuntimeError as err:
        if _KEPT_HISTORY not in str(err):
            raise
        ctx.analysis.module.zero_grad(set_to_none=True)  # the module's state holds an earlier call's graph
        return Outcome([Finding.of(STATE_DEPENDENT, "the module keeps autograd history in its own state across calls "
                                   "(a buffer or attribute written in place from a value that requires grad), so the "
                                   "backward of a later call fails", {"error": str(err)[:200]})],
                       coverage={"gradients": "not verified: the module's backward fails after an earlier call"})


_FUSED_NAME = re.compile(r"(^|[._])(w?qkv|to_kv|kv|in_proj|c_attn|query_key_value|kv_proj)([._]|$)", re.I)


def _kept_history(ctx: Context) -> Finding | None:
    """For a module whose calls replace some of its own state (a cache the doctor's calls put back each time): the
    training steps a user runs in a row, with the state each leaves. A second backward that fails on the first
    call's graph (a bias cached with its autograd history), or parameters that get a gradient on a fresh module and
    none after a call without gradients (a table cached then, detached from them), is state-dependent; else None."""
    call, x0 = ctx.analysis, ctx.analysis_x
    m = call.module
    kept = replace(call, keep_state=True)
    state = module_state(m)
    try:
        fresh, shapes = None, None
        m.train()  # training steps as a user runs them (timm's LeViT caches its biases in eval mode only)
        for step in range(2):
            m.zero_grad(set_to_none=True)
            given = x0.clone().requires_grad_()
            out = kept(given)
            if step == 0 and not _tables_with_history(m, given):
                return None  # what the call keeps depends on its input (keys and values: a cache for inference)
            now = _held_shapes(m)
            if shapes is not None and now != shapes:
                return None  # a cache that grows with each call (keys appended): an inference cache, by design
            shapes = now
            try:
                out.double().sum().backward()
            except RuntimeError as err:
                if _KEPT_HISTORY not in str(err):
                    return None
                return Finding.of(STATE_DEPENDENT, "the module keeps autograd history in its own state across calls "
                                  "(a table or bias cached from a value that requires grad): the second training "
                                  "step's backward fails", {"error": str(err)[:200], "replaced": dict(call.replaced)})
            if fresh is None:
                fresh = {n for n, p in m.named_parameters() if p.grad is not None and bool(p.grad.any())}
        restore(state)
        m.zero_grad(set_to_none=True)
        m.eval()
        with torch.no_grad():
            kept(x0.clone())  # an evaluation first: what it caches, it caches without gradients
        m.train()
        kept(x0.clone()).double().sum().backward()
        after = {n for n, p in m.named_parameters() if p.grad is not None and bool(p.grad.any())}
        lost = sorted((fresh or set()) - after)
        if lost:
            return Finding.of(STATE_DEPENDENT, "after a call without gradients (an evaluation), later calls give "
                              "some parameters no gradient: the module caches what it computes from them",
                              {"parameters without gradient after it": lost, "replaced": dict(call.replaced)})
        return None
    except Exception:  # calls in a row the module refuses: the calls-in-a-row probe says so
        return None
    finally:
        m.eval()
        restore(state)
        m.zero_grad(set_to_none=True)


def _tables_with_history(module: nn.Module, given: Tensor) -> bool:
    """Does the module's state hold a tensor with autograd history that does not depend on the call's input (a bias
    or table computed from its parameters and cached), as against keys and values of the input (a KV cache)?"""
    for _, _, attrs, buffers in module_state(module):
        for value in {**attrs, **buffers}.values():
            if isinstance(value, Tensor) and value.grad_fn is not None and value.is_floating_point():
                reach = torch.autograd.grad(value.sum(), given, retain_graph=True, allow_unused=True)[0]
                if reach is None or not bool(reach.any()):
                    return True
    return False


def _held_shapes(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The shapes of the tensors the module's state holds, by name."""
    return [(f"{prefix}.{key}", tuple(v.shape)) for prefix, _, attrs, buffers in module_state(module)
            for key, v in {**attrs, **buffers}.items() if isinstance(v, Tensor)]


def _feeding_others(others: list[Tensor], params: list[tuple[str, Tensor]], gen: torch.Generator) -> list[str]:
    """The parameters among ``params`` that get a gradient from the tensors a call returned beside its output (an
    agent or memory stream the layer hands on: its projection trains through that stream)."""
    # a q, k or v projection (named so, or fused) must reach the output itself: beside it, a module returns its keys
    # and values as a cache, which would hide values taken from the keys
    params = [(n, p) for n, p in params if name_role(n.rpartition(".")[0]) is None and not _FUSED_NAME.search(n)]
    if not others or not params:
        return []
    total = torch.stack([(t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
                         for t in others]).sum()
    got = torch.autograd.grad(total, [p for _, p in params], allow_unused=True)
    return [n for (n, _), g in zip(params, got, strict=True) if g is not None and bool(g.any())]


def _gradients(ctx: Context) -> Outcome[None]:
    call, x0 = ctx.analysis, ctx.analysis_x
    m = call.module
    exact = x0.dtype == torch.float64
    m.zero_grad(set_to_none=True)
    xg = x0.clone().requires_grad_()
    watch = _UsedParameters()
    watch.inputs = (xg,)
    try:
        with watch:
            out = call(xg)
        if not out.requires_grad:
            return Outcome([Finding.of(NO_GRAD, "the output carries no gradient", {})])
        weights = torch.randn(out.shape, generator=ctx.gen, dtype=torch.float64).to(out.device)
        padded = padded_rows(call, out)
        if padded is not None:  # rows the model pads (every key hidden: the scores rounded away under the fill,
            weights[padded] = 0  # which autograd does not see) are not the layer's outputs
        others = [t for t in call.others if t.requires_grad]  # what the call returned beside the output read
        (out.double() * weights).sum().backward(retain_graph=bool(others))
    except RuntimeError as err:
        if not _autograd_refuses_in_place(err):
            raise
        m.zero_grad(set_to_none=True)
        why = f"autograd refuses an in-place or out= operation of the module ({str(err)[:160]})"
        return Outcome(notes={"inference only": why},
                       coverage={"gradients": f"not applicable: the module runs only without autograd: {why}"})
    # an empty parameter (a memory of 0 learned tokens, a size the options set to 0) holds nothing to differentiate
    used = [(n, p) for n, p in m.named_parameters() if p.requires_grad and id(p) in watch.ids and p.numel()]
    missing = [n for n, p in used if p.grad is None or not p.grad.any()]
    beside = _feeding_others(others, [(n, p) for n, p in used if n in missing], ctx.gen) if missing else []
    missing = [n for n in missing if n not in beside]
    no_input_grad = xg.grad is None or not xg.grad.any()
    grads = {n: p.grad.detach().clone() for n, p in used if p.grad is not None}
    zero = [n for n, p in used if n in missing and p.grad is not None]
    if zero and not no_input_grad:  # a gradient of exactly 0 can be the draw's (a gate initialised at 0): try again
        missing = [n for n in missing if n not in zero] + _still_zero(call, x0, weights, used, zero, ctx.gen)
    if exact and not missing and not no_input_grad:
        # a step the module computes in float32 (Transformer-XL's scores.float()) leaves float32's rounding
        missing = _cancelled(call, x0, weights, used, grads, ctx.gen,
                             1e-10 if watch.lowest == torch.float64 else 1e-6)
    idle = _idle_projections(m, watch.ids) + _idle_norms(m, watch.ids) + _idle_weights(m, watch.ids)
    twins = [] if idle else _idle_twins(m, watch.ids)
    if idle or twins:
        m.zero_grad(set_to_none=True)
        said = ("a projection is never used: its weights get no gradient while the projections beside it do (a key "
                "or value computed by another projection, e.g. k = self.query(x), keys normalised by the queries' "
                "norm, or the output projection never applied)", {"projections never used": idle}) if idle else \
            ("a learned tensor is never used while its twin beside it (the same shape) is: one of a pair used in the "
             "place of both (a Conformer's pos_bias_u added to q for the position term too, its pos_bias_v never "
             "read)", {"never used": twins})
        return Outcome([Finding.of(NO_GRAD, *said)], notes={"gradients": f"{len(used)} parameter tensors used by "
                                                                       "the call"})
    if missing or no_input_grad:
        m.zero_grad(set_to_none=True)
        return Outcome([Finding.of(NO_GRAD, "some parameters (or the input) receive no gradient",
                                   {"parameters without gradient": missing, "input gets gradient": not no_input_grad})],
                       notes={"gradients": f"{len(used)} parameter tensors used by the call"})
    linear = {f"{path}.weight" if path else "weight" for path, mod in m.named_modules() if isinstance(mod, nn.Linear)
              or (isinstance(mod, (nn.Conv1d, nn.Conv2d)) and mod.groups == 1 and set(mod.kernel_size) == {1})}
    linear |= {n for n, p in used if id(p) in watch.mapped}  # F.linear(x, self.in_proj_weight): a projection too
    # GPT-2's Conv1D keeps its weight (in, out): its output features are columns
    columns = {f"{path}.weight" if path else "weight" for path, mod in m.named_modules() if _is_conv1d(mod)}
    dead = _dead_rows(_as_rows(grads, columns), linear | columns)
    if dead:  # only if it holds off the draw too
        moved = _as_rows(_grads_after_noise(call, x0, weights, used, ctx.gen), columns)
        dead = {n: why for n, why in _dead_rows(moved, linear | columns).items() if n in dead}
    if dead:
        m.zero_grad(set_to_none=True)
        return Outcome([Finding.of(NO_GRAD, "part of a projection never reaches the output: some of its output "
                                   "features get no gradient (in a fused qkv projection: values computed and then "
                                   "not used, e.g. weights @ k instead of weights @ v)", dead)],
                       notes={"gradients": f"{len(used)} parameter tensors used by the call"})
    assert xg.grad is not None  # no_input_grad is False here
    dx = xg.grad.detach().clone()
    m.zero_grad(set_to_none=True)
    exact = exact and watch.lowest == torch.float64  # a float32 softmax inside leaves float32's rounding
    step, tol = (1e-3, 1e-4) if exact else (1e-2, 1e-2)
    checks = {"input": _directional(call, x0, weights, dx, [], step, ctx.gen),
              "parameters": _directional(call, x0, weights, None, [(p, grads[n]) for n, p in used if n in grads],
                                         step, ctx.gen)}
    notes = {k: f"autograd {a:.6g}, finite difference {f:.6g} (+- {u:.2g})" for k, (a, f, u) in checks.items()}
    notes["computed in"] = str(watch.lowest)[6:]

    def differs(a: float, f: float, u: float) -> bool:
        return abs(a - f) > max(tol * (abs(a) + abs(f)), 10 * u) + 1e-12

    wrong = {k: notes[k] for k, (a, f, u) in checks.items() if differs(a, f, u)}
    for k in list(wrong):  # a ReLU's kink inside the step bends the difference: two more directions, smaller steps
        for retry in (1, 2):
            h = step / 10 ** retry if exact else step / 3 ** retry
            again = _directional(call, x0, weights, dx, [], h, ctx.gen) if k == "input" else \
                _directional(call, x0, weights, None, [(p, grads[n]) for n, p in used if n in grads], h, ctx.gen)
            if not differs(*again):
                notes[k] += (f"; along another direction with a step {10 ** retry if exact else 3 ** retry}x "
                             f"smaller: autograd {again[0]:.6g}, finite difference {again[1]:.6g} (a kink, as a "
                             "ReLU's, inside the first step)")
                del wrong[k]
                break
        else:  # kinks at the point itself (ReLUs of pre-activations that are exactly 0: a bias initialised at 0
            again = _off_the_point(call, x0, weights, used, k == "input", step, ctx.gen)  # on a zero input)
            if not differs(*again):
                notes[k] += (f"; with the parameters moved by a little noise: autograd {again[0]:.6g}, finite "
                             f"difference {again[1]:.6g} (kinks, as ReLUs of exact zeros, at the point itself)")
                del wrong[k]
    if set(wrong) == {"parameters"} and watch.detached_weights:  # a term of the weights alone, detached on purpose
        notes["parameters"] += ("; the module detaches a tensor it makes from its parameters alone (DoRA's weight "
                                "norm, a target network's copy): autograd leaves that path out by design")
        del wrong["parameters"]
    found = Outcome[None](notes={"gradients": {**notes, "dtype": str(x0.dtype)[6:]}})
    vague = [k for k, (a, f, u) in checks.items() if k not in wrong and 10 * u > 0.1 * (abs(a) + abs(f)) + 1e-6]
    if vague and len(vague) == len(checks):  # they agree only because neither could tell: nothing was checked
        # (one that agrees within a small uncertainty checks the backward; top-k selection bends the other)
        found.coverage["gradients"] = (f"not verified: the finite difference of the {' and '.join(vague)} is too "
                                       "uncertain to compare with autograd (the output is no smooth function of "
                                       "them: quantized, or rounded)")
    if wrong:
        found.findings.append(Finding.of(WRONG_GRADIENT, "autograd's gradient differs from the finite-difference "
                                         "derivative of the output (a hand-written backward, or an operation "
                                         "whose gradient is cut or changed)", {**wrong, "dtype": str(x0.dtype)[6:]}))
    return found


def _size(p: Tensor) -> float:
    """The typical size of a parameter's entries (root mean square), at least 1e-2 (a bias initialised at 0)."""
    return max(float(p.detach().double().pow(2).mean().sqrt()), 1e-2)


def _frozen_rows(module: nn.Module) -> dict[int, int]:
    """The rows torch gives no gradient by design, by the weight's id: an embedding's ``padding_idx`` (Graphormer's
    "no edge" and "no path" rows), whose finite difference moves the output while autograd's gradient is 0."""
    return {id(m.weight): m.padding_idx for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.padding_idx is not None}


def _directional(call: Caller, x: Tensor, weights: Tensor, dx: Tensor | None, params: list[tuple[nn.Parameter, Tensor]],
                 step: float, gen: torch.Generator) -> tuple[float, float, float]:
    """(autograd's derivative, the finite difference's, the finite difference's own uncertainty) of
    sum(out * weights) along a random direction in x (when ``dx`` is given) or in the parameters.

    The finite difference is central and extrapolated (Richardson, steps h and h / 2); its uncertainty is the
    gap between the two steps, which also catches an output computed in a lower precision inside."""
    with torch.no_grad():
        if dx is not None:
            u = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x)
            auto = float((dx.double() * u.double()).sum())
            h = step * (1 + float(x.abs().max()))

            def f(t: float) -> float:
                return float(_objective(call, x + t * u, weights))
        else:
            # each tensor moves in proportion to its own size: weights initialised at 0.02 and norms' gains at 1
            # both change by a fraction ``step``, and a normalisation of small projections (q/k norm) stays in
            # its linear range
            dirs = [torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(_size(p)).to(p) for p, _ in params]
            frozen = _frozen_rows(call.module)
            for (p, _), u in zip(params, dirs, strict=True):
                if id(p) in frozen:  # a row autograd leaves at 0 by design (an embedding's padding_idx)
                    u[frozen[id(p)]] = 0
            auto = sum(float((g.double() * u.double()).sum()) for (_, g), u in zip(params, dirs, strict=True))
            saved = [p.detach().clone() for p, _ in params]
            h = step

            def f(t: float) -> float:
                try:
                    for (p, _), u, s in zip(params, dirs, saved, strict=True):
                        p.copy_(s + t * u)
                    return float(_objective(call, x, weights))
                finally:
                    for (p, _), s in zip(params, saved, strict=True):
                        p.copy_(s)
        big, small = (f(h) - f(-h)) / (2 * h), (f(h / 2) - f(-h / 2)) / h
        return auto, (4 * small - big) / 3, abs(small - big)

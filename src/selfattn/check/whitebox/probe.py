"""The white-box probe: which formula the module's attention follows, read from a record of its operations.

Each run (without a mask, and with a causal or a padding mask when the module takes one; the
module's own visibility pattern, a causal mask or a window, applied on top) is recorded
(:mod:`.trace`) on the float64 copy when there is one, and read two ways:

1. from the projections (:mod:`.projections`): the attention recomputed from Q, K, V under the
   definition and each known bug, compared with the output projection's output and the module's;
2. when no formula over the projections fits (q/k normalisation, norms before, no projections at
   all), from the operands of the attention's own products (:mod:`.products`): the scores' scale
   against the head dim of the captured q, the softmax axis, the weights' orientation, the roles of
   q, k, v and the merge of the heads.

Two more runs read what the operands hold: with two tokens swapped, q, k and v must change on two rows each
(:mod:`.tokens`: head-split); with rotary positions, one token at every position must score the same with
itself everywhere (rotary-mismatch).

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from ..findings import (
    CAUSAL_LEAK,
    DEFINITION_MISMATCH,
    GROUP_MISMATCH,
    HEAD_MERGE,
    HEAD_SPLIT,
    MASK_AFTER_SOFTMAX,
    MASK_BROADCAST,
    MASK_IGNORED,
    MASK_INVERTED,
    MATMUL_ORDER,
    MISSING_SCALE,
    NO_GRAD,
    ROTARY_MISMATCH,
    SOFTMAX_DIM,
    VALUES_CHANGED,
    WRONG_SCALE,
    Finding,
)
from ..probes.masking import unlike_alone
from ..subject.building import num_heads_of
from ..subject.caller import Caller, dependency, grid
from ..subject.context import Context, Outcome, padded_rows, padding_keep
from .products import (
    Unrecognised,
    Unseen,
    bucket_not_relative,
    every_key_hidden,
    examine_cores,
    folded_scale,
    memory_tokens,
    positions_added,
    relative_positions,
    rotated_apart,
    rotated_operands,
    rotation_off_the_tokens,
    score_operands,
    table_not_relative,
    unshifted_relative,
)
from .projections import AFTER, Capture, NoFormula, capture, identify, qkv_heads
from .tokens import mixed_after, mixed_rows, normed_over_tokens, put_back_elsewhere
from .trace import Trace, key, record

__all__ = ["declared_scale", "white_box"]


# bugs that leave each token's score with itself where it was at every position, so that q and k rotated alike can
# still be told from q and k rotated apart (the run on one token everywhere); a layout slip or an unknown formula
# does not (a head split puts other tokens' features on a position's row)
_ROTATION_READABLE = frozenset(k.id for k in (
    MISSING_SCALE, WRONG_SCALE, SOFTMAX_DIM, MATMUL_ORDER, MASK_IGNORED, MASK_INVERTED, MASK_AFTER_SOFTMAX,
    MASK_BROADCAST, CAUSAL_LEAK, NO_GRAD, GROUP_MISMATCH, VALUES_CHANGED))
_SOFTCAPS = ("attn_logit_softcapping", "attention_logit_softcapping", "attn_logit_softcap", "attn_softcap",
             "softcapping", "logit_softcapping")


def declared_softcap(module: nn.Module) -> tuple[float, str] | None:
    """The cap on the attention scores the module or its config states (Gemma 2's ``attn_logit_softcapping``,
    litgpt's ``attention_logit_softcapping``, torchtune's ``softcapping``), and where it was read; None."""
    for owner, where in ((module, "the module"), (getattr(module, "config", None), "the config")):
        for name in _SOFTCAPS:
            stated = getattr(owner, name, None) if owner is not None else None
            if isinstance(stated, (int, float)) and not isinstance(stated, bool) and stated > 0:
                return float(stated), f"{where} states {name} = {stated}"
    return None


def declared_scale(module: nn.Module) -> tuple[Callable[[int], float | None], str | None]:
    """The score scale the module's config states instead of 1/sqrt(head dim), as a function of the head dim,
    and where it was read (``query_pre_attn_scalar``, litgpt's ``attention_scores_scalar``, ``qk_scale_factor``,
    ``attention_multiplier``, ``scale_attn_weights``, YaRN's ``mscale_all_dim`` in the rope parameters of latent
    attention; diffusers' ``scale_qk=False`` on the module)."""
    config = getattr(module, "config", None)
    if getattr(module, "scale_qk", True) is False:  # diffusers' Attention: scale_qk=False multiplies by its scale
        stated = getattr(module, "scale", 1.0)
        if isinstance(stated, (int, float)) and not isinstance(stated, bool):
            return (lambda d: float(stated)), f"scale_qk = False, scale = {stated}"
    if config is None:
        return (lambda d: None), None
    for name in ("query_pre_attn_scalar", "attention_scores_scalar"):  # Gemma's; litgpt's name for it
        scalar = getattr(config, name, None)
        if isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar > 0:
            return (lambda d, s=float(scalar): s ** -0.5), f"config.{name} = {scalar}"
    factor = getattr(config, "qk_scale_factor", None)  # q normalised, then multiplied by it (MuseGlimmer)
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0:
        return (lambda d: float(factor) / math.sqrt(d)), f"config.qk_scale_factor = {factor}"
    multiplier = getattr(config, "attention_multiplier", None)
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool) and multiplier > 0:
        return (lambda d: float(multiplier)), f"config.attention_multiplier = {multiplier}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default" and \
            rope.get("mscale_all_dim") and isinstance(rope.get("factor"), (int, float)) and rope["factor"] > 1 and \
            getattr(config, "kv_lora_rank", None):
        # YaRN's mscale_all_dim folded into the softmax scale of latent attention (DeepSeek's, Mistral 4's); other
        # attention keeps 1/sqrt(D) and scales through the rotary tables
        m = 0.1 * float(rope["mscale_all_dim"]) * math.log(float(rope["factor"])) + 1.0
        return (lambda d: d ** -0.5 * m * m), (f"config rope: YaRN mscale_all_dim = {rope['mscale_all_dim']}, "
                                               f"factor = {rope['factor']} (1/sqrt(D) times mscale^2 = {m * m:.4g})")
    plain = getattr(config, "scale_attn_weights", True) is not False
    layer = getattr(module, "layer_idx", None)
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) is True and isinstance(layer, int):
        # GPT-2's option (Mistral's stability trick): the scores also divided by the layer's index + 1
        return ((lambda d: d ** -0.5 / (layer + 1)) if plain else (lambda d: 1.0 / (layer + 1)),
                f"config.scale_attn_by_inverse_layer_idx = True, layer_idx = {layer}")
    if not plain:
        return (lambda d: 1.0), "config.scale_attn_weights = False"
    return (lambda d: None), None


def _raw(caller: Caller, mask: object, keep: Tensor) -> Tensor | None:
    """The mask the module received, as float64 (B, 1, L, L), for formulas that use its values."""
    m = mask if isinstance(mask, Tensor) else None
    if m is None or caller.spec is None or caller.at_end:  # lengths carry no values a formula uses
        return None
    m = m.double().cpu()
    b, length = keep.shape[0], keep.shape[-1]
    if caller.make_mask is None:  # the doctor encoded it: its shape is the spec's
        m = {"LL": lambda: m[None, None], "BLL": lambda: m[:, None], "B1LL": lambda: m,
             "BL": lambda: m[:, None, None, :], "B1L": lambda: m[:, None], "B11L": lambda: m,
             "B1L1": lambda: m.transpose(-1, -2),
             "LLB": lambda: m.permute(2, 0, 1)[:, None],
             "LLB1": lambda: m[..., 0].permute(2, 0, 1)[:, None], "LL1": lambda: m.permute(2, 0, 1)[:, None]
             }[caller.spec.shape]()
    elif m.dim() == 2:  # the user's make_mask: read by rank ((L, L) or (B, L)); (B, 1, L) and (B, L, L) alike
        m = m[None, None] if m.shape[0] == length and b != length else m[:, None, None, :]
    elif m.dim() == 3:
        m = m[:, None]
    try:
        return m.reshape(m.shape[0], -1, *m.shape[-2:])[:, :1].expand(b, 1, length, length) if m.dim() == 4 else None
    except RuntimeError:  # a shape the formulas cannot use: they go without the mask's values
        return None


def _informative_input(module: nn.Module, call: Callable[[Tensor], Tensor], x: Tensor,
                       heads: list[int]) -> tuple[Tensor, bool]:
    """x, scaled up (at most 3 times) while the scores Q K^T / sqrt(D) are too small (std < 0.5) to tell the
    scale, the softmax axis and the other formulas apart (small initialisations: GPT-2's std 0.02); and whether
    the scores stay the same for every key at every scale (q or k zero: rows of a fused projection initialised at
    0), where no formula can be told from another."""
    spread = 1.0
    for _ in range(3):
        trace, _ = record(module, partial(call, x))
        cap = capture(trace, module, x)
        split = None if isinstance(cap, str) else qkv_heads(cap.splits[0], heads[0])
        if split is None:
            return x, False
        qh, kh, _ = split
        spread = float((qh @ kh.transpose(-1, -2)).std() / qh.shape[-1] ** 0.5)
        if not spread < 0.5:
            return x, False
        x = x * min(30.0, (1.0 / max(spread, 1e-6)) ** 0.5)
    return x, spread == 0.0  # exactly: weights of 1e-10 still tell the formulas apart, relative to themselves


def _runs(ctx: Context, masked: Caller | None, dep: Tensor) -> list[tuple[str, Tensor | None, Tensor | None]]:
    """(label, the keep-mask sent (B, L, L) or None, the keep the formulas use) of each run: without mask, with a
    causal or padding mask; the module's own visibility pattern (causal, a window) is added to what the formulas
    use, so that they compare like with like."""
    b, length, _ = ctx.x.shape
    runs: list[tuple[str, Tensor | None]] = [("without mask", None)]
    if masked is not None:
        if masked.key_only:
            runs.append(("with a padding mask", padding_keep(b, length)))
        else:
            i = torch.arange(length)
            runs.append(("with a causal mask", (i[None, :] <= i[:, None]).expand(b, length, length)))
            if masked.unmatched:  # a full mask whose effect matched no convention (read in part: mask[:, 0, :, 0]):
                # padding tells what it hides; on the left where the module hides later keys on its own (a causal
                # pattern hides padding at the end from every real query)
                pad = padding_keep(b, length)
                runs.append(("with a padding mask", pad if bool(dep.all()) else pad.flip(-1)))
    deps = [dep]
    if getattr(ctx.call.adapter, "rows_from_the_start", False) and ctx.analysis_x.shape[0] == b and \
            (not dep.all() or getattr(ctx.call.adapter, "carries_padding", False)):
        # a replayed layer given per-item tensors with a pattern of its own (a graph's adjacency for each item):
        # each item's own pattern (a padding the call carries leaves the first item's all-visible one unread)
        deps += [dependency(ctx.analysis, ctx.analysis_x, item=i, rtol=ctx.dependency_rtol) for i in range(1, b)]
    own = None if all(bool(d.all()) for d in deps) else \
        torch.stack(deps) if len(deps) == b else dep.expand(b, length, length)
    padded = None if own is None else padded_rows(ctx.call, ctx.x)
    if own is not None and padded is not None:  # the rows the model pads through its call with every key hidden,
        own = own.clone()  # which weigh them all alike, are no query's: no key is one they may see
        own[padded.cpu() & own.all(-1)] = False
        # a padded key no other query sees: its own row depends on its token through the query only
        eye = torch.eye(length, dtype=torch.bool)
        alone = ~(own & ~eye).any(-2)  # (B, L): keys no other query sees
        own[eye.expand_as(own) & (padded.cpu() & alone)[:, None, :]] = False
    return [(label, sent, sent if own is None else own if sent is None else sent & own) for label, sent in runs]


def white_box(ctx: Context, masked: Caller | None, dep: Tensor) -> Outcome[str]:
    """Recompute the attention and name the formula the output follows.

    Args:
        ctx: the probe context.
        masked: the caller from :func:`~selfattn.check.probes.masking.mask_convention`; when given, a run
            with a causal mask (key-only masks: a padding mask) is added.
        dep: (L, L) from :func:`~selfattn.check.probes.masking.causality`: what the module sees on its own.

    Returns:
        Note white box (per run: matches the definition, matches a bug, or nothing matched; or why it
        was skipped) and the design facts found (positions, soft-capping, a stated scale, layers after
        the attention); a finding for each known bug the output follows, definition-mismatch when no
        formula does (unless ``ctx.allow_nonstandard``); value: the position term found or None.
    """
    caller, x0 = ctx.analysis, ctx.analysis_x
    module = caller.module
    scripted = [name or getattr(m, "original_name", "the module") for name, m in module.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:  # TorchScript runs its operations in C++, where no record follows them: the formula is not read
        return Outcome(coverage={"white_box": f"not verified: {scripted[0]} is a TorchScript module "
                                              "(torch.jit.script), whose operations the doctor cannot record; check "
                                              "the Python class it was scripted from"})
    e = x0.shape[-1]
    hint = num_heads_of(ctx.module)
    heads = [hint] if hint else [h for h in (1, 2, 4, 8, 16, 32) if e % h == 0]
    config_scale, stated_where = declared_scale(ctx.module)
    stated_cap = declared_softcap(ctx.module)

    def stated(d: int) -> float | None:
        return ctx.scale if ctx.scale is not None else config_scale(d)

    x, flat = _informative_input(module, caller, x0, heads)
    if flat:
        return Outcome(coverage={"white_box": "not verified: the scores Q K^T are 0 for every key at every input "
                                              "scale tried (the queries' or keys' projection is zero: rows of a "
                                              "fused projection initialised at 0), so no scale or softmax axis can "
                                              "be told from another; check the module with trained weights"})
    findings, results, facts = [], {}, {}
    positions, bias = None, None
    if stated_where or ctx.scale is not None:
        facts["scale"] = f"{'--scale' if ctx.scale is not None else stated_where} (not 1/sqrt(D))"
    skipped = 0
    plain: Trace | None = None
    plain_out = 0
    runs = _runs(ctx, masked, dep)
    for label, sent, keep in runs:
        run_caller = ctx.exact_of(masked) if sent is not None and masked is not None else caller
        mask = run_caller.module_mask(sent) if sent is not None and masked is not None else None

        def call(mask: object = mask, run_caller: Caller = run_caller, x: Tensor = x) -> Tensor:
            return run_caller(x, mask) if mask is not None else caller(x)

        trace, out = record(module, call)
        if sent is None:
            plain, plain_out = trace, key(out)
        k4 = None if keep is None else keep.reshape(-1, 1, *keep.shape[-2:])
        raw = _raw(run_caller, mask, k4) if mask is not None and k4 is not None else None
        cap = capture(trace, module, x)
        verdict, why = _by_projections(cap, out, heads, k4, raw, bias, stated)
        everything = every_key_hidden(trace) if sent is None else None
        if everything is not None:  # given no mask, the module hides every key: its own default read inverted
            verdict = (MASK_INVERTED, {"matches": f"{everything} when the module is given no mask: a mask it builds "
                                                  "for itself (every token visible) is read the other way round"}, {})
        absolute = None
        if verdict is not None and verdict[0] is None and "positions" in verdict[1]:
            absolute = bucket_not_relative(trace, set(heads), plain_only=True)
            if absolute is not None:  # a T5-style table looked up by positions, not by their distance
                verdict, why = None, absolute
        if verdict is None and absolute is None:
            verdict, why = _by_operands(trace, out, e, x.shape[1], stated, why, k4, frozenset({id(x)}),
                                        local=not bool(dep.all()), partner=_other_tokens(module, call, x),
                                        causal=ctx.causal and sent is None)
            if verdict is not None and verdict[0] == DEFINITION_MISMATCH:  # no formula: the same as none found
                why, verdict = verdict[1]["matches"], None
        if verdict is None and label == "with a padding mask" and _unpadded(trace, x.shape[1]):
            # the module computes the real tokens only (unpad, attention per sequence, pad back: flash-attn's varlen
            # path): the run is not read; the padding probe judges what the mask does
            verdict, why = None, "not seen: the module computes the real tokens only under a padding mask (unpadded)"
        if verdict is None:
            results[label] = why
            if (isinstance(cap, str) and why.startswith("not followed")) or why.startswith("not seen"):
                skipped += 1
            elif not ctx.allow_nonstandard:
                findings.append(Finding.of(DEFINITION_MISMATCH, f"the output ({label}) follows no formula of "
                                           f"attention: {why}", {"closest": why, "projections":
                                                                 cap.how if isinstance(cap, Capture) else cap}))
            continue
        fid, evidence, found_facts = verdict
        evidence = dict(evidence)
        also = evidence.pop("_also", [])
        if masked is not None and masked.unmatched and ctx.spec is None and not ctx.declared and \
                label != "without mask":  # no polarity to invert: the mask was sent in a convention its effect did
            # not match (items given each other's masks); one the user stated, or the module's own default mask in
            # a run given none, is the polarity
            fid, evidence = _unmatched_inversion(fid, evidence)
            also = [_unmatched_inversion(*other) for other in also]
        facts.update(found_facts)
        capped = evidence.pop("_softcap", None)
        if capped is not None and stated_cap is not None and fid is None and \
                abs(capped / stated_cap[0] - 1) > 1e-3:  # tanh(s / cap) * cap * scale: the cap put before the scale
            fid = DEFINITION_MISMATCH
            evidence = {**evidence, "matches": f"the scores are capped at {capped:.6g} where {stated_cap[1]}: the "
                                               "cap applied before the scale (tanh(s / cap) * cap * scale) or to other "
                                               "scores than the scaled ones"}
        bias = evidence.pop("_bias", bias)
        positions = positions or evidence.get("positions")
        results[label] = f"matches the definition: {evidence['formula']}" if fid is None else \
            f"matches {fid}: {evidence.get('matches')}"
        if fid == MISSING_SCALE and isinstance(cap, Capture) and "heads" in evidence and \
                folded_scale(cap.q, cap.k, cap.q.shape[-1] // evidence["heads"]):
            fid = None  # the definition, with 1/sqrt(D) in q's weights (T5)
            facts["scale"] = "folded into the query projection's weights (q is 1/sqrt(D) of k in size, as T5 " \
                             "initialises it): no scale on the scores"
            evidence["formula"] = "softmax(Q K^T) V with 1/sqrt(D) folded into q's projection"
            results[label] = f"matches the definition: {evidence['formula']}"
        if fid is not None:
            findings.append(Finding.of(fid, f"the output follows a known bug ({label}): {evidence['matches']}",
                                       evidence))
        for other, other_evidence in also:  # read apart from the first: a bug of another kind, named too
            direct = bool(other_evidence.pop("_direct", False))  # seen itself: no symptom of the first
            findings.append(Finding.of(other, f"the output also follows a known bug ({label}): "
                                       f"{other_evidence['matches']}", other_evidence, direct=direct))
            results[label] += f"; and {other}: {other_evidence.get('matches')}"
        if fid is None and str(evidence.get("compared with", "")).endswith(AFTER.split("{name}")[1]):
            facts["after the attention"] = evidence["compared with"]
        if label == "with a padding mask" and sent is not None:
            facts.update(_zeroed_rows(out, sent))
    memory = (0, 0) if plain is None else memory_tokens(plain, x.shape[1])
    mixed = None if plain is None else _rows_of_one_token(module, caller, x, plain, plain_out, memory)
    if mixed is not None:
        findings.append(Finding.of(HEAD_MERGE if mixed.startswith("the output's") else HEAD_SPLIT, mixed,
                                   {"swapped tokens": [x.shape[1] // 2 - 1, x.shape[1] // 2]}))
        results["two tokens swapped"] = mixed
    normed = None if plain is None or mixed is not None else _normed_over_tokens(module, caller, x, plain)
    if normed is not None:
        findings.append(Finding.of(DEFINITION_MISMATCH, normed, {"changed token": x.shape[1] // 2}))
        results["one token changed"] = normed
    rotated = "rotary" in str(facts.get("positions", positions or ""))
    if not rotated and plain is not None and not facts.get("positions") and not positions:
        # no rotation read from the operands, though the module computes cos and sin itself (a partial rotation
        # rejoined to v in a packed qkv, as Phi's remote code does): one token everywhere tells whether the scores
        # are relative
        made = {op.name for op in plain.ops}
        rotated = {"cos", "sin"} <= made or rotated_operands(plain)  # tables cached ahead: the rotation itself
    if rotated and all(f.id in _ROTATION_READABLE for f in findings if f.severity == "error"):
        mismatch = _rotated_alike(module, caller, x, getattr(caller.adapter, "recorded_eps", 0.0), memory)
        if mismatch is None and plain is not None:
            mismatch = rotated_apart(plain, x.shape[1])
        if mismatch is not None:
            findings.append(Finding.of(ROTARY_MISMATCH, f"q and k are not rotated alike (or not by a rotation, or "
                                       f"not by position): {mismatch}",
                                       {"positions": facts.get("positions", positions)}))
            results["one token everywhere"] = mismatch
    said = str(facts.get("positions", positions or ""))
    terms = said.startswith("relative positions")
    biased = "relative-position bias" in said or "position term" in facts
    table = _distance_table(module, x.shape[1], caller.layout in ("channels-first", "channels-last")) \
        if terms or biased else None  # only read where positions were found
    relative = terms or (biased and table is not None)
    if plain is not None and not any(f.severity == "error" for f in findings) and \
            (absolute := table_not_relative(plain, frozenset({id(x)}))) is not None:
        findings.append(Finding.of(DEFINITION_MISMATCH, f"the relative positions are not relative: {absolute}",
                                   {"positions": facts.get("positions", positions)}))
        results["position table"] = absolute
    if relative and not any(f.severity == "error" for f in findings):
        shifted = _relative_alike(module, caller, x, table)
        if shifted is not None:
            findings.append(Finding.of(DEFINITION_MISMATCH, f"the relative positions are not relative: {shifted}",
                                       {"positions": facts.get("positions", positions)}))
            results["one token everywhere"] = shifted
        elif masked is not None and masked.spec is not None and masked.spec.shape not in ("LL", "LL1") and \
                not hasattr(caller.adapter, "recorded_eps"):  # a replayed layer's recorded positions fit one length
            grown = unlike_alone(ctx, ctx.exact_of(masked), ctx.analysis_x)
            if grown is not None:
                findings.append(grown)
                results["padded and alone"] = grown.message
    if x is not x0:
        results["input scale"] = f"x times {float(x.flatten()[0] / x0.flatten()[0]):.3g} (the scores were too " \
                                 "small to tell formulas apart)"
    notes = {"white box": results, **({"design": facts} if facts else {})}
    if skipped == len(runs):
        why = next(iter(results.values()))
        if ctx.allow_nonstandard:  # no softmax attention to read, as the user said: ReLU^2, linear, sigmoid
            why = f"--allow-nonstandard and no softmax attention was followed ({why})"
        return Outcome(findings, notes, positions, {"white_box": f"not verified: {why}"})
    cover = "verified" if not ctx.allow_nonstandard or all("matches" in r for r in results.values()) else \
        "not verified: --allow-nonstandard and no formula matched"
    return Outcome(findings, notes, positions, {"white_box": cover})


def _rows_of_one_token(module: nn.Module, caller: Caller, x: Tensor, plain: Trace, out: int,
                       memory: tuple[int, int] = (0, 0)) -> str | None:
    """Run the module with two neighbouring tokens swapped in every item: where a layout operation on the way to q,
    k or v, or from the attention to the output ``out`` (a key in ``plain``), spreads them over the rows of others
    (:mod:`.tokens`), or None. ``memory``: the learned tokens the module joins to the tokens (how many, where the
    tokens start), which the attention's tensors hold besides them."""
    t, u = x.shape[1] // 2, x.shape[1] // 2 - 1
    if u < 0:
        return None
    other = x.clone()
    other[:, [t, u]] = x[:, [u, t]]
    try:
        trace, moved = record(module, partial(caller, other))
    except Exception:  # a module that rejects this input has been read on the probe's own
        return None
    n, swapped = x.shape[1] + memory[0], (u + memory[1], t + memory[1])
    mixed = mixed_rows(plain, trace, n, swapped) or mixed_after(plain, trace, out, n, swapped)
    if mixed is None and isinstance(moved, Tensor) and moved.shape == x.shape:
        with torch.no_grad():
            before = caller(x)
        if isinstance(before, Tensor) and before.shape == moved.shape:
            return put_back_elsewhere(before, moved, (u, t))
    if mixed is not None and isinstance(moved, Tensor) and moved.shape == x.shape:
        # the output's rows swapped as the tokens were, exactly: whatever order the tensors on the way took (rows
        # gathered in the order of a top-k, Informer's ProbSparse queries, and put back by their index), no token
        # was spread over another's row
        with torch.no_grad():
            before = caller(x)
        back = moved.clone()
        back[:, [t, u]] = moved[:, [u, t]]
        if before.shape == back.shape and bool(torch.isfinite(before).all()) and \
                float((back - before).abs().max()) <= 1e-9 * (1 + float(before.abs().max())):
            return None
    return mixed


def _normed_over_tokens(module: nn.Module, caller: Caller, x: Tensor, plain: Trace) -> str | None:
    """Run the module with one token changed in every item: where a layer or RMS norm on the way to q, k or v
    normalises over the tokens (:mod:`.tokens`), or None."""
    t = x.shape[1] // 2
    other = x.clone()
    other[:, t] = torch.flip(x[:, t], dims=(-1,)) + 1.0
    try:
        trace, _ = record(module, partial(caller, other))
    except Exception:  # a module that rejects this input has been read on the probe's own
        return None
    return normed_over_tokens(plain, trace, x.shape[1], t)


def _unpadded(trace: Trace, length: int) -> bool:
    """Did the run's softmaxes or attention kernels see no more queries than the ``length`` tokens and some fewer, one
    call per sequence (the real tokens only: a varlen path under a padding mask, an item without padding whole)?"""
    sizes = []
    for op in trace.ops:
        if op.name == "scaled_dot_product_attention" and op.inputs and op.inputs[0].dim() >= 2:
            sizes.append(op.inputs[0].shape[-2])
        elif op.name in ("softmax", "_softmax") and op.outputs and op.outputs[0].dim() >= 2:
            sizes.append(op.outputs[0].shape[-2])
    return any(n < length for n in sizes) and all(n <= length for n in sizes)


def _rotated_alike(module: nn.Module, caller: Caller, x: Tensor, eps: float = 0.0,
                   memory: tuple[int, int] = (0, 0)) -> str | None:
    """Run the module on each item's first token repeated at every position: with q and k rotated alike, each
    token's score with itself is then the same at every position; where it is not (:mod:`.products`), or None.
    ``eps``: the rounding of the rotation tables the call passes (a model's bfloat16 cos and sin), allowed for."""
    same = x[:, :1].expand_as(x).clone()
    try:
        trace, _ = record(module, partial(caller, same))
    except Exception:  # a module that rejects repeated tokens has been read on the probe input
        return None
    mismatch = relative_positions(trace, x.shape[1], max(1e-4, 8 * eps), memory)
    if mismatch is None and not memory[0]:
        return rotation_off_the_tokens(trace, x.shape[1])
    if mismatch is None or memory[0]:
        return mismatch
    # a position term added to q and k after their projections (Conditional DETR's) is absolute by design, no rotation:
    # the same difference at every position between runs on two tokens
    try:
        other, _ = record(module, partial(caller, x[:, 1:2].expand_as(x).clone()))
    except Exception:  # a module that rejects that input has been read on the first
        return mismatch
    one, two = score_operands(trace), score_operands(other)
    if one is not None and two is not None and positions_added(one, two, x.shape[1], max(1e-6, 8 * eps)):
        return None
    return mismatch


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` above 1 and below it."""
    return [a for a in range(2, n) if n % a == 0]


def _distance_table(module: nn.Module, n: int, image: bool) -> tuple[nn.Parameter, list[tuple[int, ...] | None]] | None:
    """A parameter of ``module`` sized as a table of relative distances for ``n`` tokens, with no other axis of that
    size (a table over pairs of absolute positions has two), and the grids it may be read on: one axis of
    (2h - 1)(2w - 1) entries for the (h, w) grid of the n tokens (an image, or a window of one: Swin's table) gives
    that grid; one of (2d - 1)(2h - 1)(2w - 1) entries gives the (d, h, w) grids of n tokens it fits (a 3-D window of
    a volume or a video: Video Swin's, Swin UNETR's), each order of the sides, since the table's size does not tell
    it; one of 2M - 1 entries, M >= n, on a sequence gives None (a line); None when there is none."""
    h, w = grid(n)
    volumes: dict[int, list[tuple[int, ...] | None]] = {}  # table size -> the (d, h, w) grids of n tokens it fits
    for a in _divisors(n):
        for b in _divisors(n // a):
            if n // (a * b) > 1:
                volumes.setdefault((2 * a - 1) * (2 * b - 1) * (2 * n // (a * b) - 1), []).append((a, b, n // (a * b)))
    for t in module.parameters():
        if t.is_floating_point() and t.dim() >= 1 and n > 2:
            for s in (s for s in t.shape if list(t.shape).count(s) == 1):
                if h > 1 and w > 1 and s == (2 * h - 1) * (2 * w - 1):
                    return t, [(h, w)]
                cubes = volumes.get(s, [])
                line = not image and s % 2 == 1 and s >= 2 * n - 1
                if cubes:
                    return t, cubes + ([None] if line else [])
                if line:
                    return t, [None]
    return None


def _relative_alike(module: nn.Module, caller: Caller, x: Tensor,
                    table: tuple[nn.Parameter, list[tuple[int, ...] | None]] | None = None) -> str | None:
    """Run the module on each item's first token repeated at every position: with relative positions, two pairs of
    tokens the same distance apart get the same score (on an image, the same 2-D distance); where they do not
    (:mod:`.products`), or None. ``table``: what :func:`_distance_table` found. Then what the table adds is judged
    (the run minus a run with the table at 0), whatever sizes the record has: absolute positions beside it (an
    embedding added to x, TUPE's untied term) are the same in both runs."""
    same = x[:, :1].expand_as(x).clone()
    try:
        trace, _ = record(module, partial(caller, same))
        without = None
        if table is not None:
            kept = table[0].detach().clone()
            try:
                with torch.no_grad():
                    table[0].zero_()
                without, _ = record(module, partial(caller, same))
            finally:
                with torch.no_grad():
                    table[0].copy_(kept)
    except Exception:  # a module that rejects repeated tokens has been read on the probe input
        return None
    n = x.shape[1]
    if table is not None:  # relative on one of the grids the table fits
        found = [unshifted_relative(trace, n, sides, True, without) for sides in table[1]]
        return None if None in found else found[0]
    return unshifted_relative(trace, n, grid(n) if caller.layout in ("channels-first", "channels-last") else None)


def _by_projections(cap: Capture | str, out: Tensor, heads: list[int], keep: Tensor | None, raw: Tensor | None,
                    bias: Tensor | None, stated: Callable[[int], float | None]) -> tuple[tuple | None, str]:
    """(fid, evidence, facts) from the projections, or (None, why not)."""
    if isinstance(cap, str):
        return None, cap
    try:
        fid, evidence = identify(cap, out, heads, keep, raw, bias, stated=stated)
    except NoFormula as err:
        return None, str(err)
    evidence["projections"] = cap.how
    return (fid, evidence, {}), ""


def _other_tokens(module: nn.Module, call: Callable[..., Tensor], x: Tensor) -> Callable[[], Trace | None]:
    """The record of ``call`` (x and the run's mask) on the tokens of x in reverse order, made when first asked;
    None when the module refuses them."""
    made: list[Trace | None] = []

    def partner() -> Trace | None:
        if not made:
            other = x.flip(1)  # outside the record: the two records hold the same operations
            try:
                made.append(record(module, lambda: call(x=other))[0])
            except Exception:  # a module that rejects these tokens: no second run to read
                made.append(None)
        return made[0]

    return partner


def _by_operands(trace, out: Tensor, width: int, length: int, stated: Callable[[int], float | None],
                 before: str, keep: Tensor | None, inputs: frozenset[int],
                 local: bool = False, partner: Callable[[], Trace | None] | None = None,
                 causal: bool = False) -> tuple[tuple | None, str]:
    """The verdict of the attention's own products (the first bug among its cores, else the definition)."""
    try:
        verdicts = examine_cores(trace, out, width, length, stated, keep, out.shape[0], inputs, local, partner,
                                 causal)
    except Unseen as err:  # no formula can be judged, from the projections either: their fit missed a hidden step
        return None, f"not seen: {err}"
    except Unrecognised as err:
        reason = f"{before}; from the operands: {err}" if before else str(err)
        return None, ("not followed: " if "no attention was found" in str(err) else "") + reason
    bad = next((v for v in verdicts if v.fid is not None), None)
    chosen = bad or verdicts[0]
    facts = {k: v for verdict in verdicts for k, v in verdict.facts.items()}
    evidence = {**chosen.evidence, "read from": "the operands of the attention's products"}
    if chosen.also:  # bugs of other kinds the same core follows, each named
        evidence["_also"] = [(v.fid, {**v.evidence, "read from": evidence["read from"]}) for v in chosen.also]
    if "position term" in facts or "positions" in facts:
        evidence["positions"] = facts.get("positions", facts.get("position term"))
    elif "reduced keys" in facts:  # which tokens pool into which key follows their positions
        evidence["positions"] = "keys and values pooled from the tokens by their positions (a sequence reduction)"
    return (chosen.fid, evidence, facts), ""


def _unmatched_inversion(fid: str | None, evidence: dict) -> tuple[str | None, dict]:
    """mask-inverted read with a mask whose effect matched no convention is mask-ignored: there was no polarity to
    invert (items given each other's masks)."""
    if fid != MASK_INVERTED:
        return fid, evidence
    return MASK_IGNORED, {**evidence, "matches": f"{evidence.get('matches')}, with a mask whose effect matches no "
                                                 "convention: it hides other keys than it marks"}


def _zeroed_rows(out: Tensor, keep: Tensor) -> dict:
    """The fact "padded query rows are zeroed" when the output rows of padded positions are exactly 0."""
    padded = ~keep.any(dim=-2)  # (B, L): keys no query sees
    if padded.any() and bool((out[padded] == 0).all()) and bool((out[~padded] != 0).any()):
        return {"padded queries": "the outputs of padded positions are zeroed"}
    return {}


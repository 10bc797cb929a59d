"""The doctor's catalogue of finding kinds, and the :class:`Finding` a probe emits.

A kind names one bug (or one fact a user may have intended, a warning): its id, severity, one-line
summary, fix, and the symptoms it explains. Each is a constant here (``MISSING_SCALE``, ...), and a
probe emits findings of the constants it declares in the doctor's probe table
(:data:`selfattn.check.doctor.PROBES`); the README's findings table and docs/doctor.md's list are
generated from :data:`CATALOGUE` (``scripts/doctor_docs.py``). An id's meaning never changes, since
users match on it (``--json``, CI checks).

A specific diagnosis (the white box found the formula a known bug computes) explains black-box
symptoms (batch mixing, a leak past the mask, ...): those are folded into it, not reported twice.
A diagnosis explains only symptoms its bug can cause; it never absorbs a finding of another kind.

Adding a kind: one constant below (in :data:`CATALOGUE`'s order of the README table), one ``emits``
entry in the probe that finds it, and the probe's check; docs/doctor.md's recipe says more.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["CATALOGUE", "EXPLAINS", "FINDING_IDS", "FIXES", "SEVERITY", "Finding", "Kind", "Severity", "kind"]

Severity = Literal["error", "warning"]


class Kind(str):
    """One kind of finding: a string equal to its id, carrying what the catalogue says of it.

    ``severity``: "error" is a bug and fails the check; "warning" can be intended (a module that adds
    positions is not permutation equivariant) or is the accepted behaviour of torch's own modules (NaN
    for a sequence that is all padding). ``summary``: what it means, in a line (the README's table).
    ``fix``: how to fix it. ``explains``: the ids of the symptoms this diagnosis accounts for, folded
    into it when both are seen.
    """

    severity: Severity
    summary: str
    fix: str
    explains: frozenset[str]

    def __new__(cls, fid: str, severity: Severity, summary: str, fix: str, explains: frozenset[str] = frozenset()
                ) -> Kind:
        self = super().__new__(cls, fid)
        self.severity, self.summary, self.fix, self.explains = severity, summary, fix, explains
        return self

    @property
    def id(self) -> str:
        """The id, as a plain string."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Kind({self.id!r})"


def _error(fid: str, summary: str, fix: str, explains: tuple[str, ...] = ()) -> Kind:
    return Kind(fid, "error", summary, fix, frozenset(explains))


def _warning(fid: str, summary: str, fix: str) -> Kind:
    return Kind(fid, "warning", summary, fix)


BATCH_MIXING = _error(
    "batch-mixing", "batch items change each other (`.T` on a 3-D tensor, ...)",
    "Keep the batch dimension apart: transpose only the last two dims (k.transpose(-2, -1)), never the whole "
    "tensor (.T), and normalise over keys only.",
    # causal-leak is not here: a module that mixes the batch can leak the future as well, and both are named
    ("not-equivariant", "shape-dependent", "wrong-output-shape", "mask-ignored"))
MISSING_SCALE = _error("missing-scale", "no 1/sqrt(D) on the scores",
                       "Divide the scores by sqrt(head_dim) before the softmax; a design published without a scale "
                       "(SAGAN's and the non-local block's image attention) is stated with --scale 1.")
WRONG_SCALE = _error("wrong-scale", "the scores scaled by 1/D or 1/sqrt(E) instead of 1/sqrt(D)",
                     "Scale the scores by 1/sqrt(head_dim), the size of one head's q/k vectors (not head_dim, "
                     "not embed_dim).")
SOFTMAX_DIM = _error("softmax-dim", "softmax over queries or the batch",
                     "Take the softmax over the keys: torch.softmax(scores, dim=-1).",
                     ("batch-mixing", "not-equivariant", "causal-leak", "nan-on-masked-row", "mask-ignored"))
MATMUL_ORDER = _error("matmul-order", "V @ weights, or weights transposed",
                      "Compute weights @ V (weights: (..., Lq, Lk), V: (..., Lk, D)), not V @ weights or "
                      "weights^T @ V.",
                      ("batch-mixing", "not-equivariant", "causal-leak", "shape-dependent", "wrong-output-shape",
                       "mask-ignored"))
HEAD_MERGE = _error("head-merge", "heads merged (or tokens put back into a (B, C, H, W) map) with view/reshape "
                    "before the transpose back",
                    "Merge heads with out.transpose(1, 2).reshape(B, L, E) (transpose before view/reshape); put tokens "
                    "back into a map with out.transpose(1, 2).reshape(B, C, H, W), not out.reshape(B, C, H, W).",
                    ("batch-mixing", "not-equivariant", "causal-leak", "mask-ignored", "mask-inverted"))
VALUES_CHANGED = _error("values-changed", "V reaches the product changed after its projection (rotary applied to v)",
                        "Multiply the weights by V as the value projection made it: rotary positions (and any "
                        "other rotation) belong on q and k only.", ("not-equivariant",))
ROTARY_ONE_SIDE = _error("rotary-one-side", "rotary positions on q but not on k (or on k only)",
                         "Rotate q and k by the same positions: the scores then depend on the distance between "
                         "tokens only.", ("not-equivariant",))
ROTARY_MISMATCH = _error("rotary-mismatch", "q and k not rotated alike (rotated and pass-through parts in other "
                         "orders, other positions or frequencies), or by a map that is no rotation (cos/sin laid out "
                         "for another pairing): the scores depend on absolute positions; or rotated along another axis "
                         "than the tokens (the heads): the scores carry no position",
                         "Rotate q and k by the same cos/sin at their positions, on the same dims, with the rotated "
                         "and pass-through parts in the same order; lay cos/sin out for the pairing the rotation uses "
                         "(repeat_interleave for interleaved pairs, cat((f, f)) for rotate-half) and along the token "
                         "axis of the layout they are applied to ((B, H, L, D) tables on (B, H, L, D) q and k).",
                         ("not-equivariant",))
HEAD_SPLIT = _error("head-split", "q, k or v split into heads (or a (B, C, H, W) map flattened into tokens) by a view "
                    "that puts one token's features on the rows of others",
                    "Split heads with x.view(B, L, H, D).transpose(1, 2), not x.view(B, H, L, D); lay keys out for q "
                    "@ k with k.transpose(-2, -1), not k.view(B, H, D, L); flatten a (B, C, H, W) map with "
                    "x.flatten(2).transpose(1, 2), not x.reshape(B, H * W, C).",
                    ("not-equivariant", "causal-leak", "mask-ignored", "mask-inverted", "head-merge", "softmax-dim",
                     "matmul-order"))
GROUP_MISMATCH = _error("group-mismatch", "with grouped keys and values (GQA, MQA), a query head takes its keys from "
                        "one kv head and its values from another",
                        "Repeat k and v alike: k.repeat_interleave(H // G, dim=1) and v.repeat_interleave(H // G, "
                        "dim=1) (or both with expand and reshape); not repeat_interleave for one and repeat for the "
                        "other.", ("not-equivariant",))
MASK_IGNORED = _error("mask-ignored", "padded keys still change real tokens' outputs",
                      "Apply the mask to the scores before the softmax (scores.masked_fill(~visible, -inf)).")
MASK_INVERTED = _error("mask-inverted", "the mask works the other way round (declared polarity, or an additive mask "
                       "with the wrong sign)",
                       "Flip the mask polarity (or fix the convention you documented): keep = may attend.",
                       ("mask-ignored",))
MASK_AFTER_SOFTMAX = _error("mask-after-softmax", "the mask multiplied or added into the weights after the softmax",
                            "Mask the scores before the softmax, so the weights of visible keys sum to 1.",
                            ("mask-ignored", "causal-leak", "not-equivariant"))  # hidden keys stay in the sum
MASK_BROADCAST = _error("mask-broadcast", "a (B, L) key mask spread over the query axis ((B, 1, L, 1))",
                        "A (B, L) key mask hides keys: reshape it to (B, 1, 1, L) (mask[:, None, None, :]), not "
                        "(B, 1, L, 1), so it broadcasts over the query axis.", ("mask-ignored", "nan-on-masked-row"))
MASK_ERROR = _error("mask-error", "the module raises whenever it gets the mask in the convention you stated",
                    "The module raises when it is given the mask in the convention you stated: apply the mask the "
                    "way its shape and kind say (or state the convention the module really has).")
CAUSAL_LEAK = _error("causal-leak", "the causal mask hides the diagonal or past, or shows some future; or earlier "
                     "outputs change with the number of tokens after them",
                     "Hide exactly the future: visible when j <= i (torch.ones(L, L).tril() as keep-mask); the "
                     "diagonal must stay visible.",
                     ("mask-ignored",))  # a row the broken causal mask empties sees padding too
KEYS_HIDDEN = _error("keys-hidden", "some keys are hidden although you said the module is bidirectional "
                     "(`--bidirectional`)",
                     "Let every query see every key: drop the causal mask, window or is_causal=True that a "
                     "bidirectional module (an encoder, a vision transformer) must not have.")
NAN_ON_MASKED_ROW = _warning("nan-on-masked-row", "a query row with every key masked gives NaN (torch's own "
                             "MultiheadAttention does, as does every -inf fill)",
                             "Give rows with no visible key an output of 0 (or use a finite fill), e.g. "
                             "selfattn.attention, which returns 0 there; a NaN in a row the loss ignores still "
                             "reaches the gradients.")
NAN_ON_EMPTY_SEQUENCE = _warning("nan-on-empty-sequence", "a sequence that is all padding gives NaN (torch's own "
                                 "MultiheadAttention does)",
                                 "Drop sequences that are all padding, or give their rows an output of 0 (as "
                                 "selfattn.attention does); torch's MultiheadAttention and SDPA return NaN there.")
HALF_PRECISION_OVERFLOW = _error("half-precision-overflow", "float16/bfloat16 raises or gives NaN/inf where float32 "
                                 "is fine",
                                 "Fill masked scores with a dtype-safe value (torch.finfo(scores.dtype).min or -inf "
                                 "with a guard for empty rows), not a float32 constant like -1e9; or pass a bool mask "
                                 "to torch.nn.functional.scaled_dot_product_attention.")
HALF_PRECISION_MISMATCH = _error("half-precision-mismatch", "float16/bfloat16 differs from float32 by more than "
                                 "rounding (a mask or term lost)",
                                 "Keep every term in half precision: a mask, bias or scale skipped or changed for "
                                 "float16/bfloat16 (a 'fast path', a dtype check) makes the output differ from "
                                 "float32's by more than rounding.")
WRONG_GRADIENT = _error("wrong-gradient", "autograd's gradient differs from the finite-difference derivative",
                        "Check the backward of your custom autograd.Function (or of any operation whose gradient you "
                        "wrote or replaced) with torch.autograd.gradcheck in float64; the gradient must be the "
                        "derivative of the forward.")
MASK_CONVENTION = _warning("mask-convention", "an `attention_mask` read as True = masked (Hugging Face's convention "
                           "is 1 = attend), or a `key_padding_mask` read as True = attend (torch's is True = padding)",
                           "Read the mask as its name says (attention_mask: 1 = attend; key_padding_mask: True = "
                           "padding, so that SDPA's attn_mask gets ~key_padding_mask), or name the argument for what "
                           "it is, so that callers do not pass it inverted.")
DEFINITION_MISMATCH = _error("definition-mismatch", "the output follows no formula of attention "
                             "(`--allow-nonstandard` to accept)",
                             "The output follows no formula of attention: compare your code with softmax(Q K^T / "
                             "sqrt(head_dim) + mask) V, term by term (scale, operands, normalisation). If the module "
                             "is non-standard on purpose, pass --allow-nonstandard.", ("not-equivariant",))
NON_FINITE = _error("non-finite", "NaN or inf on ordinary or large inputs",
                    "Subtract the row max before exp (torch.softmax does) and keep the scores finite.")
DROPOUT_IN_EVAL = _error("dropout-in-eval", "two eval calls differ",
                         "Use nn.Dropout (or F.dropout(..., training=self.training)) so eval() turns it off.")
NO_GRAD = _error("no-grad", "a parameter or the input gets no gradient, or a projection is never used",
                 "Don't detach or compute under no_grad inside forward; every parameter should get a gradient.")
NOT_EQUIVARIANT = _warning("not-equivariant", "permuting tokens does not permute the output, and no position term "
                           "explains it",
                           "Without positions or masks, attention must commute with permuting the tokens; look for "
                           "reshapes that mix positions (if the module adds positions, this is expected).")
STATE_DEPENDENT = _error(
    "state-dependent", "a call replaces the module's own state and a later call then fails where the module as "
    "given runs, reuses it for other tokens of the same shape, or (a causal cache) continues another sequence",
    "Don't store what one call needs in place of what the next needs: slice a fixed buffer into a local "
    "(mask = self.mask[:L, :L], not self.mask = self.mask[:L, :L]), keep caches apart from the buffers "
    "every call reads, and never reuse cached keys or values because the shape matches.")
MUTATES_INPUT = _warning("mutates-input", "the module changes its input or its mask in place (the doctor hands it "
                         "copies)",
                         "Leave the caller's tensors as they were: use out-of-place operations on the input and the "
                         "mask (mask = mask.unsqueeze(1).eq(0), not mask.unsqueeze_(1).eq_(0)), so that a caller who "
                         "reuses a mask across layers or steps gets the same one each time.")
WRONG_OUTPUT_SHAPE = _error("wrong-output-shape", "the output is not (B, L, E) for input (B, L, E)",
                            "Return (B, L, E) for input (B, L, E).")
SHAPE_DEPENDENT = _error("shape-dependent", "the module runs only for some shapes",
                         "The module runs only for some shapes: look for .T, view() or matmuls whose sizes match "
                         "only by accident.")

CATALOGUE: dict[str, Kind] = {k.id: k for k in (
    BATCH_MIXING, MISSING_SCALE, WRONG_SCALE, SOFTMAX_DIM, MATMUL_ORDER, HEAD_MERGE, VALUES_CHANGED, ROTARY_ONE_SIDE,
    ROTARY_MISMATCH, HEAD_SPLIT, GROUP_MISMATCH, MASK_IGNORED, MASK_INVERTED, MASK_AFTER_SOFTMAX, MASK_BROADCAST,
    MASK_ERROR, CAUSAL_LEAK, KEYS_HIDDEN,
    NAN_ON_MASKED_ROW, NAN_ON_EMPTY_SEQUENCE, HALF_PRECISION_OVERFLOW, HALF_PRECISION_MISMATCH, WRONG_GRADIENT,
    MASK_CONVENTION, DEFINITION_MISMATCH, NON_FINITE, DROPOUT_IN_EVAL, NO_GRAD, NOT_EQUIVARIANT, MUTATES_INPUT,
    WRONG_OUTPUT_SHAPE, SHAPE_DEPENDENT, STATE_DEPENDENT)}
"""Every kind, by id, in the order the README's table lists them."""

# a module that is random in eval mode makes every comparison of two runs meaningless: its diagnosis
# explains every symptom but the ones a second run cannot cause
CATALOGUE[DROPOUT_IN_EVAL.id] = DROPOUT_IN_EVAL = Kind(
    DROPOUT_IN_EVAL.id, "error", DROPOUT_IN_EVAL.summary, DROPOUT_IN_EVAL.fix,
    frozenset(CATALOGUE) - {"dropout-in-eval", "no-grad", "half-precision-overflow", "mutates-input",
                                     "state-dependent"})

FINDING_IDS: tuple[str, ...] = tuple(CATALOGUE)
FIXES: dict[str, str] = {fid: k.fix for fid, k in CATALOGUE.items()}
SEVERITY: dict[str, Severity] = {fid: k.severity for fid, k in CATALOGUE.items()}
# The order :func:`~selfattn.check.report.merge` folds in: the most specific diagnosis first; every
# error diagnosis also explains definition-mismatch (no formula found is a symptom of every named bug).
EXPLAINS: dict[str, frozenset[str]] = {
    fid: CATALOGUE[fid].explains | ({"definition-mismatch"} if fid != "definition-mismatch" else set())
    for fid in ("definition-mismatch", "head-split", "mask-broadcast", "mask-inverted", "softmax-dim", "matmul-order",
                "head-merge", "batch-mixing", "mask-after-softmax", "values-changed", "rotary-one-side",
                "rotary-mismatch", "group-mismatch", "causal-leak", "dropout-in-eval")}


def kind(fid: str | Kind) -> Kind:
    """The kind of ``fid`` (a kind passes through); KeyError naming the catalogue for an unknown id."""
    if isinstance(fid, Kind):
        return fid
    try:
        return CATALOGUE[fid]
    except KeyError:
        raise KeyError(f"{fid!r} is not a finding id of the doctor's catalogue: {', '.join(CATALOGUE)}") from None


@dataclass
class Finding:
    """One bug: its id (see :data:`FINDING_IDS`), what was seen, the evidence and the fix."""

    id: str
    message: str
    evidence: dict
    fix: str
    direct: bool = field(default=False, compare=False)
    """Seen as the bug itself, not as a symptom (a mask that changes nothing at all): no diagnosis of another kind
    explains it away (:func:`~selfattn.check.report.merge`)."""

    @classmethod
    def of(cls, fid: Kind | str, message: str, evidence: dict, direct: bool = False) -> Finding:
        """A finding of kind ``fid``, with the catalogue's fix.

        Args:
            fid: a kind of the catalogue (a constant such as ``MISSING_SCALE``, or its id).
            message: what the probe saw.
            evidence: the numbers or examples behind it (JSON-serialisable).
            direct: the bug itself was seen, which no other kind of bug can cause: it is never folded into
                another diagnosis.

        Returns:
            The finding.
        """
        k = kind(fid)
        return cls(k.id, message, evidence, k.fix, direct)

    @property
    def kind(self) -> Kind:
        """The finding's kind in the catalogue."""
        return kind(self.id)

    @property
    def severity(self) -> Severity:
        """"error" (a bug) or "warning" (may be intended, e.g. a module with positions is not equivariant)."""
        return self.kind.severity

    def to_dict(self) -> dict:
        """{"id", "severity", "message", "evidence", "fix"}."""
        return {"id": self.id, "severity": self.severity,
                **{k: v for k, v in asdict(self).items() if k not in ("id", "direct")}}

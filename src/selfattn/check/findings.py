"""The doctor's catalogue of findings: each id, how to fix it, how serious it is, and what it explains.

An id names one bug; its meaning never changes, since users match on it (``--json``, CI checks).
A white-box diagnosis (the module's output follows a known wrong formula) explains black-box
symptoms (batch mixing, a leak past the mask, ...); those are folded into it, not reported twice.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["EXPLAINS", "FINDING_IDS", "FIXES", "SEVERITY", "Severity"]

Severity = Literal["error", "warning"]

FIXES: dict[str, str] = {
    "batch-mixing": "Keep the batch dimension apart: transpose only the last two dims (k.transpose(-2, -1)), "
                    "never the whole tensor (.T), and normalise over keys only.",
    "missing-scale": "Divide the scores by sqrt(head_dim) before the softmax.",
    "wrong-scale": "Scale the scores by 1/sqrt(head_dim), the size of one head's q/k vectors "
                   "(not head_dim, not embed_dim).",
    "softmax-dim": "Take the softmax over the keys: torch.softmax(scores, dim=-1).",
    "matmul-order": "Compute weights @ V (weights: (..., Lq, Lk), V: (..., Lk, D)), not V @ weights or "
                    "weights^T @ V.",
    "values-changed": "Multiply the weights by V as the value projection made it: rotary positions (and any other "
                      "rotation) belong on q and k only.",
    "head-merge": "Merge heads with out.transpose(1, 2).reshape(B, L, E) (transpose before view/reshape).",
    "mask-ignored": "Apply the mask to the scores before the softmax (scores.masked_fill(~visible, -inf)).",
    "mask-inverted": "Flip the mask polarity (or fix the convention you documented): keep = may attend.",
    "mask-after-softmax": "Mask the scores before the softmax, so the weights of visible keys sum to 1.",
    "mask-broadcast": "A (B, L) key mask hides keys: reshape it to (B, 1, 1, L) (mask[:, None, None, :]), "
                      "not (B, 1, L, 1), so it broadcasts over the query axis.",
    "mask-error": "The module raises when it is given the mask in the convention you stated: apply the mask the way "
                  "its shape and kind say (or state the convention the module really has).",
    "causal-leak": "Hide exactly the future: visible when j <= i (torch.ones(L, L).tril() as keep-mask); "
                   "the diagonal must stay visible.",
    "keys-hidden": "Let every query see every key: drop the causal mask, window or is_causal=True that a "
                   "bidirectional module (an encoder, a vision transformer) must not have.",
    "nan-on-masked-row": "Give rows with no visible key an output of 0 (or use a finite fill), e.g. "
                         "selfattn.attention, which returns 0 there.",
    "nan-on-empty-sequence": "Drop sequences that are all padding, or give their rows an output of 0 (as "
                             "selfattn.attention does); torch's MultiheadAttention and SDPA return NaN there.",
    "half-precision-overflow": "Fill masked scores with a dtype-safe value (torch.finfo(scores.dtype).min "
                               "or -inf with a guard for empty rows), not a float32 constant like -1e9; or pass "
                               "a bool mask to torch.nn.functional.scaled_dot_product_attention.",
    "half-precision-mismatch": "Keep every term in half precision: a mask, bias or scale skipped or changed for "
                               "float16/bfloat16 (a 'fast path', a dtype check) makes the output differ from "
                               "float32's by more than rounding.",
    "definition-mismatch": "The output follows no formula of attention: compare your code with softmax(Q K^T / "
                           "sqrt(head_dim) + mask) V, term by term (scale, operands, normalisation). If the "
                           "module is non-standard on purpose, pass --allow-nonstandard.",
    "non-finite": "Subtract the row max before exp (torch.softmax does) and keep the scores finite.",
    "dropout-in-eval": "Use nn.Dropout (or F.dropout(..., training=self.training)) so eval() turns it off.",
    "wrong-gradient": "Check the backward of your custom autograd.Function (or of any operation whose gradient "
                      "you wrote or replaced) with torch.autograd.gradcheck in float64; the gradient must be the "
                      "derivative of the forward.",
    "mask-convention": "Hugging Face code reads attention_mask as 1 = attend: flip the mask, or name the argument "
                       "for what it is (key_padding_mask, True = padding) so that callers do not pass it inverted.",
    "no-grad": "Don't detach or compute under no_grad inside forward; every parameter should get a gradient.",
    "not-equivariant": "Without positions or masks, attention must commute with permuting the tokens; "
                       "look for reshapes that mix positions (if the module adds positions, this is expected).",
    "wrong-output-shape": "Return (B, L, E) for input (B, L, E).",
    "mutates-input": "Leave the caller's tensors as they were: use out-of-place operations on the input and the "
                     "mask (mask = mask.unsqueeze(1).eq(0), not mask.unsqueeze_(1).eq_(0)), so that a caller who "
                     "reuses a mask across layers or steps gets the same one each time.",
    "shape-dependent": "The module runs only for some shapes: look for .T, view() or matmuls whose sizes match "
                       "only by accident.",
}
FINDING_IDS: tuple[str, ...] = tuple(FIXES)

# "warning": the finding can be intended (a module that adds positions is not permutation
# equivariant; a bool attention_mask read True = masked), or is the accepted behaviour of torch's own
# modules (NaN for a sequence that is all padding); every other finding is an error (a bug). Only
# errors fail the check.
SEVERITY: dict[str, Severity] = {fid: "warning" if fid in ("not-equivariant", "nan-on-empty-sequence",
                                                          "mask-convention", "mutates-input") else "error"
                                  for fid in FIXES}

# A diagnosis (key) explains these symptoms, which are then reported inside it rather than on their own.
# In order: the most specific diagnosis first.
# definition-mismatch (the white box found no formula) is a symptom of every more specific bug.
EXPLAINS: dict[str, frozenset[str]] = {
    "definition-mismatch": frozenset({"not-equivariant"}),
    "mask-broadcast": frozenset({"mask-ignored", "nan-on-masked-row", "definition-mismatch"}),
    "mask-inverted": frozenset({"mask-ignored", "definition-mismatch"}),
    "softmax-dim": frozenset({"batch-mixing", "not-equivariant", "causal-leak", "nan-on-masked-row",
                              "mask-ignored"}),
    "matmul-order": frozenset({"batch-mixing", "not-equivariant", "causal-leak", "shape-dependent",
                               "wrong-output-shape", "mask-ignored"}),
    "head-merge": frozenset({"batch-mixing", "not-equivariant", "causal-leak", "mask-ignored"}),
    "batch-mixing": frozenset({"not-equivariant", "shape-dependent", "wrong-output-shape", "causal-leak",
                               "mask-ignored"}),
    "mask-after-softmax": frozenset({"mask-ignored"}),
    "values-changed": frozenset({"not-equivariant"}),
    "causal-leak": frozenset({"mask-ignored"}),  # a row the broken causal mask empties sees padding too
    # a module that is random in eval mode makes every comparison of two runs meaningless
    "dropout-in-eval": frozenset(FIXES) - {"dropout-in-eval", "no-grad", "half-precision-overflow", "mutates-input"},
}
EXPLAINS = {fid: explained | {"definition-mismatch"} if fid != "definition-mismatch" else explained
            for fid, explained in EXPLAINS.items()}

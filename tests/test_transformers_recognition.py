"""Mask predicates of random structure: what the transformers mask function makes of them is exact.

A predicate is drawn as a random and/or/not combination of the rules transformers' predicates
are made of (comparisons of kv - q with constants, absolute distances, one-sided bounds, a
padding tensor read at the key, a rule with no named mask) and run on a random call: lengths,
offsets (the query offset an int or, as a static cache gives it, a tensor) and padding. The
selfattn mask must equal the predicate evaluated on every (query, key) pair.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from selfattn.integrations import transformers as sa_hf  # noqa: E402

PAD = torch.tensor([[True] * 40, [False] * 5 + [True] * 30 + [False] * 5])


def _atoms():
    c = st.integers(-6, 6)
    return st.one_of(
        st.builds(lambda k: (f"kv <= q + {k}", lambda b, h, q, kv: kv <= q + k), c),
        st.builds(lambda k: (f"kv > q - {k}", lambda b, h, q, kv: kv > q - k), c),
        st.builds(lambda k: (f"q - kv < {k}", lambda b, h, q, kv: q - kv < k), c),
        st.builds(lambda k: (f"kv >= q + {k}", lambda b, h, q, kv: kv >= q + k), c),
        st.builds(lambda k: (f"kv == q + {k}", lambda b, h, q, kv: kv == q + k), c),
        st.builds(lambda k: (f"abs(q - kv) <= {k}", lambda b, h, q, kv: abs(q - kv) <= k), st.integers(0, 6)),
        st.builds(lambda k: (f"q >= {k}", lambda b, h, q, kv: q >= k), st.integers(0, 30)),
        st.builds(lambda k: (f"kv < {k}", lambda b, h, q, kv: kv < k), st.integers(0, 40)),
        st.just(("pad[b, kv]", lambda b, h, q, kv: PAD[b, kv])),
        st.just(("(q + kv) % 3 != 0", lambda b, h, q, kv: (q + kv) % 3 != 0)),
    )


def _combine(children):
    def pair(op, a, b):
        (na, fa), (nb, fb) = a, b
        if op == "&":
            return f"({na} & {nb})", lambda b_, h, q, kv: fa(b_, h, q, kv) & fb(b_, h, q, kv)
        return f"({na} | {nb})", lambda b_, h, q, kv: fa(b_, h, q, kv) | fb(b_, h, q, kv)
    return st.one_of(
        st.builds(pair, st.sampled_from(["&", "|"]), children, children),
        st.builds(lambda a: (f"~{a[0]}", lambda b, h, q, kv: ~a[1](b, h, q, kv)), children))


PREDICATES = st.recursive(_atoms(), _combine, max_leaves=5)


@settings(max_examples=60, deadline=None)
@given(pred=PREDICATES, lq=st.integers(1, 9), extra=st.integers(0, 12), q_offset=st.integers(0, 15),
       kv_offset=st.integers(0, 8), tensor_offset=st.booleans())
def test_any_structure_of_rules_becomes_an_exact_mask(pred, lq, extra, q_offset, kv_offset, tensor_offset):
    """catches: a band bound off by one, a flipped comparison under ~, a conjunction folded wrongly,
    an offset applied on the wrong side, a one-sided part folded where it varies."""
    name, fn = pred
    lk = min(lq + extra, 40 - kv_offset)
    lq = min(lq, lk)
    offset = torch.tensor(q_offset) if tensor_offset else q_offset
    mask = sa_hf.selfattn_mask(2, lq, lk, offset, kv_offset, fn, None)
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = (torch.arange(lq) + q_offset).view(1, 1, -1, 1)
    kv = (torch.arange(lk) + kv_offset).view(1, 1, 1, -1)
    want = fn(b, h, q, kv).expand(2, 1, lq, lk)
    got = torch.ones(2, 1, lq, lk, dtype=torch.bool) if mask is None else mask.dense(lq, lk).expand(2, 1, lq, lk)
    call = (lq, lk, q_offset, kv_offset)
    assert torch.equal(got, want), f"{name} on (Lq, Lk, q_offset, kv_offset) = {call}: {mask!r}"

"""The plain call, ``attention(q, k, v)`` with at most scale and dropout, takes a short path
(functional._plain_call and dispatch.choose_plain). It must be the full path in every respect:
the same backend, bit-identical outputs and gradients, and the same error for every bad input.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import LAYOUTS, build

import selfattn
from selfattn import functional
from selfattn.backends import dispatch


def _full_path(q, k, v, **kw):
    """The same call through _validate and choose(): naming the backend auto would pick skips the
    plain path."""
    return selfattn.attention(q, k, v, backend="sdpa", **kw)


@st.composite
def plain_calls(draw: st.DrawFn) -> dict:
    hkv, g = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    return dict(b=draw(st.integers(1, 3)), hq=hkv * g, hkv=hkv, lq=draw(st.integers(1, 33)),
                lk=draw(st.integers(1, 33)), d=draw(st.sampled_from([1, 8, 16, 59, 64])),
                dv=draw(st.sampled_from([None, 8, 32])),
                dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])),
                layouts=[draw(st.sampled_from(LAYOUTS)) for _ in "qkv"],
                scale=draw(st.sampled_from([None, 0.3, 2])), grad=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=60, deadline=None)
@given(plain_calls())
def test_plain_path_is_the_full_path(c: dict) -> None:
    gen = torch.Generator().manual_seed(c["seed"])
    dv = c["dv"] or c["d"]
    shapes = ((c["b"], c["hq"], c["lq"], c["d"]), (c["b"], c["hkv"], c["lk"], c["d"]),
              (c["b"], c["hkv"], c["lk"], dv))
    built = [build(s, lay, c["dtype"], gen) for s, lay in zip(shapes, c["layouts"], strict=True)]
    leaves = [[b.leaf.clone().requires_grad_(c["grad"]) for b in built] for _ in range(2)]
    outs = []
    for run, ls in zip((selfattn.attention, _full_path), leaves, strict=True):
        q, k, v = (b.make(leaf) for b, leaf in zip(built, ls, strict=True))
        out = run(q, k, v, scale=c["scale"])
        if c["grad"]:
            out.backward(torch.ones_like(out))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    if c["grad"]:
        for a, b in zip(*leaves, strict=True):
            assert torch.equal(a.grad, b.grad)
    q, k, v = (b.make(leaf) for b, leaf in zip(built, leaves[0], strict=True))
    with torch.set_grad_enabled(c["grad"]):
        call = functional._plain_call(q, k, v, c["scale"], 0.0)
        assert call is not None
        assert dispatch.choose_plain(call) == dispatch.choose(call).backend


@pytest.fixture
def validated(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Grows by one entry per call that goes through functional._validate (the full path)."""
    seen: list[bool] = []
    real = functional._validate

    def spy(*args, **kwargs):
        seen.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(functional, "_validate", spy)
    return seen


def test_plain_call_skips_validate_and_full_calls_do_not(validated: list[bool]) -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    seen = validated
    selfattn.attention(q, k, v)
    selfattn.attention(q, k, v, scale=0.5, dropout_p=0.1)
    assert not seen
    for kw in (dict(causal=True), dict(mask=torch.ones(4, 4, dtype=torch.bool)), dict(bias=torch.zeros(4, 4)),
               dict(return_lse=True), dict(backend="reference"), dict(sinks=torch.zeros(2)),
               dict(score_mod=selfattn.scores.softcap(5.0))):
        seen.clear()
        selfattn.attention(q, k, v, **kw)
        assert seen, kw
    for context in (selfattn.use_backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16)):
        seen.clear()
        with context:
            out = selfattn.attention(q, k, v)
        assert seen
    assert out.dtype == torch.bfloat16  # autocast applied (by the full path)


def test_plain_dropout_matches_full_path() -> None:
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    torch.manual_seed(3)
    a = selfattn.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    b = _full_path(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, selfattn.attention(q, k, v))


def _bad_inputs() -> list[tuple[str, tuple, dict]]:
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6)
    return [
        ("3-D q", (q[0], k, v), {}),
        ("list k", (q, k.tolist(), v), {}),
        ("int v", (q, k, v.long()), {}),
        ("dtype mix", (q, k.double(), v), {}),
        ("empty q", (q[:, :, :0], k, v), {}),
        ("empty D", (q[..., :0], k[..., :0], v), {}),
        ("empty Dv", (q, k, v[..., :0]), {}),
        ("batch", (q, k.expand(2, -1, -1, -1), v), {}),
        ("kv heads", (q, k, v[:, :1]), {}),
        ("kv length", (q, k, v[:, :, :4]), {}),
        ("head dim", (q, k[..., :4], v), {}),
        ("gqa", (q[:, :3], k, v), {}),
        ("int q", (q.long(), k, v), {}),
        ("scale 0", (q, k, v), dict(scale=0.0)),
        ("scale nan", (q, k, v), dict(scale=float("nan"))),
        ("scale bool", (q, k, v), dict(scale=True)),
        ("scale str", (q, k, v), dict(scale="1")),
        ("dropout 1", (q, k, v), dict(dropout_p=1.0)),
        ("dropout neg", (q, k, v), dict(dropout_p=-0.1)),
        ("dropout bool", (q, k, v), dict(dropout_p=True)),
        ("dropout tensor", (q, k, v), dict(dropout_p=torch.tensor([0.1, 0.2]))),
        ("return_lse 0", (q, k, v), dict(return_lse=0)),
        ("causal 0", (q, k, v), dict(causal=0)),
        ("backend", (q, k, v), dict(backend="fast")),
        ("no kv heads", (q, k[:, :0], v[:, :0]), {}),
        ("no q heads", (q[:, :0], k, v), {}),
        ("float8", (q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)), {}),
    ]


@pytest.mark.parametrize(("name", "args", "kw"), _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_plain_path_rejects_what_the_full_path_rejects(name: str, args: tuple, kw: dict) -> None:
    with pytest.raises((TypeError, ValueError)) as plain:
        selfattn.attention(*args, **kw)
    with pytest.raises((TypeError, ValueError)) as full:
        selfattn.attention(*args, **kw, mask=None, causal=False) if "backend" in kw else _full_path(*args, **kw)
    assert type(plain.value) is type(full.value)
    assert str(plain.value) == str(full.value)


def test_plain_choice_is_remembered_per_facts() -> None:
    q = k = v = torch.randn(1, 2, 3, 4)
    call = functional._plain_call(q, k, v, None, 0.0)
    assert call is not None
    with torch.no_grad():
        frozen = dispatch._plain_facts(call)
    grad = functional._plain_call(q.requires_grad_(), k, v, None, 0.0)
    assert grad is not None
    assert dispatch._plain_facts(grad) != frozen
    dispatch.choose_plain(call)
    assert dispatch._PLAIN[dispatch._plain_facts(call)] == dispatch.choose(call).backend


def test_backend_must_be_a_string_on_every_path(validated: list[bool]) -> None:
    q = torch.randn(1, 2, 3, 4)

    class Always(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    with pytest.raises(TypeError, match="backend must be a string"):
        selfattn.attention(q, q, q, backend=["auto"])  # type: ignore[arg-type]
    validated.clear()
    selfattn.attention(q, q, q, backend=Always("reference"))  # a str subclass: the full path decides
    assert validated


def test_unsupported_float_dtypes_are_a_type_error() -> None:
    q = torch.randn(1, 2, 3, 4).to(torch.float8_e5m2)
    for kw in ({}, dict(causal=True)):
        with pytest.raises(TypeError, match="must be a floating tensor"):
            selfattn.attention(q, q, q, **kw)

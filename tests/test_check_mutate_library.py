"""The mutation machinery on library code: classes of installed packages, the functions they call, their idioms.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap

import pytest
import torch

from selfattn.mutation import mutants, score

IDIOMS = textwrap.dedent('''
    import torch
    from torch import nn


    def eager_attention_forward(module, query, key, value, attention_mask, scaling):
        attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(attn_weights, value).transpose(1, 2).contiguous()


    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)


    def unused(x):
        return x.transpose(1, 2)


    class Idioms(nn.Module):
        def __init__(self, head_dim):
            super().__init__()
            self.scaling = head_dim ** -0.5
            self.attend = nn.Softmax(dim=-1)

        def forward(self, q, k, v, mask):
            a = eager_attention_forward(self, rotate_half(q), k, v, mask, self.scaling)
            b = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                           is_causal=False)
            w = torch.einsum("bhqd,bhkd->bhqk", q, k).masked_fill(~mask, float("-inf"))
            c = torch.einsum("bhqk,bhkd->bhqd", self.attend(w), v)
            return a + b + rearrange(c, "b h n d -> b n (h d)")
''')


def test_operators_fire_on_library_idioms():
    """catches: library idioms left unmutated (HF's `matmul(q, k.transpose(2, 3)) * scaling` and
    `softmax(dim=-1, dtype=float32)`, `w + causal_mask`, a scale set in __init__, SDPA's scale= and is_causal=,
    einsum subscripts, einops groups, nn.Softmax, masked_fill, rotate_half's negation), or a module-level function
    the class calls not mutated while one it does not call is."""
    found = mutants(IDIOMS, "Idioms")
    ops = {m.operator for m in found}
    assert ops >= {"drop the scale", "scale 1/d instead of 1/sqrt(d)", "scale doubled", "transpose the batch dimension",
                   "drop a transpose", "subtract the mask instead of adding it", "drop the mask", "softmax over dim -2",
                   "swap matmul operands", "flip is_causal", "swap q and k", "einsum: swap the output's last two axes",
                   "einsum: transpose the first operand", "einops: swap a grouped axis", "drop a masked_fill",
                   "drop a mask inversion (~)", "drop a negation", "drop .contiguous()",
                   "move the mask after the softmax", "softmax over dim 0"}, ops
    lines = {int(m.where.split(":")[0].split()[1]) for m in found}
    source_lines = IDIOMS.splitlines()
    assert any("rotate_half" not in source_lines[n - 1] and "-x2" in source_lines[n - 1] for n in lines)
    assert not any("def unused" in source_lines[n - 2] for n in lines)  # not called by the class: not mutated
    for m in found:
        ast.parse(m.source)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package on disk whose attention module uses a relative import (at module level and inside forward); no mask,
    few mutation sites (the test's time goes to one doctor run per mutant)."""
    root = tmp_path / "attnpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "helpers.py").write_text("def scale_of(d):\n    return d ** -0.5\n")
    (root / "attn.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        from .helpers import scale_of


        def heads(t, h):
            b, n, _ = t.shape
            return t.view(b, n, h, -1).transpose(1, 2)


        class Attn(nn.Module):
            def __init__(self, dim, num_heads=4):
                super().__init__()
                self.num_heads = num_heads
                self.qkv = nn.Linear(dim, 3 * dim)
                self.out = nn.Linear(dim, dim)

            def forward(self, x):
                from .helpers import scale_of as local_scale  # a relative import run at call time

                q, k, v = (heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
                s = q @ k.transpose(-2, -1) * local_scale(q.shape[-1])
                return self.out((s.softmax(dim=-1) @ v).transpose(1, 2).reshape(x.shape))
    '''))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [n for n in sys.modules if n.startswith("attnpkg")]:
        del sys.modules[name]


def test_package_class_mutated_in_memory(package):
    """catches: a package's class that cannot be mutated (relative imports failing outside the package), its
    module-level functions left alone, the package's files written to, or the installed class replaced."""
    before = {p.name: p.read_text() for p in package.iterdir() if p.is_file()}
    cls = importlib.import_module("attnpkg.attn").Attn
    result = score(cls, make=lambda c: c(32, 4))
    assert result.total > 0 and result.stillborn < result.total and result.non_equivalent > 0, result
    assert any("heads" in m.source and "transpose(0" in m.source for m in
               mutants(inspect.getsource(sys.modules["attnpkg.attn"]), "Attn", definitions_only=True))
    assert {p.name: p.read_text() for p in package.iterdir() if p.is_file()} == before
    assert not (package / "__pycache__").exists()
    assert importlib.import_module("attnpkg.attn").Attn is cls


@pytest.mark.slow
def test_library_class_from_site_packages():
    """catches: a class of a real installed package (timm's ViT attention, eager path) whose mutants cannot be
    built, or whose file in site-packages changes."""
    import doctor_corpus as dc

    entry = dc.CORPUS["timm-eager"]
    path = inspect.getsourcefile(dc.resolve(entry.target))
    before = open(path).read()
    torch.manual_seed(0)
    result = score(entry.target, entry.options, make=entry.make)
    assert result.non_equivalent > 0 and result.killed > 0, result
    assert open(path).read() == before


def test_a_class_is_built_at_the_default_width_without_options():
    """catches: the mutation score building a class with embed_dim=None (check's default, which now means "the
    module's own"), so that every tutorial class was "not run"."""
    import seed_models as sm

    result = score(sm.TutorialSelfAttention)
    assert result.non_equivalent > 0 and result.killed == result.non_equivalent, result


_REQUIRED_MASK = textwrap.dedent('''
    import math
    import torch
    from torch import nn


    class Args:
        def __init__(self, dim=32, heads=4):
            self.dim, self.heads = dim, heads


    class MaskedAttention(nn.Module):
        """forward(query, key, value, mask): the mask (B, T, T), True = keep, is required; built from Args."""

        def __init__(self, args):
            super().__init__()
            self.h, self.d = args.heads, args.dim // args.heads
            self.q, self.k, self.v = (nn.Linear(args.dim, args.dim) for _ in range(3))

        def forward(self, query, key, value, mask):
            b, t, e = query.shape
            q, k, v = (lin(z).view(b, -1, self.h, self.d).transpose(1, 2)
                       for lin, z in ((self.q, query), (self.k, key), (self.v, value)))
            scores = (q @ k.transpose(-2, -1) / math.sqrt(self.d)).masked_fill(~mask[:, None], -1e4)
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e)
''')


def test_mutants_of_a_module_that_requires_its_mask_are_run_with_it(tmp_path, monkeypatch):
    """catches: --mutate on a forward that requires its mask called every mutant without one, inside the doctor's
    own code (KeyError), and counted them all equivalent (100%); and --factory was not used to build them."""
    score_module = importlib.import_module("selfattn.mutation.score")

    path = tmp_path / "masked.py"
    path.write_text(_REQUIRED_MASK)
    namespace = score_module._load(_REQUIRED_MASK, path, "MaskedAttention").__init__.__globals__
    module = namespace["MaskedAttention"](namespace["Args"]()).eval()
    note = {"kind": "keep", "shape": score_module.MASK_SHAPES["BLL"], "argument": None}
    outs = score_module._outputs(module, {}, note)
    assert all(isinstance(o, torch.Tensor) for o in outs), outs
    with pytest.raises(score_module.CannotRun, match="--call"):
        score_module._outputs(module, {}, None, original=True)

    built = []

    def fake_score(spec, options, *, seed=0, make=None):
        built.append(make(score_module._target(spec).load(_REQUIRED_MASK)))
        return score_module.Score(spec, [])

    monkeypatch.setattr(score_module, "score", fake_score)
    score_module.main(f"{path}:MaskedAttention", {"factory": "lambda: MaskedAttention(Args(dim=16))"})
    assert built and built[0].q.in_features == 16


def test_mutants_run_in_the_originals_layout():
    """catches: --mutate sent (B, L, E) at lengths 7 and 5 to a module that runs only as a (B, H, W, E) map, and
    exited 2; the mutants now run in the layout and at the length the doctor probed the original with."""
    score_module = importlib.import_module("selfattn.mutation.score")

    class MapAttention(torch.nn.Module):
        def __init__(self, dim: int = 32) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim)

        def forward(self, x):  # (B, H, W, E)
            b, h, w, e = x.shape
            q, k, v = self.qkv(x.reshape(b, h * w, e)).chunk(3, -1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).reshape(b, h, w, e)

    module = MapAttention().eval()
    with pytest.raises(score_module.CannotRun):
        score_module._outputs(module, {}, None, original=True)
    outs = score_module._outputs(module, {"layout": "channels-last", "length": [16]}, None, original=True)
    assert all(isinstance(o, torch.Tensor) for o in outs), outs

"""The doctor's corpus: real attention modules, as users run them, and how the doctor is told to call each.

ONE table, :data:`CORPUS`: for every module, the library it comes from, the class (``target``:
"tests/file.py:Class" for modules written here, "package.module:Class" for a library's), how it
is built (``make(cls)``; None: the doctor builds the class itself, as ``selfattn check
file.py:Class`` would), the :func:`selfattn.check` options it needs (``call`` adapter, ``mask``,
shape limits ...), and for a buggy module the finding id it must get. The library classes are
imported from the installed packages (requirements-corpus.txt), never copied.

- hand-written, correct (tests/corpus_gpt.py, tests/corpus_modules.py): GPT-style module built from
  a config in the same file with a causal ``bias`` buffer, Swin-style fixed 7x7 window, post-norm
  encoder block, no-projection attention, q/k-normalised attention, sliding-window causal, KV cache
  for at most 32 rows, a required mask, float64 and bfloat16 parameters;
- hand-written, buggy (tests/corpus_buggy.py);
- timm's ViT ``Attention`` (fused SDPA path and eager path, q/k norm off and on), x-transformers'
  ``Attention`` (plain, causal, q/k norm, with a (B, L) key mask: it zeroes padded query rows),
  vit-pytorch's ``Attention`` (vit.py, simple_vit.py: LayerNorm before the projections),
  diffusers' ``Attention`` (default SDPA processor, the eager processor, and cross-attention
  used on itself: ``encoder_hidden_states=x``, the only use the doctor can check, since its
  probes are self-attention), open_clip's ``Attention`` and its ``ResidualAttentionBlock``'s
  attention (called through ``block.attention``), torch's ``nn.MultiheadAttention`` in both layouts.

transformers' attention classes are in tests/hf_corpus.py (one per model family).

Options that :func:`selfattn.check` does not take (yet) are kept in the table as what the module
needs; :func:`check_entry` passes them and the check raises TypeError until the doctor has them.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from selfattn.check import Report, check
from selfattn.check.subject.building import load_class

ROOT = Path(__file__).resolve().parent.parent
E, H = 64, 4  # embed dim and heads of every module built here (real models' proportions, head dim 16)


@dataclass(frozen=True)
class Entry:
    """One module of the corpus; see the module docstring."""

    name: str
    library: str
    target: str  # "tests/file.py:Class" (relative to the repository) or "package.module:Class"
    make: Callable[[type], nn.Module] | None = None  # builds the module from the (possibly mutated) class
    options: dict = field(default_factory=dict)  # selfattn.check keyword arguments
    finding: str | None = None  # the error id a buggy module must get; None: correct, must be certified
    note: str = ""
    known: frozenset[str] = frozenset()  # error ids that are true of this (otherwise correct) module

    @property
    def is_file(self) -> bool:
        """The class lives in a file of this repository (loadable by ``selfattn check file.py:Class``)."""
        return self.target.partition(":")[0].endswith(".py")

    @property
    def spec(self) -> str:
        """``self.target`` with an absolute path for file targets."""
        return str(ROOT / self.target) if self.is_file else self.target


def resolve(target: str) -> type:
    """"tests/file.py:Class" or "package.module:Class" -> the class (libraries that need torchvision get it)."""
    path, _, name = target.rpartition(":")
    if path.endswith(".py"):
        return load_class(f"{ROOT / path}:{name}")
    from torchvision_ops import define_torchvision_ops

    define_torchvision_ops()
    return getattr(importlib.import_module(path), name)


def build(entry: Entry, seed: int = 0, cls: type | None = None) -> nn.Module | str:
    """The module to check (seeded), or, for entries the doctor builds itself, the "file.py:Class" spec."""
    if entry.make is None:
        return entry.spec
    torch.manual_seed(seed)
    return entry.make(cls or resolve(entry.target))


def check_entry(entry: Entry, seed: int = 0) -> Report:
    """Run the doctor on one corpus entry with its options."""
    return check(build(entry, seed), seed=seed, **entry.options)


def _with_part(owner: str, attr: str, make_owner: Callable[[type], nn.Module]) -> Callable[[type], nn.Module]:
    """Build ``owner`` with ``make_owner`` and put a ``cls`` (the possibly mutated class of its ``attr`` part) in
    place of that part, built with the arguments the owner gave the original (to mutate x-transformers' Attend,
    the parameter-free core its Attention calls)."""
    def make(cls: type) -> nn.Module:
        original = type(getattr(make_owner(resolve(owner)), attr))
        seen: list[tuple[tuple, dict]] = []
        init = original.__init__

        def recording(self, *args, **kwargs):
            seen.append((args, kwargs))
            init(self, *args, **kwargs)

        original.__init__ = recording
        try:
            module = make_owner(resolve(owner))
        finally:
            original.__init__ = init
        args, kwargs = seen[-1]
        setattr(module, attr, cls(*args, **kwargs))
        return module
    return make


def _timm(qk_norm: bool = False, fused: bool = True) -> Callable[[type], nn.Module]:
    def make(cls: type) -> nn.Module:
        m = cls(E, H, qk_norm=qk_norm, norm_layer=nn.LayerNorm if qk_norm else None)
        m.fused_attn = fused  # False: the eager path (q * scale @ k^T, additive mask, softmax)
        return m
    return make


def _diffusers(processor: str | None = None, cross: bool = False) -> Callable[[type], nn.Module]:
    def make(cls: type) -> nn.Module:
        kwargs = {"cross_attention_dim": E} if cross else {}
        m = cls(E, heads=H, dim_head=E // H, **kwargs)
        if processor is not None:
            m.set_processor(getattr(importlib.import_module("diffusers.models.attention_processor"), processor)())
        return m
    return make


def _diffusers_processor(cls: type) -> nn.Module:
    """diffusers' Attention with a (possibly mutated) processor class."""
    from diffusers.models.attention_processor import Attention

    return Attention(E, heads=H, dim_head=E // H, processor=cls())


def _cross_self(m: nn.Module, x: torch.Tensor, mask: object) -> torch.Tensor:
    """diffusers' cross-attention used on itself: the context is x."""
    return m(x, encoder_hidden_states=x, attention_mask=mask)


def _block_attention(m: nn.Module, x: torch.Tensor, mask: object) -> torch.Tensor:
    """open_clip's ResidualAttentionBlock: only its attention sublayer (the block adds LayerNorm, MLP, residual)."""
    return m.attention(x, attn_mask=mask)


# timm's eager path fills masked scores with -inf: a query row with no visible key gives NaN (its fused SDPA path
# gives 0 there). True of the module, so not a false alarm.
_EAGER_TIMM_NAN = frozenset({"nan-on-masked-row"})

_CORRECT = [
    # -- hand-written, in the styles of well-known public code bases
    Entry("gpt-config-causal", "hand-written", "tests/corpus_gpt.py:CausalSelfAttention",
          note="cls(config) with GPTConfig in the same file, causal `bias` buffer; no options"),
    Entry("swin-window", "hand-written", "tests/corpus_modules.py:WindowAttention",
          options={"init": {"dim": E, "window_size": [7, 7], "num_heads": H}, "length": 49},
          note="runs only at N = 49 tokens; relative-position bias table"),
    Entry("post-norm-encoder", "hand-written", "tests/corpus_modules.py:PostNormEncoderBlock",
          lambda cls: cls(E, H), note="LayerNorm(x + attention(x)) inside"),
    Entry("no-projection", "hand-written", "tests/corpus_modules.py:NoProjectionAttention",
          lambda cls: cls(E, H), note="q = k = v = slices of x, einsum"),
    Entry("qk-norm", "hand-written", "tests/corpus_modules.py:QKNormAttention", lambda cls: cls(E, H),
          note="RMSNorm on q and k, SDPA"),
    Entry("sliding-window-causal", "hand-written", "tests/corpus_modules.py:SlidingWindowCausalAttention",
          lambda cls: cls(E, H), note="causal, window of 4 keys built in"),
    Entry("kv-cache-32-rows", "hand-written", "tests/corpus_modules.py:KVCacheAttention",
          options={"init": {"embed_dim": E, "num_heads": H}}, note="cache allocated for at most 32 batch rows"),
    Entry("required-mask", "hand-written", "tests/corpus_modules.py:RequiredMaskAttention",
          lambda cls: cls(E, H), note="forward(x, mask) without a default"),
    Entry("float64", "hand-written", "tests/corpus_modules.py:Float64Attention", lambda cls: cls(E, H)),
    Entry("bfloat16", "hand-written", "tests/corpus_modules.py:BFloat16Attention", lambda cls: cls(E, H)),
    # -- timm
    Entry("timm", "timm", "timm.models.vision_transformer:Attention", _timm()),
    Entry("timm-eager", "timm", "timm.models.vision_transformer:Attention", _timm(fused=False),
          note="fused_attn = False", known=_EAGER_TIMM_NAN),
    Entry("timm-qk-norm", "timm", "timm.models.vision_transformer:Attention", _timm(qk_norm=True)),
    Entry("timm-qk-norm-eager", "timm", "timm.models.vision_transformer:Attention", _timm(qk_norm=True, fused=False),
          known=_EAGER_TIMM_NAN),
    # -- x-transformers
    Entry("x-transformers", "x-transformers", "x_transformers.x_transformers:Attention",
          lambda cls: cls(E, dim_head=E // H, heads=H)),
    Entry("x-transformers-causal", "x-transformers", "x_transformers.x_transformers:Attention",
          lambda cls: cls(E, dim_head=E // H, heads=H, causal=True)),
    Entry("x-transformers-qk-norm", "x-transformers", "x_transformers.x_transformers:Attention",
          lambda cls: cls(E, dim_head=E // H, heads=H, qk_norm=True)),
    Entry("x-transformers-key-mask", "x-transformers", "x_transformers.x_transformers:Attention",
          lambda cls: cls(E, dim_head=E // H, heads=H), {"mask": "keep (B,L)"},
          note="(B, L) bool key mask stated; padded query rows are zeroed"),
    Entry("x-transformers-attend", "x-transformers", "x_transformers.attend:Attend",
          _with_part("x_transformers.x_transformers:Attention", "attend",
                     lambda cls: cls(E, dim_head=E // H, heads=H, causal=True)),
          note="causal Attention; the Attend core it calls is the class mutated"),
    # -- vit-pytorch
    Entry("vit-pytorch", "vit-pytorch", "vit_pytorch.vit:Attention", lambda cls: cls(E, heads=H, dim_head=E // H),
          note="LayerNorm before the projections"),
    Entry("vit-pytorch-simple", "vit-pytorch", "vit_pytorch.simple_vit:Attention",
          lambda cls: cls(E, heads=H, dim_head=E // H)),
    # -- diffusers
    Entry("diffusers", "diffusers", "diffusers.models.attention_processor:Attention", _diffusers(),
          note="default processor (SDPA)"),
    Entry("diffusers-eager", "diffusers", "diffusers.models.attention_processor:AttnProcessor",
          _diffusers_processor, note="Attention with the eager AttnProcessor (baddbmm scores); the processor "
                                     "class is the one mutated"),
    Entry("diffusers-sdpa-processor", "diffusers", "diffusers.models.attention_processor:AttnProcessor2_0",
          _diffusers_processor, note="Attention with AttnProcessor2_0; the processor class is the one mutated"),
    Entry("diffusers-cross-on-self", "diffusers", "diffusers.models.attention_processor:Attention",
          _diffusers(cross=True), {"call": _cross_self},
          note="cross-attention module (cross_attention_dim = E) called with encoder_hidden_states=x"),
    # -- open_clip
    Entry("open_clip", "open_clip", "open_clip.transformer:Attention", lambda cls: cls(E, H)),
    Entry("open_clip-block-attention", "open_clip", "open_clip.transformer:ResidualAttentionBlock",
          lambda cls: cls(E, H), {"call": _block_attention},
          note="call = block.attention(x, attn_mask=mask): LayerNorm and MLP of the block unused"),
    # -- torch
    Entry("torch-mha-batch-first", "torch", "torch.nn.modules.activation:MultiheadAttention",
          lambda cls: cls(E, H, batch_first=True)),
    Entry("torch-mha-seq-first", "torch", "torch.nn.modules.activation:MultiheadAttention",
          lambda cls: cls(E, H), note="default layout (L, B, E)"),
]

_BUGGY = [
    Entry("mask-dropped-in-half", "hand-written", "tests/corpus_buggy.py:MaskDroppedInHalf", lambda cls: cls(E, H),
          finding="half-precision-mismatch", note="float16/bfloat16 skip the mask"),
    Entry("backward-15-percent-off", "hand-written", "tests/corpus_buggy.py:WrongBackward", lambda cls: cls(E, H),
          finding="wrong-gradient", note="custom autograd.Function, backward x 0.85"),
    Entry("pre-norm-scale-by-dim", "hand-written", "tests/corpus_buggy.py:PreNormWrongScale",
          lambda cls: cls(E, heads=H, dim_head=E // H), finding="wrong-scale",
          note="LayerNorm before projections, dim ** -0.5"),
    Entry("no-projection-scale-by-ch", "hand-written", "tests/corpus_buggy.py:NoProjectionScaleByCh",
          lambda cls: cls(E, H), finding="wrong-scale", note="q = k = v = slices of x, 1/ch"),
    Entry("key-mask-transposed", "hand-written", "tests/corpus_buggy.py:KeyMaskTransposed", lambda cls: cls(E, H),
          finding="mask-broadcast", note="(B, 1, L, L) right, (B, 1, 1, L) put on the query axis"),
]

CORPUS: dict[str, Entry] = {e.name: e for e in _CORRECT + _BUGGY}
CORRECT = [e.name for e in _CORRECT]
BUGGY = [e.name for e in _BUGGY]
LIBRARIES = sorted({e.library for e in _CORRECT})

if __name__ == "__main__":  # a quick look: python tests/doctor_corpus.py [name ...]
    for name in sys.argv[1:] or CORPUS:
        try:
            r = check_entry(CORPUS[name])
            print(f"{name}: {'certified' if r.passed else sorted(r.ids)}")
        except Exception as err:  # a look at every entry, whatever fails
            print(f"{name}: {type(err).__name__}: {str(err)[:200]}")

"""How one call of the user's module is made, and its mask convention spoken.

A :class:`Caller` knows how the module is called (forward(x), forward(q, k, v) or the user's
adapter; a positional or keyword mask, required or optional, or a causal switch such as
``is_causal``; batch-first or sequence-first input; a tensor, tuple or dict output). A
:class:`MaskSpec` says how the module wants its mask: which shape and which kind of values.
Building the module is :mod:`.building`'s job; which call style, mask and sizes a module
has is found by :mod:`.calling`.

Shape legend: B batch, H heads, L length, E embed dim.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .._seams import untraced
from .building import param_device, param_dtype

__all__ = [
    "ARITY",
    "LENGTH_NAMES",
    "MASK_KINDS",
    "MASK_NAMES",
    "MASK_SHAPES",
    "SWITCH_NAMES",
    "UNSET",
    "Caller",
    "MaskSpec",
    "MaskWatch",
    "dependency",
    "find_call_style",
    "forward_signature",
    "mask_parameters",
    "module_state",
    "named_like_mask",
    "parse_mask",
    "restore",
    "switch_parameter",
    "takes_two_sequences",
    "tensors_in",
    "token_grids",
]

ARITY = {"x": 1, "qk": 2, "qkv": 3}  # how many times a call style passes the input: forward(x), (x, x), (x, x, x)
MASK_SHAPES: dict[str, str] = {"BLL": "(B, L, L)", "B1LL": "(B, 1, L, L)", "BL": "(B, L)", "B1L": "(B, 1, L)",
                               "B11L": "(B, 1, 1, L)", "B1L1": "(B, 1, L, 1)",
                               "LL": "(L, L)", "LLB": "(L, L, B)", "LLB1": "(L, L, B, 1)", "LL1": "(L, L, 1)",
                               "B": "(B,)"}
# (L, L, B), (L, L, B, 1) and (L, L, 1): sequence-first modules' masks (Transformer-XL's (Lq, Lk, B) or (Lq, Lk, 1),
# XLNet's (Lq, Lk, B, 1) with a heads axis to broadcast), tried
# only on them; batch-first (B, L, L) and (B, 1, L, L) are not tried there (a module that reads neither is right)
# kind -> how it reads: the values the doctor sends for "may attend" / "hidden"
MASK_KINDS: dict[str, str] = {
    "keep": "bool, True = may attend",
    "ignore": "bool, True = masked",
    "keep-int": "integer 1 = may attend, 0 = masked",
    "keep-float": "float 1.0 = may attend, 0.0 = masked",
    "additive": "additive float, 0 = may attend, large negative (-inf, -10000, finfo.min) = masked",
    "lengths": "integer lengths: item b may attend to its first lengths[b] keys, the rest is padding",
}
# lengths (B,) are the one kind of shape (B,), and the one form of a forward argument named like lengths (d2l's
# valid_lens, ESPnet's ilens): they can say only "the last keys of each item are padding"
ADDITIVE_FILL = -10000.0  # what the doctor puts in an additive mask for "masked"
MASK_NAMES = ("mask", "attn_mask", "attention_mask", "key_padding_mask", "padding_mask", "src_mask", "masks",
              "input_mask", "pad_mask", "src_key_padding_mask", "key_mask", "attn_masks", "seq_mask",
              # the keys' padding of a cross-attention (BLIP-2's, Flamingo's, Perceiver's), checked with kv = x
              "encoder_attention_mask", "encoder_mask", "context_mask", "kv_mask", "media_mask", "image_mask")
_NOT_A_KEY_MASK = frozenset({"head", "heads", "ratio", "token", "value", "fill", "prob", "rate", "id", "ids", "index",
                             "indices", "pos", "type", "scale"})


def named_like_mask(name: str | None) -> bool:
    """Is ``name`` a mask's: one of :data:`MASK_NAMES`, or a name with the word ``mask`` among its words and none
    that says it is something else (``memory_mask``, ``enc_mask``, ``cross_attn_mask``, ``encoder_padding_mask``;
    not ``head_mask``, ``mask_ratio``, ``mask_token``)?"""
    if name is None:
        return False
    words = name.lower().split("_")
    return name in MASK_NAMES or (("mask" in words or "masks" in words) and not _NOT_A_KEY_MASK & set(words))


LENGTH_NAMES = ("lengths", "lens", "seq_lens", "seq_lengths", "seqlens", "input_lengths", "src_lengths",
                "key_lengths", "ilens", "x_lens", "valid_lengths", "valid_lens", "text_lengths", "audio_lengths")
"""Names of a forward argument that gives padding as each item's length (speech and text toolkits)."""
# bool arguments that switch a causal mask on (SDPA's is_causal and its cousins)
SWITCH_NAMES = ("is_causal", "causal", "use_causal_mask", "causal_attention")


@dataclass(frozen=True)
class MaskSpec:
    """How a module takes its mask: ``kind`` (a key of :data:`MASK_KINDS`) and ``shape`` (of :data:`MASK_SHAPES`)."""

    kind: str
    shape: str

    @property
    def key_only(self) -> bool:
        """True for (B, L), (B, 1, L), (B, 1, 1, L) and (B, 1, L, 1) masks: one flag per key, the same for every
        query (a column (B, 1, L, 1) is a module's that turns it into a row itself)."""
        return self.shape in ("BL", "B1L", "B11L", "B1L1", "B")

    def describe(self) -> str:
        """E.g. "additive float, 0 = may attend, ... of shape (B, 1, 1, L)"."""
        return f"{MASK_KINDS[self.kind]}, shape {MASK_SHAPES[self.shape]}"

    def encode(self, keep: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Turn a keep-mask into this module's mask.

        Args:
            keep: (B, L, L) bool, True = may attend; for key-only shapes it must be the same for every query.
            dtype: the module's float dtype (float masks are made in it).

        Returns:
            The mask in the module's kind and shape.
        """
        if self.key_only:
            if not torch.equal(keep, keep[:, :1].expand_as(keep)):
                raise ValueError("a key-only mask (B, L), (B, 1, L), (B, 1, 1, L) or (B, 1, L, 1) cannot express a "
                                 "per-query mask")
            keep = keep[:, :1]  # (B, 1, L)
        if (self.kind == "lengths") != (self.shape == "B"):
            raise ValueError("lengths are given as shape (B,), and shape (B,) holds lengths only")
        m: Tensor
        if self.kind == "lengths":
            counts = keep[:, 0].sum(-1)
            if not torch.equal(keep[:, 0], torch.arange(keep.shape[-1], device=keep.device)[None, :] < counts[:, None]):
                raise ValueError("lengths can only hide the last keys of each item (padding at the end)")
            return counts
        if self.kind == "keep":
            m = keep
        elif self.kind == "ignore":
            m = ~keep
        elif self.kind == "keep-int":
            m = keep.long()
        elif self.kind == "keep-float":
            m = keep.to(dtype)
        else:  # -10000: exp underflows to 0 in every float dtype, and a weight added after softmax stays finite
            m = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, ADDITIVE_FILL)
        return {"LL": lambda: m[0], "BLL": lambda: m, "B1LL": lambda: m[:, None], "BL": lambda: m[:, 0],
                "B1L": lambda: m,
                "B11L": lambda: m[:, None], "B1L1": lambda: m[:, None].transpose(-1, -2),
                "LLB": lambda: m.permute(1, 2, 0),
                "LLB1": lambda: m.permute(1, 2, 0)[..., None], "LL1": lambda: m[0, :, :, None]}[self.shape]()


def parse_mask(text: str) -> MaskSpec:
    """``"additive (B,1,1,L)"``, ``"keep (B,L)"``, ``"ignore (L, L)"`` -> a :class:`MaskSpec`.

    Kinds: keep, ignore, keep-int, keep-float, additive, and lengths (shape (B,) only). Shapes: (L,L), (B,L,L),
    (B,1,L,L), (B,1,1,L), (B,L), (B,1,L) (ESPnet's and WeNet's key mask), (B,1,L,1) (the keys' padding as a column
    the module turns into a row), and for sequence-first modules (L,L,B), (L,L,B,1) and (L,L,1).
    """
    match = re.fullmatch(r"\s*([a-z-]+)\s*\(([^)]*)\)\s*", text)
    shape = "".join(match.group(2).replace(",", " ").split()) if match else ""
    if not match or match.group(1) not in MASK_KINDS or shape not in MASK_SHAPES or \
            (match.group(1) == "lengths") != (shape == "B"):
        raise ValueError(f"mask must read 'KIND (SHAPE)' with KIND one of {', '.join(MASK_KINDS)} and SHAPE one of "
                         f"{', '.join(MASK_SHAPES.values())} (lengths: (B,) only); got {text!r} (e.g. 'additive "
                         "(B,1,1,L)')")
    return MaskSpec(match.group(1), shape)


def _output(out: object, like: Tensor | None = None) -> Tensor:
    """The module's output tensor: the tensor itself, or among a dict's values (a tuple's items) the first of the
    input's shape (``like``: {"attn_weights": w, "hidden_states": o} gives o), else the first tensor."""
    if isinstance(out, dict):
        tensors = [v for v in out.values() if isinstance(v, Tensor)]
        out = next((t for t in tensors if like is not None and t.shape == like.shape), tensors[0] if tensors else out)
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"the module returned {type(out).__name__}, not a tensor, a tuple or a dict of tensors")
    return out


def grid(length: int) -> tuple[int, int]:
    """(H, W) of an image of ``length`` tokens: H the largest divisor of ``length`` up to its square root."""
    h = max(d for d in range(1, int(length ** 0.5) + 1) if length % d == 0)
    return h, length // h


def token_grids(length: int) -> list[tuple[int, ...]]:
    """The shapes ``length`` tokens may be laid out on, row-major: the line, then every grid of two sides (the square
    first) and of three (a volume: pressure levels x latitude x longitude, frames x height x width), each side >= 2."""
    side = int(length ** 0.5)
    grids: list[tuple[int, ...]] = [(length,)] + ([(side, side)] if side * side == length and side >= 2 else [])
    grids += [(a, length // a) for a in range(2, length // 2 + 1) if length % a == 0 and a * a != length]
    for a in range(2, length // 4 + 1):
        grids += [(a, b, length // (a * b)) for b in range(2, length // (2 * a) + 1)
                  if length % (a * b) == 0 and length // (a * b) >= 2]
    return grids


def to_layout(x: Tensor, layout: str) -> Tensor:
    """The probes' (B, L, E) input in the module's layout (see :class:`Caller`)."""
    if layout == "sequence-first":
        return x.transpose(0, 1)
    if layout == "channels-first-1d":
        return x.transpose(1, 2)
    if layout in ("channels-first", "channels-last"):
        b, n, e = x.shape
        image = x.reshape(b, *grid(n), e)
        # in the memory format users pass, contiguous (B, E, H, W): a channels-last-strided input makes some of
        # torch's CPU backward kernels crash (a GroupNorm image block's backward segfaults in torch 2.13)
        return image.permute(0, 3, 1, 2).contiguous() if layout == "channels-first" else image
    if layout == "grouped":
        return x.unsqueeze(1)
    return x


def from_layout(y: Tensor, layout: str) -> Tensor:
    """The module's output in the probes' (B, L, E) layout; an output of another rank is returned as it is."""
    if layout == "sequence-first" and y.dim() >= 2:
        return y.transpose(0, 1)
    if layout == "channels-first-1d" and y.dim() == 3:
        return y.transpose(1, 2)
    if layout == "channels-first" and y.dim() == 4:
        return y.flatten(2).transpose(1, 2)
    if layout == "channels-last" and y.dim() == 4:
        return y.flatten(1, 2)
    if layout == "grouped" and y.dim() == 4 and y.shape[1] == 1:
        return y.squeeze(1)
    return y


def _arity(fn: Callable) -> int:
    """How many positional arguments ``fn`` takes (3 when it takes *args or cannot be inspected)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 3
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


@dataclass
class Caller:
    """How to call the module: style 'x' (forward(x, ...)), 'qkv' (forward(q, k, v, ...)) or 'adapter'.

    ``mask_arg`` is the keyword the mask goes to (None: the next positional argument); ``spec`` how
    a keep-mask is encoded for it; ``adapter(module, x[, mask])`` and ``make_mask(keep)`` replace
    both when the user gives them. ``required``: forward has no default for its mask, so a call
    without one sends the mask that hides nothing. ``switch``: the mask is a bool argument that
    turns a causal mask on (``is_causal``). ``base``: the (L, L) pattern the module applies when it
    gets no mask and that a mask replaces (``is_causal=mask is None``), kept in every mask sent.
    ``layout``: "batch-first" (B, L, E), "sequence-first" (L, B, E), "channels-first-1d" (B, E, L),
    "grouped" (B, 1, L, E): one group of L tokens (MaxViT's (B, G, P, E) partitions), or an image of
    L = H x W tokens, "channels-first" (B, E, H, W) or "channels-last" (B, H, W, E) (H the largest
    divisor of L up to its square root); the probes always speak (B, L, E) and the caller converts
    both ways.
    """

    module: nn.Module
    style: str
    mask_arg: str | None = None
    spec: MaskSpec | None = None
    adapter: Callable | None = None
    make_mask: Callable[[Tensor], Tensor] | None = None
    notes: list[str] = field(default_factory=list)
    required: bool = False
    switch: str | None = None
    layout: str = "batch-first"
    base: Tensor | None = None  # (L, L): the pattern the module applies without a mask, which a mask replaces
    mutated: set[str] = field(default_factory=set)  # what the module changed in place (shared by every copy)
    # the module's own state a call replaced, restored after it: name -> (before, after) (shared by every copy)
    replaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    keep_state: bool = False  # leave what a call replaces in the module as the call left it
    unmatched: bool = False  # the mask acts, but its effect matched no convention: its polarity is not known
    # the tensors the last call returned beside the output read (a layer's (out, agent_out)): what a parameter may
    # feed instead of the output
    others: list[Tensor] = field(default_factory=list, repr=False)

    def __call__(self, x: Tensor, mask: object = None) -> Tensor:
        made_here = mask is None and self.required
        if made_here:
            mask = self.module_mask(torch.ones(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool))
        given = to_layout(x, self.layout)
        # The module may change its input in place: it gets a copy (recorded by a trace, so that what the module
        # computes still comes from x). The mask goes as it is, since probes watch it by identity (module_mask
        # made it a tensor of its own), and is restored after the call.
        # The module may also replace its own buffers and attributes (self.mask = self.mask[:L, :L], a cache
        # grown by torch.cat): what a call replaced is put back after it, so that every probe's call meets the
        # module as it was given; whether calls in a row still agree is the state probe's question.
        t = given.clone()
        with untraced():
            kept = mask.detach().clone() if isinstance(mask, Tensor) else None
            state = None if self.keep_state else module_state(self.module)
        try:
            if t.dtype == torch.float64:  # the float64 copy of a module that builds float32 masks
                with _MasksInQueryDtype():
                    out = self._call(t, mask)
            else:
                out = self._call(t, mask)
        finally:
            with untraced(), torch.no_grad():
                if state is not None:
                    restore(state, self.replaced)
                if kept is not None and isinstance(mask, Tensor) and _changed(mask, kept):
                    self.mutated.add("its mask argument")
                    # data and shape (mask.unsqueeze_(1) changes the caller's tensor too); a mask made for this
                    # call alone is not put back: autograd saved it as it was left, for the backward
                    if not made_here:
                        mask.set_(kept.untyped_storage(), kept.storage_offset(), kept.size(), kept.stride())
        with untraced():
            if _changed(t, given):
                self.mutated.add("its input")
        return out

    def _call(self, t: Tensor, mask: object) -> Tensor:
        try:
            return self._call_once(t, mask)
        except RuntimeError as err:  # a module that needs autograd on (a hook registered on its attention map, as
            if torch.is_grad_enabled() or not any(s in str(err) for s in _NEEDS_GRAD):  # relevance propagation's
                raise  # save the map's gradient): the probes' calls without gradients go with it, output detached
        with torch.enable_grad():
            return self._call_once(t, mask).detach()

    def _call_once(self, t: Tensor, mask: object) -> Tensor:
        if self.adapter is not None:
            out = self.adapter(self.module, t) if not self.takes_mask else self.adapter(self.module, t, mask)
        else:
            args = (t,) * ARITY[self.style]
            if mask is None:
                out = self.module(*args)
            elif self.switch is not None:
                out = self.module(*args, **{self.switch: mask})
            elif self.mask_arg is None:
                out = self.module(*args, mask)
            else:
                out = self.module(*args, **{self.mask_arg: mask})
        picked = _output(out, t)
        self.others = [v for v in tree_leaves(out) if isinstance(v, Tensor) and v is not picked and
                       v.is_floating_point()] if isinstance(out, (tuple, list, dict)) else []
        return from_layout(picked, self.layout)

    @property
    def takes_mask(self) -> bool:
        """False for a two-argument adapter ``call(module, x)``: the user says the module has no mask."""
        return self.adapter is None or _arity(self.adapter) >= 3

    def with_mask(self, spec: MaskSpec | None, mask_arg: str | None = None) -> Caller:
        """This caller, passing masks encoded by ``spec`` to ``mask_arg``."""
        return replace(self, mask_arg=mask_arg if mask_arg is not None else self.mask_arg, spec=spec, switch=None,
                       notes=[])

    def for_module(self, module: nn.Module) -> Caller:
        """This caller on another module (e.g. a float16 copy)."""
        return replace(self, module=module, notes=[])

    @property
    def key_only(self) -> bool:
        """The module's mask can only hide keys (the same for every query)."""
        return self.spec is not None and self.spec.key_only

    @property
    def at_end(self) -> bool:
        """The module's mask is lengths: it can only hide the last keys of each item."""
        return self.spec is not None and self.spec.kind == "lengths"

    def module_mask(self, keep: Tensor, dtype: torch.dtype | None = None) -> object:
        """Turn a keep-mask (B, L, L) (True = may attend) into what this module takes.

        Float masks are made in ``dtype`` (default: the module's parameter dtype), on the module's device.
        A causal switch can only say "causal" (True) or "nothing hidden" (False); other masks raise ValueError.
        """
        device = param_device(self.module)
        if self.base is not None and not self.key_only and self.switch is None and keep.shape[-2:] == self.base.shape:
            keep = keep & self.base.to(keep.device)  # a module whose mask replaces its own (causal) pattern
        if self.switch is not None:
            length = keep.shape[-1]
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            if torch.equal(keep, causal.expand_as(keep)):
                return True
            if keep.all():
                return False
            raise ValueError(f"a causal switch ({self.switch}) cannot express this mask")
        if self.make_mask is not None:
            m = self.make_mask((keep[:, 0] if self.key_only else keep).to(device))
            if isinstance(m, Tensor) and m.is_floating_point():  # a float mask made in float32 goes in the
                m = m.to(device=device, dtype=dtype or param_dtype(self.module))  # probe's dtype, as encoded ones do
            return _own(m)
        if self.spec is None:
            raise ValueError("this caller passes no mask")
        return _own(self.spec.encode(keep, dtype or param_dtype(self.module)).to(device))


def _mask_like(p: inspect.Parameter) -> bool:
    """Could ``p`` take a mask tensor: no default, or a None default (not a flag, a number or a string)?"""
    return p.kind != p.VAR_KEYWORD and (p.default is p.empty or p.default is None)


def mask_parameters(module: nn.Module, style: str) -> list[str | None]:
    """The forward parameters a mask may go to: mask-like keywords in signature order, else the next
    positional parameter that could take a tensor (by name), or None (positional, for ``*args``)."""
    try:
        params = list(forward_signature(module).parameters.values())
    except (TypeError, ValueError):
        return [None]
    named: list[str | None] = [p.name for p in params if named_like_mask(p.name) and p.kind != p.POSITIONAL_ONLY
                               and not takes_block_mask(p)]
    if named:
        return named
    if any(takes_block_mask(p) for p in params):  # FlexAttention's BlockMask only: no tensor mask to send
        return []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = positional[ARITY.get(style, 3):]
    if rest and rest[0].kind == rest[0].POSITIONAL_OR_KEYWORD and _mask_like(rest[0]) and \
            rest[0].name not in SWITCH_NAMES:
        return [rest[0].name]
    if rest and rest[0].kind == rest[0].POSITIONAL_ONLY and _mask_like(rest[0]):
        return [None]
    return [None] if any(p.kind == p.VAR_POSITIONAL for p in params) else []


def takes_block_mask(param: inspect.Parameter) -> bool:
    """Does a forward parameter take FlexAttention's ``BlockMask`` (annotated so, or named for a block or flex mask),
    not a tensor mask?"""
    annotation = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
    return "BlockMask" in str(annotation) or block_mask_named(param.name)


def block_mask_named(name: str) -> bool:
    """Is ``name`` a parameter's named for FlexAttention's block mask (``block_mask``, ``sliding_window_flex_mask``)?"""
    return "block_mask" in name.lower() or "flex_mask" in name.lower()


def block_mask_parameters(module: nn.Module) -> list[str]:
    """The forward parameters that take FlexAttention's ``BlockMask``."""
    try:
        return [p.name for p in forward_signature(module).parameters.values() if takes_block_mask(p)]
    except (TypeError, ValueError):
        return []


def switch_parameter(module: nn.Module) -> str | None:
    """The name of a bool causal switch of forward (``is_causal=False`` and the like: a parameter named for
    causality whose default is a bool, as Stable Diffusion's ``causal_mask=False``), or None."""
    try:
        params = forward_signature(module).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if (p.name in SWITCH_NAMES or "causal" in p.name.lower()) and
                 isinstance(p.default, bool)), None)


def required_mask_parameter(module: nn.Module, style: str, any_name: bool = False) -> str | None:
    """The mask-like forward parameter with no default (the module cannot run without it), or None. ``any_name``:
    the one parameter with no default, whatever its name (the user stated a mask: a graph's ``adj``)."""
    try:
        params = list(forward_signature(module).parameters.values())
    except (TypeError, ValueError):
        return None
    skip = ARITY.get(style, 3)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][skip:]
    required = [p for p in positional + [p for p in params if p.kind == p.KEYWORD_ONLY]
                if p.default is p.empty]
    if len(required) == 1 and (any_name or named_like_mask(required[0].name) or required[0].name in LENGTH_NAMES or
                               "mask" in required[0].name.lower()):
        return required[0].name
    return None


def takes_two_sequences(module: nn.Module) -> bool:
    """Does forward take the queries' and the keys' sequences as its first two arguments, and no values
    (OpenFold's ``forward(q_x, kv_x, biases=None)``; torchtune's ``forward(x, y=None, *, mask=None)``, whose
    self-attention without a cache needs y too)?"""
    try:
        params = [p for p in forward_signature(module).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    # a third required argument only when it is the keys' mask (``forward(x, context, context_mask)``)
    if len(params) < 2 or params[0].default is not params[0].empty or \
            (len(params) > 2 and params[2].default is params[2].empty and not named_like_mask(params[2].name)) or \
            any(p.default is p.empty for p in params[3:]):
        return False
    second = params[1].name.lower()
    if second.startswith(("kv", "key", "k_", "context", "memory", "source")) or second.endswith("kv") or \
            second in ("k", "y", "x2"):
        return True
    # any other second sequence both required (BLIP-2's ``forward(hidden_states, encoder_hidden_states)``,
    # Flamingo's ``forward(latents, x)`` and ``forward(x, media, media_locations=None)``), unless its name says it is
    # something else the module needs: a mask, lengths, positions, a rotary table, a cache, a time step
    return params[1].default is params[1].empty and not named_like_mask(second) and second not in LENGTH_NAMES and \
        second not in ("t", "h", "w") and not any(w in second for w in _NOT_A_SEQUENCE)


def _third_is_a_mask(module: nn.Module) -> bool:
    """Is forward's third positional parameter named like a mask?"""
    try:
        params = [p for p in forward_signature(module).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) > 2 and named_like_mask(params[2].name)


_NOT_A_SEQUENCE = ("mask", "len", "pos", "freq", "rope", "rotary", "cos", "sin", "cache", "time", "step", "bias",
                   "index", "idx", "ids", "shape", "size", "hw", "grid", "rel", "pad", "valid")


def find_call_style(module: nn.Module, x: Tensor, layout: str = "batch-first") -> tuple[str, str | None]:
    """('x', 'qk' or 'qkv', None) if the module runs on x (sent in ``layout``); ("", the errors) otherwise."""
    errors = []
    styles: tuple[str, ...] = ("x", "qk", "qkv") if takes_two_sequences(module) else ("x", "qkv")
    if _third_is_a_mask(module):  # forward(x, context, context_mask): a value sent there would be read as a mask
        styles = tuple(s for s in styles if s != "qkv")
    for style in styles:
        try:
            with torch.no_grad():
                out = Caller(module, style, layout=layout)(x)
            if style == "qk" and isinstance(out, Tensor) and out.shape != x.shape:  # the second argument is no
                raise ValueError(f"forward(q, kv) gave {tuple(out.shape)} for {tuple(x.shape)}")  # sequence (a DiT
            return style, None  # block's conditioning, broadcast over the tokens)
        except Exception as e:
            errors.append(f"forward({', '.join(('x',) if style == 'x' else style)}): {type(e).__name__}: {e}")
    return "", "; ".join(errors)


def _own(mask: object) -> object:
    """A mask tensor with storage of its own (not a view of the keep-mask it was made from, nor expanded), so that a
    module that writes into its mask in place changes nothing the doctor holds."""
    return mask.clone(memory_format=torch.contiguous_format) if isinstance(mask, Tensor) else mask


def forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature of ``module.forward``; a compiled module's (``torch.compile``, whose forward takes ``*args,
    **kwargs``) is the one of the module it compiled, so that its arguments keep their names."""
    inner = getattr(module, "_orig_mod", None)
    return inspect.signature((inner if isinstance(inner, nn.Module) else module).forward)


_MODULE_OWN = frozenset(vars(nn.Module()))  # nn.Module's bookkeeping: parameters, submodules, hooks, training


# packages whose objects a module holds as configuration or tooling, not as state of its own
_NOT_STATE = frozenset({"builtins", "torch", "keras", "transformers", "numpy", "typing", "enum", "functools"})


def _holder(value: object) -> bool:
    """Is ``value`` a plain object of the user's that a module keeps state in (a KV cache object whose ``keys`` are
    replaced by ``torch.cat``, rather than the module's own attributes)?"""
    return hasattr(value, "__dict__") and not isinstance(value, (nn.Module, Tensor, type)) and \
        not callable(value) and type(value).__module__.split(".")[0] not in _NOT_STATE


def _contents(m: object) -> dict:
    """What ``m`` holds, by key: a list's items by index, a dict's by key, else the object's own attributes."""
    if isinstance(m, list):
        return dict(enumerate(m))
    if isinstance(m, dict):
        return dict(m)
    return {k: v for k, v in vars(m).items() if k not in _MODULE_OWN}


def _held(state: list[tuple[str, object, dict, dict]], name: str, value: object, depth: int) -> None:
    """Add to ``state`` a plain object of the user's or a list or dict a module holds (a cache object, a dict of
    keys and values, a list appended to), and what those hold in turn, ``depth`` levels down."""
    if depth == 0 or not (_holder(value) or (isinstance(value, (list, dict)) and len(value) <= 1024)):
        return
    contents = _contents(value)
    state.append((name, value, contents, {}))
    for key, inner in contents.items():
        _held(state, f"{name}.{key}", inner, depth - 1)


def module_state(module: nn.Module) -> list[tuple[str, object, dict, dict]]:
    """Each submodule's own attributes and buffers, and what the plain objects of the user's, lists and dicts that a
    submodule holds (a cache) hold, by identity (nothing is copied)."""
    state: list[tuple[str, object, dict, dict]] = []
    for name, m in module.named_modules():
        attrs = _contents(m)
        state.append((name, m, attrs, dict(m._buffers)))
        for key, value in attrs.items():
            _held(state, f"{name}.{key}" if name else key, value, 2)
    return state


def tensors_in(value: object) -> list[Tensor]:
    """``value`` if it is a tensor, the tensors of a tuple or list of them (an appended (keys, values) pair), else
    none."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def _holds_tensors(value: object) -> bool:
    """Is ``value`` an object that keeps tensors in its attributes (a mask cached in a namespace, FlexAttention's
    ``BlockMask`` built on a first call), or a dict that holds tensors?"""
    if isinstance(value, dict):  # a dict of cached tensors made on the first call
        return any(isinstance(v, Tensor) for v in value.values())
    return hasattr(value, "__dict__") and not isinstance(value, (nn.Module, Tensor, type)) and \
        any(isinstance(v, Tensor) for v in vars(value).values())


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor {tuple(value.shape)}"
    if tensors := tensors_in(value):
        return f"{type(value).__name__} of tensors {', '.join(str(tuple(t.shape)) for t in tensors)}"[:80]
    if _holds_tensors(value):
        items = value.items() if isinstance(value, dict) else vars(value).items()
        held = [f"{k} {tuple(v.shape)}" for k, v in items if isinstance(v, Tensor)]
        return f"a {type(value).__name__} holding {', '.join(held)}"[:80]
    return "unset" if value is UNSET else repr(value)[:40]


UNSET = object()
# what torch says when a module needs autograd on: a hook on a tensor, autograd.grad inside the forward
_NEEDS_GRAD = ("doesn't require gradient", "does not require grad")


def restore(state: list[tuple[str, object, dict, dict]],
            replaced: dict[str, tuple[str, str]] | None = None) -> list[tuple[str, object, object]]:
    """Put back every attribute and buffer replaced, added or removed since ``state`` was taken; record in
    ``replaced`` those that were tensors or numbers (a cache's length), by their dotted name. Returns them as
    (name, before, after) (``UNSET``: not there)."""
    changes = []
    for prefix, m, attrs, buffers in state:
        now_attrs = _contents(m)
        held = getattr(m, "_buffers", {}) if isinstance(m, nn.Module) else {}
        container = isinstance(m, (list, dict))
        if container and any(attrs.get(k, UNSET) is not now_attrs.get(k, UNSET) for k in attrs.keys() | now_attrs):
            if isinstance(m, list):  # items appended or replaced in place: the list as it was
                m[:] = list(attrs.values())
            elif isinstance(m, dict):
                m.clear()
                m.update(attrs)
        for before, now, target in ((attrs, now_attrs, None if container else m.__dict__), (buffers, dict(held), held)):
            for key in before.keys() | now.keys():
                old, new = before.get(key, UNSET), now.get(key, UNSET)
                if old is new:
                    continue
                if target is None:  # a list or dict, put back whole above
                    pass
                elif old is UNSET:
                    del target[key]
                else:
                    target[key] = old
                if any(tensors_in(v) or _holds_tensors(v) for v in (old, new)) or (
                        all(isinstance(v, (int, float)) for v in (old, new)) and old != new):
                    name = f"{prefix}.{key}" if prefix else key
                    changes.append((name, old, new))
                    if replaced is not None:
                        replaced.setdefault(name, (_describe(old), _describe(new)))
    return changes


def _changed(now: Tensor, before: Tensor) -> bool:
    """Does ``now`` differ from ``before`` in shape or values (NaN equal to NaN)?"""
    if now.shape != before.shape:
        return True
    return not torch.equal(torch.nan_to_num(now.detach()), torch.nan_to_num(before.detach()))


class _MasksInQueryDtype(TorchFunctionMode):
    """scaled_dot_product_attention with a floating mask in the query's dtype. A module run in float64 that builds
    its additive mask in the default float32 (``torch.zeros(b, 1, 1, n)``) is correct in its own dtype, but torch's
    CPU kernel for float64 queries reads a float32 mask wrongly from 16 tokens on; the doctor's float64 copy of it
    must compute what the module computes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and isinstance(args[0], Tensor):
            at = 3 if len(args) > 3 else None
            mask = args[3] if at is not None else kwargs.get("attn_mask")
            if isinstance(mask, Tensor) and mask.is_floating_point() and mask.dtype != args[0].dtype:
                mask = mask.to(args[0].dtype)
                if at is not None:
                    args = (*args[:3], mask, *args[4:])
                else:
                    kwargs = {**kwargs, "attn_mask": mask}
        return func(*args, **kwargs)


class MaskWatch(TorchFunctionMode):
    """While active: did any torch operation read the watched tensor (``used``), and did the module (or one of its
    submodules) receive it as an argument (``reached``)? Tells a mask a module ignores from a mask that an
    adapter never passed on."""

    def __init__(self, watched: object, module: nn.Module | None = None) -> None:
        super().__init__()
        self.watched = watched if isinstance(watched, Tensor) else None
        self.module = module
        self.used = False
        self.reached = False
        self._handles: list = []

    def _holds(self, *values: object) -> bool:
        stack = list(values)
        while stack:
            a = stack.pop()
            if a is self.watched:
                return True
            if isinstance(a, (list, tuple)):
                stack.extend(a)
            elif isinstance(a, dict):
                stack.extend(a.values())
        return False

    def __enter__(self) -> MaskWatch:
        if self.module is not None and self.watched is not None:
            def seen(mod: nn.Module, args: tuple, kwargs: dict) -> None:
                self.reached = self.reached or self._holds(args, kwargs)

            self._handles = [m.register_forward_pre_hook(seen, with_kwargs=True) for m in self.module.modules()
                             if not isinstance(m, torch.jit.ScriptModule)]  # TorchScript takes no hooks
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.watched is not None and not self.used and self._holds(args, kwargs):
            self.used = True
        return func(*args, **kwargs)


def dependency(fn: Callable[[Tensor], Tensor], x: Tensor, item: int = 0, rtol: float = 1e-5, seed: int = 0) -> Tensor:
    """(L, L) bool: does output row i of batch item ``item`` change when input token j changes?

    A change counts when it exceeds ``rtol`` times the largest finite output (1 when all are 0): pick it above the
    dtype's rounding (the probes run this on a float64 copy of the module when it has one). A NaN that stays
    NaN is no change (a row with no visible key, as a causal mask that hides the diagonal makes the first one);
    a value that turns NaN or changes from NaN is one. ``seed`` varies the tokens drawn in place of each.
    """
    with torch.no_grad():
        base = fn(x)[item]
        length = x.shape[1]
        dep = torch.zeros(length, length, dtype=torch.bool)
        g = torch.Generator().manual_seed(1234 + seed)
        # relative to the output's size, however small (weights initialised at 1e-10, as BLIP's vision tower)
        size = float(base.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max()) if base.numel() else 1.0
        size = size if size > 0 else 1.0
        for j in range(length):
            x2 = x.clone()
            x2[:, j] = torch.randn(x.shape[0], x.shape[2], generator=g, dtype=x.dtype).to(x.device)
            new = fn(x2)[item]
            same = (new == base) | (new.isnan() & base.isnan())
            diff = (new - base).abs().masked_fill(same, 0).nan_to_num(float("inf")).amax(-1)  # (L,)
            dep[:, j] = (diff > rtol * size).cpu()
    return dep

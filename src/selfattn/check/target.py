"""Finding, building and calling the user's attention module, and speaking its mask convention.

It imports and runs the user's file (never writes to it: no bytecode cache is written), tries
the usual constructor signatures (or a config object, or a factory), and works out how the module
is called (positional or keyword mask, tuple or dict output, or a user-supplied adapter). A
:class:`MaskSpec` says how the module wants its mask: which shape and which kind of values.

Shape legend: B batch, H heads, L length, E embed dim.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

__all__ = [
    "MASK_KINDS",
    "MASK_NAMES",
    "MASK_SHAPES",
    "Caller",
    "CannotRun",
    "MaskSpec",
    "build",
    "dependency",
    "embed_dim_of",
    "find_call_style",
    "load_class",
    "load_file",
    "mask_parameters",
    "num_heads_of",
    "parse_mask",
    "user_callable",
]

MASK_SHAPES: dict[str, str] = {"BLL": "(B, L, L)", "B1LL": "(B, 1, L, L)", "BL": "(B, L)", "B11L": "(B, 1, 1, L)",
                               "LL": "(L, L)"}
# kind -> how it reads: the values the doctor sends for "may attend" / "hidden"
MASK_KINDS: dict[str, str] = {
    "keep": "bool, True = may attend",
    "ignore": "bool, True = masked",
    "keep-int": "integer 1 = may attend, 0 = masked",
    "keep-float": "float 1.0 = may attend, 0.0 = masked",
    "additive": "additive float, 0 = may attend, large negative (-inf, -10000, finfo.min) = masked",
}
ADDITIVE_FILL = -10000.0  # what the doctor puts in an additive mask for "masked"
MASK_NAMES = ("mask", "attn_mask", "attention_mask", "key_padding_mask", "padding_mask", "src_mask", "masks",
              "input_mask", "pad_mask")
_EMBED_KEYS = ("embed_dim", "embedding_dim", "d_model", "dim", "hidden_size", "n_embd")
_HEAD_KEYS = ("num_heads", "n_heads", "heads", "n_head", "nhead", "num_attention_heads", "h")


class CannotRun(Exception):
    """The module could not be loaded, built or called at all (exit status 2)."""


@contextlib.contextmanager
def _no_bytecode() -> Iterator[None]:
    old = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = old


def load_file(path_s: str) -> ModuleType:
    """Import ``path_s`` under a fresh name (no bytecode written, the file is not modified)."""
    path = Path(path_s)
    if not path.is_file():
        raise CannotRun(f"no such file: {path}")
    module_spec = importlib.util.spec_from_file_location(f"_selfattn_check_{uuid.uuid4().hex}", path)
    if module_spec is None or module_spec.loader is None:
        raise CannotRun(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)
    try:
        with _no_bytecode():
            module_spec.loader.exec_module(module)
    except Exception as e:
        raise CannotRun(f"importing {path} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    return module


def load_class(spec: str) -> type:
    """``path/to/file.py:ClassName`` -> the class (the file is imported, not modified)."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s or not name:
        raise CannotRun(f"expected path/to/file.py:ClassName, got {spec!r}")
    cls = getattr(load_file(path_s), name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise CannotRun(f"{path_s} has no nn.Module subclass named {name!r}")
    return cls


def user_callable(source: str, namespace: dict | None = None) -> Callable:
    """Evaluate a Python expression (``--call``, ``--factory``) with torch, nn and ``namespace`` in scope."""
    scope = {"torch": torch, "nn": nn, "F": nn.functional, "math": math, **(namespace or {})}
    try:
        fn = eval(source, scope)
    except Exception as e:
        raise CannotRun(f"cannot evaluate {source!r}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise CannotRun(f"{source!r} is a {type(fn).__name__}, not a callable")
    return fn


def _config_class(cls: type) -> type | None:
    """The configuration class a ``cls(config, ...)`` constructor wants, found next to ``cls``."""
    owner = sys.modules.get(cls.__module__)
    annotation = inspect.signature(cls.__init__).parameters["config"].annotation
    if isinstance(annotation, type) and annotation is not inspect.Parameter.empty:
        return annotation
    if owner is not None and isinstance(annotation, str):
        found = getattr(owner, annotation.split("|")[0].strip(), None)
        if isinstance(found, type):
            return found
    candidates = [v for k, v in vars(owner or {}).items() if k.endswith("Config") and isinstance(v, type)]
    return candidates[0] if len(candidates) == 1 else None


def _build_with_config(cls: type, init: dict | None, embed_dim: int) -> tuple[nn.Module, str]:
    config_cls = _config_class(cls)
    if config_cls is None:
        raise CannotRun(f"{cls.__name__}(config, ...) needs a config object and no single *Config class was found "
                        "next to it; pass --factory 'lambda: ...'")
    kwargs = init if init is not None else {"hidden_size": embed_dim, "num_attention_heads": 4,
                                            "num_key_value_heads": 4, "intermediate_size": 2 * embed_dim}
    try:
        config = config_cls(**kwargs)
        if hasattr(config, "_attn_implementation"):
            config._attn_implementation = "eager"  # the module's own math, not a fused kernel
        extra = {"layer_idx": 0} if "layer_idx" in inspect.signature(cls.__init__).parameters else {}
        return cls(config, **extra), f"{cls.__name__}({config_cls.__name__}(**{kwargs}))"
    except Exception as e:
        raise CannotRun(f"{cls.__name__}({config_cls.__name__}(**{kwargs})) failed: {type(e).__name__}: {e}; "
                        "pass --init with the config's fields or --factory 'lambda: ...'") from e


def build(cls: type, init: dict | None, embed_dim: int) -> tuple[nn.Module, str]:
    """Instantiate ``cls`` from ``init``, a config object or the usual signatures; returns (module, how)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    if "config" in params:
        return _build_with_config(cls, init, embed_dim)
    if init is not None:
        try:
            return cls(**init), f"{cls.__name__}(**{init})"
        except Exception as e:
            raise CannotRun(f"{cls.__name__}(**{init}) failed: {type(e).__name__}: {e}") from e
    e, h = embed_dim, 4
    attempts: list[tuple[tuple, dict]] = [((e,), {}), ((e, h), {})]
    for key in _EMBED_KEYS:
        attempts.append(((), {key: e}))
        for hkey in _HEAD_KEYS[:-2]:
            attempts.append(((), {key: e, hkey: h}))
    errors = []
    for args, kwargs in attempts:
        try:
            m = cls(*args, **kwargs)
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
            continue
        parts = [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]
        return m, f"{cls.__name__}({', '.join(parts)})"
    raise CannotRun(f"could not build {cls.__name__} with the usual signatures (embed_dim[, num_heads]); "
                    f"pass --init '{{...}}' or --factory. Last error: {errors[-1] if errors else 'none'}")


def _int_attr(module: nn.Module, keys: tuple[str, ...]) -> int | None:
    for owner in (module, getattr(module, "config", None)):
        for key in keys:
            v = getattr(owner, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def embed_dim_of(module: nn.Module, default: int) -> int:
    """E: from an embed-dim attribute (or the module's config), else the first nn.Linear's input size."""
    found = _int_attr(module, _EMBED_KEYS)
    if found:
        return found
    for m in module.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
    return default


def num_heads_of(module: nn.Module) -> int | None:
    """H: from a heads attribute, the module's config, or embed dim // head_dim; None if none is found."""
    found = _int_attr(module, _HEAD_KEYS)
    if found:
        return found
    head_dim, e = _int_attr(module, ("head_dim",)), _int_attr(module, _EMBED_KEYS)
    return e // head_dim if head_dim and e and e % head_dim == 0 else None


@dataclass(frozen=True)
class MaskSpec:
    """How a module takes its mask: ``kind`` (a key of :data:`MASK_KINDS`) and ``shape`` (of :data:`MASK_SHAPES`)."""

    kind: str
    shape: str

    @property
    def key_only(self) -> bool:
        """True for (B, L) and (B, 1, 1, L) masks: one flag per key, the same for every query."""
        return self.shape in ("BL", "B11L")

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
                raise ValueError("a key-only mask (B, L) or (B, 1, 1, L) cannot express a per-query mask")
            keep = keep[:, :1]  # (B, 1, L)
        m: Tensor
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
                "B11L": lambda: m[:, None]}[self.shape]()


def parse_mask(text: str) -> MaskSpec:
    """``"additive (B,1,1,L)"``, ``"keep (B,L)"``, ``"ignore (L, L)"`` -> a :class:`MaskSpec`.

    Kinds: keep, ignore, keep-int, keep-float, additive. Shapes: (L,L), (B,L,L), (B,1,L,L), (B,1,1,L), (B,L).
    """
    match = re.fullmatch(r"\s*([a-z-]+)\s*\(([^)]*)\)\s*", text)
    shape = "".join(match.group(2).replace(",", " ").split()) if match else ""
    if not match or match.group(1) not in MASK_KINDS or shape not in MASK_SHAPES:
        raise ValueError(f"mask must read 'KIND (SHAPE)' with KIND one of {', '.join(MASK_KINDS)} and SHAPE one of "
                         f"{', '.join(MASK_SHAPES.values())}; got {text!r} (e.g. 'additive (B,1,1,L)')")
    return MaskSpec(match.group(1), shape)


def _output(out: object) -> Tensor:
    if isinstance(out, dict):
        out = next((v for v in out.values() if isinstance(v, Tensor)), out)
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"the module returned {type(out).__name__}, not a tensor, a tuple or a dict of tensors")
    return out


@dataclass
class Caller:
    """How to call the module: style 'x' (forward(x, ...)), 'qkv' (forward(q, k, v, ...)) or 'adapter'.

    ``mask_arg`` is the keyword the mask goes to (None: the next positional argument); ``spec`` how
    a keep-mask is encoded for it; ``adapter(module, x, mask)`` and ``make_mask(keep)`` replace
    both when the user gives them.
    """

    module: nn.Module
    style: str
    mask_arg: str | None = None
    spec: MaskSpec | None = None
    adapter: Callable | None = None
    make_mask: Callable[[Tensor], Tensor] | None = None
    notes: list[str] = field(default_factory=list)

    def __call__(self, x: Tensor, mask: object = None) -> Tensor:
        if self.adapter is not None:
            return _output(self.adapter(self.module, x, mask))
        args = (x,) if self.style == "x" else (x, x, x)
        if mask is None:
            return _output(self.module(*args))
        if self.mask_arg is None:
            return _output(self.module(*args, mask))
        return _output(self.module(*args, **{self.mask_arg: mask}))

    def with_mask(self, spec: MaskSpec | None, mask_arg: str | None = None) -> Caller:
        """This caller, passing masks encoded by ``spec`` to ``mask_arg``."""
        return Caller(self.module, self.style, mask_arg if mask_arg is not None else self.mask_arg, spec,
                      self.adapter, self.make_mask)

    def for_module(self, module: nn.Module) -> Caller:
        """This caller on another module (e.g. a float16 copy)."""
        return Caller(module, self.style, self.mask_arg, self.spec, self.adapter, self.make_mask)

    @property
    def key_only(self) -> bool:
        """The module's mask can only hide keys (the same for every query)."""
        return self.spec is not None and self.spec.key_only

    def module_mask(self, keep: Tensor, dtype: torch.dtype = torch.float32) -> object:
        """Turn a keep-mask (B, L, L) (True = may attend) into what this module takes."""
        if self.make_mask is not None:
            return self.make_mask(keep[:, 0] if self.key_only else keep)
        if self.spec is None:
            raise ValueError("this caller passes no mask")
        return self.spec.encode(keep, dtype)


def mask_parameters(module: nn.Module, style: str) -> list[str | None]:
    """The forward parameters a mask may go to: mask-like keywords in signature order, or None (positional)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [None]
    named = [p.name for p in params if p.name in MASK_NAMES and p.kind != p.POSITIONAL_ONLY]
    if named:
        return named
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var = any(p.kind == p.VAR_POSITIONAL for p in params)
    return [None] if var or len(positional) >= (2 if style == "x" else 4) else []


def find_call_style(module: nn.Module, x: Tensor) -> tuple[str, str | None]:
    """('x' or 'qkv', None) if the module runs on x; ("", both errors) otherwise."""
    errors = []
    for style in ("x", "qkv"):
        try:
            with torch.no_grad():
                Caller(module, style)(x)
            return style, None
        except Exception as e:
            errors.append(f"forward({'x' if style == 'x' else 'q, k, v'}): {type(e).__name__}: {e}")
    return "", "; ".join(errors)


def dependency(fn: Callable[[Tensor], Tensor], x: Tensor, item: int = 0, rtol: float = 1e-5) -> Tensor:
    """(L, L) bool: does output row i of batch item ``item`` change when input token j changes?"""
    with torch.no_grad():
        base = fn(x)[item]
        length = x.shape[1]
        dep = torch.zeros(length, length, dtype=torch.bool)
        g = torch.Generator().manual_seed(1234)
        for j in range(length):
            x2 = x.clone()
            x2[:, j] = torch.randn(x.shape[0], x.shape[2], generator=g, dtype=x.dtype)
            diff = (fn(x2)[item] - base).abs().amax(-1)  # (L,)
            dep[:, j] = diff > rtol * (1 + base.abs().max())
    return dep

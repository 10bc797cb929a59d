"""Finding, building and calling the user's attention module.

It imports and runs the user's file (never writes to it: no bytecode cache is written), tries
the usual constructor signatures, and works out how the module is called and which mask
convention it uses.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn


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


def load_class(spec: str) -> type:
    """``path/to/file.py:ClassName`` -> the class (the file is imported, not modified)."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s or not name:
        raise CannotRun(f"expected path/to/file.py:ClassName, got {spec!r}")
    path = Path(path_s)
    if not path.is_file():
        raise CannotRun(f"no such file: {path}")
    mod_name = f"_selfattn_check_{uuid.uuid4().hex}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise CannotRun(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        with _no_bytecode():
            module_spec.loader.exec_module(module)
    except Exception as e:
        raise CannotRun(f"importing {path} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(str(path.parent.resolve()))
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise CannotRun(f"{path} has no nn.Module subclass named {name!r}")
    return cls


def build(cls: type, init: dict | None, embed_dim: int) -> tuple[nn.Module, str]:
    """Instantiate ``cls`` from ``init`` or the usual signatures; returns (module, how)."""
    if init is not None:
        try:
            return cls(**init), f"{cls.__name__}(**{init})"
        except Exception as e:
            raise CannotRun(f"{cls.__name__}(**{init}) failed: {type(e).__name__}: {e}") from e
    e, h = embed_dim, 4
    attempts: list[tuple[tuple, dict]] = [((e,), {}), ((e, h), {})]
    for key in ("embed_dim", "embedding_dim", "d_model", "dim", "hidden_size", "n_embd"):
        attempts.append(((), {key: e}))
        for hkey in ("num_heads", "n_heads", "heads", "n_head", "nhead"):
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
                    f"pass --init '{{...}}'. Last error: {errors[-1] if errors else 'none'}")


def embed_dim_of(module: nn.Module, default: int) -> int:
    for key in ("embed_dim", "embedding_dim", "d_model", "dim", "hidden_size", "n_embd"):
        v = getattr(module, key, None)
        if isinstance(v, int) and v > 0:
            return v
    for m in module.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
    return default


def num_heads_of(module: nn.Module) -> int | None:
    for key in ("num_heads", "n_heads", "heads", "n_head", "nhead", "h"):
        v = getattr(module, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


@dataclass
class Caller:
    """How to call the module: style 'x' (forward(x[, mask])) or 'qkv' (forward(q, k, v[, mask]))."""

    module: nn.Module
    style: str
    mask_shape: str | None = None  # "LL", "BLL", "B1LL", "BL" or None (no mask accepted)
    convention: str | None = None  # "keep" (True/1 = may attend) or "ignore" (True = masked)
    notes: list[str] = field(default_factory=list)

    def __call__(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        args = (x,) if self.style == "x" else (x, x, x)
        out = self.module(*args) if mask is None else self.module(*args, mask)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, Tensor):
            raise TypeError(f"the module returned {type(out).__name__}, not a tensor or a tuple of tensors")
        return out

    def module_mask(self, keep: Tensor) -> Tensor:
        """Turn a keep-mask (B, L, L) (True = may attend) into what this module takes."""
        assert self.mask_shape is not None
        m = keep if self.convention == "keep" else ~keep
        return {"LL": lambda: m[0], "BLL": lambda: m, "B1LL": lambda: m[:, None]}[self.mask_shape]()


def find_call_style(module: nn.Module, x: Tensor) -> tuple[str, str | None]:
    """('x' or 'qkv', None) if the module runs on x; raises CannotRun with both errors otherwise."""
    errors = []
    for style in ("x", "qkv"):
        try:
            with torch.no_grad():
                Caller(module, style)(x)
            return style, None
        except Exception as e:
            errors.append(f"forward({'x' if style == 'x' else 'q, k, v'}): {type(e).__name__}: {e}")
    return "", "; ".join(errors)


def accepts_mask(module: nn.Module, style: str) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var = any(p.kind == p.VAR_POSITIONAL for p in params)
    return var or len(positional) >= (2 if style == "x" else 4)


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

"""Loading the user's file and building the module: a config object next to the class, the constructor's
arguments guessed by name (or named in the error when they cannot be), the module's dtype and device.

It imports and runs the user's file (never writes to it: no bytecode cache is written).

Shape legend: E embed dim, H heads.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import math
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import MISSING as _MISSING
from dataclasses import dataclass
from pathlib import Path
from types import CellType, FunctionType, ModuleType
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CannotRun", "Sizes", "build", "build_keras", "cast_module", "copy_module", "dequantized", "draw_zeros",
           "embed_dim_of", "from_keras", "load_class", "load_file", "num_heads_of", "param_device", "param_dtype",
           "user_callable"]

# constructor and config parameters the doctor fills with the embed dim / the head count
_EMBED_KEYS = ("embed_dim", "embedding_dim", "d_model", "dim", "hidden_size", "n_embd", "hidden_dim", "emb_dim",
               "channels", "query_dim", "width", "n_state", "num_channels", "in_channels", "model_dim", "d_embed",
               "embed_size", "n_embed", "embedding_size", "hidden_channels", "inner_dim", "hid_dim",
               "num_hiddens", "n_hidden", "d_hidden", "n_feat", "adim", "attention_dim", "input_dim", "size", "emb",
               "d_in", "d_out", "in_dim", "in_features", "hidden_units", "num_units")
# q, k, v projections by name
ROLE_PATTERNS = {  # matched against the last part of a module's dotted name, whole (Bloem's tokeys, toqueries too)
    "q": re.compile(r"(q|wq|query|queries|q_proj|to_q|query_proj|q_lin|w_q|linear_q|q_linear|qlinear|toqueries)"),
    "k": re.compile(r"(k|wk|key|keys|k_proj|to_k|key_proj|k_lin|w_k|linear_k|k_linear|klinear|tokeys)"),
    "v": re.compile(r"(v|wv|value|values|v_proj|to_v|value_proj|v_lin|w_v|linear_v|v_linear|vlinear|tovalues)"),
}


# the words of a name that says "a projection" around a role word: OpenNMT's linear_keys, Megatron's query_layer,
# proj_q, w_qs (jadore801120's Transformer), q_dense
_ROLE_WORDS = {"q": ("q", "qs", "query", "queries", "uq"), "k": ("k", "ks", "key", "keys", "uk"),
               "v": ("v", "vs", "value", "values", "uv")}  # uq, uk, uv: MLA's up-projections (W_UQ, W_UK, W_UV)
_PROJECTION_WORDS = frozenset({"linear", "lin", "proj", "projection", "to", "w", "layer", "dense", "fc", "map",
                               "net", "in", "input", "self", "attn", "attention", "head", "heads"})


def name_role(name: str) -> str | None:
    """q, k or v when a module's name says so (``q_proj``, ``to_k``, ``attn.value``, ``linear_keys``), else None:
    the whole last part of the name is a known spelling, or its words are one role word and words for a
    projection (``q_norm``, ``to_kv``, ``k_cache`` say no role)."""
    last = name.rsplit(".", 1)[-1].lower()
    role = next((role for role, pattern in ROLE_PATTERNS.items() if pattern.fullmatch(last)), None)
    if role is not None:
        return role
    words = [w for w in re.split(r"[_\d]+", last) if w]
    found = [r for w in words for r, spellings in _ROLE_WORDS.items() if w in spellings]
    if len(found) == 1 and all(w in _PROJECTION_WORDS or w in _ROLE_WORDS[found[0]] for w in words):
        return found[0]
    return None


_NORM_WORDS = frozenset({"norm", "ln", "layernorm", "rmsnorm", "rms", "layer", "normalization", "scale"})


def norm_role(name: str) -> str | None:
    """q or k when a normalisation layer's name says so (``q_norm``, ``k_ln``, ``norm_k``, ``key_layernorm``),
    else None: its words are one role word and words for a norm."""
    words = [w for w in re.split(r"[_\d]+", name.rsplit(".", 1)[-1].lower()) if w]
    found = [r for w in words for r, spellings in _ROLE_WORDS.items() if w in spellings and r != "v"]
    if len(found) == 1 and any(w in _NORM_WORDS for w in words) and all(
            w in _NORM_WORDS or w in _ROLE_WORDS[found[0]] for w in words):
        return found[0]
    return None


_HEAD_DIM_KEYS = ("head_dim", "dim_head", "d_head", "head_size", "kv_channels", "attention_head_size")
_HEAD_KEYS = ("num_heads", "n_heads", "heads", "n_head", "nhead", "num_attention_heads", "h")
# attributes a built module may carry its sizes in
_EMBED_ATTRS = ("embed_dim", "embedding_dim", "d_model", "dim", "hidden_size", "n_embd", "hidden_dim")
_OTHER_WIDTHS = ("d", "num_hiddens", "d_in", "in_dim", "model_dim", "emb_dim", "emb_size", "embed_size", "width")


class CannotRun(Exception):
    """The module could not be loaded, built or called at all (exit status 2)."""


class WrongShape(CannotRun):
    """The module runs, but never returns (B, L, E) for input (B, L, E), nor a few pooled rows: ``finding`` (its
    wrong-output-shape) is the report, and no other probe can run."""

    def __init__(self, message: str, finding: object) -> None:
        super().__init__(message)
        self.finding = finding


@contextlib.contextmanager
def _no_bytecode() -> Iterator[None]:
    old = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = old


@contextlib.contextmanager
def _python_not_script() -> Iterator[None]:
    """``torch.jit.script`` giving back the function or module as written while a user's file (and what it imports
    for the first time) loads: a scripted helper runs as one call the trace cannot look into (Sockeye's interleaved
    matmuls), so that the attention inside it would go unread. The same code runs, as Python."""
    state = getattr(torch.jit, "_state", None)
    if state is None or not hasattr(state, "disable"):  # a torch without the switch: scripted as it is
        yield
        return
    was = bool(state._enabled)
    state.disable()
    try:
        yield
    finally:
        if was:
            state.enable()


def load_file(path_s: str) -> ModuleType:
    """Import ``path_s`` under a fresh name (no bytecode written, the file is not modified, TorchScript's
    ``torch.jit.script`` left as plain Python so that the trace reads inside it).

    The module is registered in ``sys.modules`` under that name, as an import would, so that code
    which looks its own module up (dataclasses, config classes found next to a class, pickling) works.
    """
    path = Path(path_s)
    if not path.is_file():
        raise CannotRun(f"no such file: {path}")
    name = f"_selfattn_check_{uuid.uuid4().hex}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CannotRun(f"cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        with _no_bytecode(), _python_not_script():
            module_spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)
        if not isinstance(e, Exception):
            raise
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


# -- building the module -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """The sizes the doctor builds and probes with: embed dim E, heads H (a divisor of E), batch and lengths.

    ``batch`` and ``lengths`` are None when the doctor picks them; a module that runs only at some
    sizes is told with ``--batch`` / ``--length``.
    """

    embed_dim: int = 64  # 0: the module's own (see embed_dims_of)
    heads: int = 4
    batch: int | None = None
    lengths: tuple[int, ...] | None = None
    given: int = 0  # the width the constructor was given (``--init``'s dim or d_model): tried first when E is 0


def _signature(fn: Callable) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _required(params: dict[str, inspect.Parameter], skip: tuple[str, ...] = ("self",)) -> list[str]:
    """The parameters a call must give: no default, not *args / **kwargs."""
    return [n for n, p in params.items() if n not in skip and p.default is p.empty and
            p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _guess(name: str, sizes: Sizes) -> object:
    """The value the doctor gives a constructor or config parameter it recognises by name, else ``_UNKNOWN``."""
    low = name.lower()
    if name in _EMBED_KEYS:
        return sizes.embed_dim
    if name in _HEAD_KEYS:
        return sizes.heads
    if low in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_heads", "n_kv_head"):
        return max(1, sizes.heads // 2)
    if low in _HEAD_DIM_KEYS:
        return sizes.embed_dim // sizes.heads
    if low in ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "mlp_dim", "dim_feedforward", "ffn_hidden_size"):
        return 2 * sizes.embed_dim
    if _is_dropout(name):  # the module runs in eval mode, where a dropout that obeys it is off
        return 0.1
    return _UNKNOWN


def _is_dropout(name: str) -> bool:
    low = name.lower()
    return "dropout" in low or "pdrop" in low or low in ("drop", "attn_drop", "proj_drop", "p")


def _defaults(config_cls: type[Any]) -> set[str]:
    """The config's fields that have a default (its __init__'s, or a dataclass field's)."""
    found = {n for n, p in _signature(config_cls.__init__).items() if p.default is not p.empty}
    for n, f in getattr(config_cls, "__dataclass_fields__", {}).items():
        if getattr(f, "default", None) is not _MISSING or getattr(f, "default_factory", None) is not _MISSING:
            found.add(n)
    return found


_UNKNOWN = object()


def _config_fields(config_cls: type[Any]) -> set[str]:
    fields = set(_signature(config_cls.__init__))
    fields |= set(getattr(config_cls, "__dataclass_fields__", {}))
    fields |= set(getattr(config_cls, "attribute_map", {}) or {})
    return fields - {"self", "args", "kwargs"}


def _config_kwargs(config_cls: type[Any], sizes: Sizes) -> dict:
    """Keyword arguments for a config class: its embed, head, width and dropout fields at the doctor's sizes."""
    fields = _config_fields(config_cls)
    takes_any = any(p.kind == p.VAR_KEYWORD for p in _signature(config_cls.__init__).values())
    kwargs: dict = {}
    embed = next((k for k in _EMBED_KEYS if k in fields), "hidden_size" if takes_any else None)
    if embed is not None:
        kwargs[embed] = sizes.embed_dim
    heads = next((k for k in _HEAD_KEYS if k in fields), "num_attention_heads" if takes_any else None)
    if heads is not None:
        kwargs[heads] = sizes.heads
    kept = {n for n in _defaults(config_cls) if _is_dropout(n)}  # a config's own dropout stays: eval turns it off,
    for name in sorted(fields - kept):  # and a dropout that ignores eval mode is then seen (dropout-in-eval)
        if name not in kwargs and (name not in _EMBED_KEYS and name not in _HEAD_KEYS):
            value = _guess(name, sizes)
            if value is not _UNKNOWN:
                kwargs[name] = value
    missing = [n for n in _required(_signature(config_cls.__init__)) if n not in kwargs]
    if missing:
        raise CannotRun(f"{config_cls.__name__} needs {', '.join(repr(m) for m in missing)}, which the doctor "
                        f"cannot guess; give the config's fields with --init '{{\"{missing[0]}\": ...}}' or build the "
                        "module with --factory 'lambda: ...'")
    return kwargs


def _annotated_class(cls: type[Any], name: str) -> type | None:
    """The class the constructor parameter ``name`` is annotated with (a type, or its name in the file that defines
    ``cls``), when it is a class of its own (a config or args object), not a number, string or tensor."""
    owner = sys.modules.get(cls.__module__)
    names = vars(owner) if owner is not None else getattr(cls.__init__, "__globals__", {})
    annotation = _signature(cls.__init__)[name].annotation
    if isinstance(annotation, str):
        annotation = names.get(annotation.split("|")[0].strip().strip("'\""))
    if not isinstance(annotation, type) or annotation is inspect.Parameter.empty or \
            annotation.__module__ in ("builtins", "typing") or issubclass(annotation, (torch.Tensor, nn.Module)):
        return None
    return annotation


def _config_class(cls: type[Any], name: str = "config") -> type | None:
    """The configuration class a ``cls(config, ...)`` constructor wants: its annotation, or the one
    ``*Config`` class in the module that defines ``cls``."""
    owner = sys.modules.get(cls.__module__)
    names = vars(owner) if owner is not None else getattr(cls.__init__, "__globals__", {})
    annotated = _annotated_class(cls, name)
    if annotated is not None:
        return annotated
    candidates = [v for k, v in names.items() if k.endswith("Config") and isinstance(v, type)]
    return candidates[0] if len(candidates) == 1 else None


def _config_parameter(cls: type[Any], params: dict[str, inspect.Parameter]) -> str | None:
    """The constructor parameter that takes a config object: ``config``, or a required one annotated with a class
    of its own (llama's ``Attention(args: ModelArgs)``)."""
    if "config" in params:
        return "config"
    return next((n for n in _required(params) if _annotated_class(cls, n) is not None), None)


def _build_with_config(cls: type[Any], init: dict | None, sizes: Sizes,
                       param: str = "config") -> tuple[nn.Module, str]:
    config_cls = _config_class(cls, param)
    if config_cls is None:
        raise CannotRun(f"{cls.__name__}(config, ...) needs a config object and no single *Config class was found "
                        "next to it; pass --factory 'lambda: ...'")
    kwargs = init if init is not None else _config_kwargs(config_cls, sizes)
    shown = f"{cls.__name__}({config_cls.__name__}(**{kwargs}))"
    try:
        config = config_cls(**kwargs)
    except Exception as e:
        raise CannotRun(f"{config_cls.__name__}(**{kwargs}) failed: {type(e).__name__}: {e}; pass --init with the "
                        "config's fields or --factory 'lambda: ...'") from e
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "eager"  # the module's own math, not a fused kernel
    extra = {"layer_idx": 0} if "layer_idx" in _signature(cls.__init__) else {}
    missing = [n for n in _required(_signature(cls.__init__), ("self", param)) if n not in extra]
    if missing:
        raise CannotRun(f"{cls.__name__}({param}, ...) also needs {', '.join(repr(m) for m in missing)}; build it "
                        "with --factory 'lambda: ...'")
    try:
        return cls(**{param: config}, **extra), shown
    except Exception as e:
        raise CannotRun(f"{shown} failed: {type(e).__name__}: {e}; pass --init with the config's fields or "
                        "--factory 'lambda: ...'") from e


def build(cls: type[Any], init: dict | None, embed_dim: int, *, heads: int = 4) -> tuple[nn.Module, str]:
    """Instantiate ``cls`` from ``init``, a config object or its signature; returns (module, how it was built).

    Without ``init``, every required constructor argument must be one the doctor recognises by name
    (an embed dim such as ``embed_dim``/``dim``/``d_model``, a head count, a head dim, a dropout);
    otherwise :class:`CannotRun` names the argument and the option that supplies it.
    """
    params = _signature(cls.__init__)
    sizes = Sizes(embed_dim, heads)
    if init is None and "config" in params and params["config"].default is None and not _required(params):
        try:  # a config that defaults to None: the module's own defaults
            return cls(), f"{cls.__name__}()"
        except Exception:
            pass
    config_param = _config_parameter(cls, params)
    if config_param is not None:
        return _build_with_config(cls, init, sizes, config_param)
    if init is not None:
        try:
            return cls(**init), f"{cls.__name__}(**{init})"
        except Exception as e:
            raise CannotRun(f"{cls.__name__}(**{init}) failed: {type(e).__name__}: {e}") from e
    required = _required(params)
    kwargs = {n: _guess(n, sizes) for n in required}
    for n, p in params.items():  # a head dim that defaults to the width would hide a scale by the wrong one
        if n not in kwargs and n.lower() in _HEAD_DIM_KEYS and p.default == embed_dim and embed_dim % heads == 0:
            kwargs[n] = embed_dim // heads
    unknown = [n for n, v in kwargs.items() if v is _UNKNOWN]
    if unknown:
        raise CannotRun(f"{cls.__name__}.__init__ needs {', '.join(repr(n) for n in unknown)}, which the doctor "
                        f"cannot guess; pass --init '{{\"{unknown[0]}\": ...}}' (all constructor keywords) or "
                        "--factory 'lambda: ...'")
    attempts: list[tuple[tuple, dict]] = [((), kwargs)]
    if not params or any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        attempts += [((embed_dim,), {}), ((embed_dim, heads), {})]
    errors = []
    for args, kw in attempts:
        try:
            m = cls(*args, **kw)
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
            continue
        parts = [*map(repr, args), *(f"{k}={v!r}" for k, v in kw.items())]
        return m, f"{cls.__name__}({', '.join(parts)})"
    raise CannotRun(f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: {errors[0]}; "
                    "pass --init '{...}' with its constructor keywords or --factory 'lambda: ...'")


def _int_attr(module: nn.Module, keys: tuple[str, ...]) -> int | None:
    for owner in (module, getattr(module, "config", None)):
        for key in keys:
            v = getattr(owner, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def embed_dim_of(module: nn.Module, default: int) -> int:
    """E: from an embed-dim attribute (or the module's config), else the input size of the first nn.Linear, or of
    the first convolution or group norm (an image block's channels)."""
    found = _int_attr(module, _EMBED_ATTRS)
    if found:
        return found
    for m in module.modules():
        if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            continue  # nn.LazyLinear: no size until its first call
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, (nn.Conv1d, nn.Conv2d)) and m.groups == 1:
            return m.in_channels
        if isinstance(m, nn.GroupNorm):
            return m.num_channels
    return default


def width_given(init: dict | None) -> int:
    """The width a constructor's keywords give (``dim``, ``d_model``, ``hidden_size``, ...), or 0."""
    found = [v for k, v in (init or {}).items() if k in _EMBED_ATTRS and isinstance(v, int) and
             not isinstance(v, bool) and v > 1]
    return found[0] if found else 0


def embed_dims_of(module: nn.Module) -> list[int]:
    """The candidates for E, most likely first: :func:`embed_dim_of`, then the input sizes of the module's other
    layers (Linear, convolution, norm), each once."""
    own = embed_dim_of(module, 0)
    # no width named and no layer to read it from: the module's other sizes come before the doctor's default (64)
    dims = [own] if own else []
    # widths named otherwise by from-scratch modules (self.d = d, d2l's num_hiddens), whose first Linear may be one
    # head's (per-head q, k and v maps of d_head)
    for m in module.modules():
        for name in _OTHER_WIDTHS:
            size = getattr(m, name, None)
            if isinstance(size, int) and not isinstance(size, bool) and size > 1 and size not in dims:
                dims.append(size)
    for m in module.modules():
        weight = getattr(m, "weight", None)
        size = m.in_features if isinstance(m, nn.Linear) else m.in_channels if isinstance(m, (nn.Conv1d, nn.Conv2d)) \
            else m.normalized_shape[-1] if isinstance(m, nn.LayerNorm) and m.normalized_shape else \
            weight.shape[0] if type(m).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.dim() == 2 \
            else None  # transformers' Conv1D keeps its weight (in, out)
        if isinstance(size, int) and size > 0 and size not in dims:
            dims.append(size)
    # q, k, v held as raw matrices named for their role (x @ W_query, W of (d_in, d_out): a from-scratch module's)
    for name, p in module.named_parameters():
        if not isinstance(p, nn.parameter.UninitializedParameter) and p.dim() == 2 and \
                name_role(name.rsplit(".", 1)[-1]) is not None:
            for size in p.shape:
                if size > 1 and size not in dims:
                    dims.append(int(size))
    return dims if own else [*dims, *([64] if 64 not in dims else [])]


def num_heads_of(module: nn.Module) -> int | None:
    """H: from a heads attribute, the module's config, or embed dim // head_dim; None if none is found."""
    found = _int_attr(module, _HEAD_KEYS)
    if found:
        return found
    head_dim, e = _int_attr(module, ("head_dim",)), _int_attr(module, _EMBED_ATTRS)
    if head_dim and e and e % head_dim == 0:
        return e // head_dim
    # a block around one attention (a norm and nn.MultiheadAttention): the heads its attention layers agree on
    inner = {_int_attr(m, _HEAD_KEYS) for m in module.modules() if m is not module} - {None, 0}
    return inner.pop() if len(inner) == 1 else None


def draw_zeros(module: nn.Module, gen: torch.Generator) -> list[str]:
    """Draw ``module``'s all-zero parameters, in place, from N(0, 0.02^2) (weights of the scale real models
    initialise: a gain initialised at 0 silences a fresh module); the names of those drawn."""
    drawn = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.numel() and not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p))
                drawn.append(name)
    return drawn


def _dynamic_linear(module: nn.Module) -> bool:
    """Is ``module`` a Linear layer of torch's dynamic quantization (``torch.ao.quantization.quantize_dynamic``)?"""
    try:
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    except ImportError:  # a torch built without quantization
        return False
    return isinstance(module, DynamicLinear)


def dequantized(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """A copy of ``module`` whose dynamically quantized Linear layers (``quantize_dynamic``: int8 weights, and
    activations quantized per tensor on the fly, so that each item's output depends on the batch's range and the
    output is a step function of the input) are float ``nn.Linear`` layers with the weights they hold, dequantized;
    and their names. The attention around them is what the probes judge. The module itself when it has none."""
    names = [name for name, sub in module.named_modules() if name and _dynamic_linear(sub)]
    if not names:
        return module, []
    plain = copy_module(module)
    for name in names:
        quantized: Any = plain.get_submodule(name)  # its weight() and bias() are methods
        weight, bias = quantized.weight().dequantize(), quantized.bias()
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        parent, _, child = name.rpartition(".")
        setattr(plain.get_submodule(parent) if parent else plain, child, linear)
    return plain, names


def copy_module(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)``; when that fails, a copy in which what cannot be copied is shared: a tensor the
    module keeps with autograd history (d2l's ``attention_weights`` after a forward) goes detached, one in a dict
    (a cache, as LeViT's biases: the module computes it again) is left out, any other attribute deepcopy refuses (a
    staticmethod object, a lock) goes as it is."""
    try:
        copies: dict[int, object] = {}
        return _closures_rebound(copy.deepcopy(module, copies), copies)
    except Exception:
        keras = {type(m) for m in module.modules() if from_keras(m)}
        if keras:  # Keras copies a layer through its saving library, which needs its class registered: copied as
            try:  # the plain objects they are instead
                return _copied_plainly(module, keras)
            except Exception:
                pass
        memo: dict[int, object] = {}
        todo = [value for sub in module.modules() for value in vars(sub).values()]
        while todo:  # the module's attributes, and what their dicts, lists and tuples hold (LeViT's bias cache)
            value = todo.pop()
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) and value.grad_fn is not None:
                memo[id(value)] = value.detach().clone()
            elif isinstance(value, dict):
                kept = {k: v for k, v in value.items() if not (isinstance(v, Tensor) and v.grad_fn is not None)}
                if len(kept) < len(value):
                    memo[id(value)] = copy.deepcopy(kept, memo)
                todo.extend(kept.values())
            elif isinstance(value, (list, tuple)):
                todo.extend(value)
            elif not isinstance(value, (Tensor, nn.Module)):
                try:
                    copy.deepcopy(value)
                except Exception:
                    memo[id(value)] = value
        return copy.deepcopy(module, memo)


def _rebound(fn: FunctionType, memo: dict[int, object], depth: int = 4) -> FunctionType:
    """``fn`` with its closure's cells pointing at the copies ``memo`` made of what they held (and functions it closes
    over rebound alike), or ``fn`` itself when it closes over nothing that was copied."""
    if fn.__closure__ is None or depth == 0:
        return fn
    cells, changed = [], False
    for cell in fn.__closure__:
        try:
            held = cell.cell_contents
        except ValueError:  # a cell not filled yet
            cells.append(cell)
            continue
        new = memo.get(id(held), held) if not isinstance(held, FunctionType) else _rebound(held, memo, depth - 1)
        changed = changed or new is not held
        cells.append(CellType(new))
    if not changed:
        return fn
    made = FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    made.__kwdefaults__, made.__qualname__, made.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    made.__dict__.update(fn.__dict__)
    return made


def _closures_rebound(made: nn.Module, memo: dict[int, object]) -> nn.Module:
    """A deep copy whose methods and function attributes close over the copy's own layers: a forward written as a
    closure over the original's (a_unet's ``Module(modules, forward_fn)``, a class made in a function) would run the
    original's weights from the copy (a float16 copy calling float32 layers). Such a submodule gets a subclass of
    its class, of the same name, with the methods rebound; its function attributes are rebound in place."""
    for sub in made.modules():
        cls = type(sub)
        methods = {name: _rebound(fn, memo) for name, fn in vars(cls).items() if isinstance(fn, FunctionType)}
        methods = {name: fn for name, fn in methods.items() if fn is not vars(cls)[name]}
        if methods:
            sub.__class__ = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
        for name, value in list(vars(sub).items()):
            if isinstance(value, FunctionType) and (fn := _rebound(value, memo)) is not value:
                vars(sub)[name] = fn
    return made


def from_keras(module: nn.Module) -> bool:
    """Is ``module`` a Keras 3 layer (its class, or a class it derives from, Keras's or keras-hub's)?"""
    return any(c.__module__.split(".")[0] in ("keras", "keras_hub") for c in type(module).__mro__)


def build_keras(module: nn.Module, run: Callable[[], object]) -> None:
    """Build a Keras 3 layer that is not built yet (its weights are made on its first call) by running ``run``
    once, so that the doctor's calls, which put back every attribute a call replaced, meet a layer with its weights;
    a call that fails leaves it for the doctor's own calls to report."""
    if not any(from_keras(m) and getattr(m, "built", True) is False for m in module.modules()):
        return
    try:
        with torch.no_grad():
            run()
    except Exception:  # the doctor's calls say why the module does not run
        return


def _copied_plainly(module: nn.Module, classes: set[type]) -> nn.Module:
    """``copy.deepcopy(module)`` with ``classes`` copied as plain objects (their state, attribute by attribute), not by
    the ``__reduce__`` they define."""

    def plain(self: object, memo: dict) -> object:
        made = type(self).__new__(type(self))
        memo[id(self)] = made
        made.__dict__.update(copy.deepcopy(vars(self), memo))
        return made

    patched = [cls for cls in classes if "__deepcopy__" not in vars(cls)]
    for cls in patched:
        cls.__deepcopy__ = plain  # type: ignore[attr-defined]
    try:
        return copy.deepcopy(module)
    finally:
        for cls in patched:
            del cls.__deepcopy__  # type: ignore[attr-defined]


def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with its floating-point tensors cast to ``dtype`` in place, as ``module.half()`` / ``.double()`` cast
    them; a Keras layer (Keras 3 on its torch backend) also gets that dtype as its dtype policy, since it casts its
    inputs to the policy's compute dtype, not to its weights'."""
    module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    for sub in module.modules():
        if from_keras(sub) and hasattr(sub, "dtype_policy"):
            try:
                setattr(sub, "dtype_policy", str(dtype).rpartition(".")[2])  # noqa: B010 (a Keras property)
            except Exception:  # a policy Keras will not set (a quantized layer's): the layer casts as it did
                continue
    return module


def param_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the module's first floating-point parameter (or buffer); float32 when it has none."""
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def param_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (or buffer); the CPU when it has none."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")

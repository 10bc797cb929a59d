"""Every self-attention class transformers ships, built from a tiny random config and called as its layers call it.

For each model family (a package under ``transformers.models`` with a ``modeling_<family>.py``):
the family's model is built from its config class with tiny sizes (hidden 64, 4 heads, 2 kv heads
where the config has them, head dim 16, one layer, dropout 0, eager attention; nothing is
downloaded), and the first self-attention module of its first layer is taken out (the module whose
class name says Attention and that owns the q/k/v projections; cross-attention is skipped). One
generic adapter calls it: ``forward(hidden_states, attention_mask=mask, position_embeddings=
rope(x, positions))`` (the rotary embedding module is the model's own, when forward wants
``position_embeddings``), ``position_ids`` when forward wants them, the output's first item.
:data:`FAMILY_OPTIONS` holds what some families need beyond that.

Used by ``scripts/doctor_sweep.py`` (every family) and ``tests/test_check_sweep.py`` (a handful).

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torchvision_ops import define_torchvision_ops

define_torchvision_ops()  # transformers imports torchvision when it is installed (see tests/torchvision_ops.py)

E, H, G, D = 64, 4, 2, 16  # hidden size, heads, kv heads, head dim

# config field -> tiny value; a field is set only when the config class has it
TINY: dict[str, object] = {
    "hidden_size": E, "d_model": E, "n_embd": E, "dim": E, "embed_dim": E, "hidden_dim": E, "model_dim": E,
    "num_attention_heads": H, "n_head": H, "n_heads": H, "num_heads": H, "encoder_attention_heads": H,
    "decoder_attention_heads": H, "attention_heads": H,
    "num_key_value_heads": G, "n_kv_heads": G, "num_kv_heads": G,
    "head_dim": D, "d_kv": D, "attention_head_dim": D, "kv_channels": D,
    "intermediate_size": 2 * E, "ffn_dim": 2 * E, "d_ff": 2 * E, "encoder_ffn_dim": 2 * E, "decoder_ffn_dim": 2 * E,
    "n_inner": 2 * E, "mlp_dim": 2 * E, "moe_intermediate_size": 2 * E, "shared_expert_intermediate_size": 2 * E,
    "num_hidden_layers": 1, "n_layer": 1, "n_layers": 1, "num_layers": 1, "encoder_layers": 1, "decoder_layers": 1,
    "num_decoder_layers": 1,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "rotary_dim": D,
    # multi-head latent attention (DeepSeek V2/V3 and their kin)
    "qk_rope_head_dim": D // 2, "qk_nope_head_dim": D // 2, "v_head_dim": D, "kv_lora_rank": 2 * D,
    "q_lora_rank": 2 * D,
}
SMALL_VOCAB = {"vocab_size": 1024}  # tried first; configs whose token ids need a larger vocabulary keep theirs
_CROSS = ("cross", "encoder_attn", "encdec", "enc_dec", "context")
_PROJ = ("q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv", "qkv_proj", "c_attn", "wqkv",
         "Wqkv", "query_key_value", "in_proj", "to_q", "to_k", "to_v", "q_lin", "k_lin", "v_lin", "qkv_linear",
         "linear_q", "linear_k", "linear_v", "query_proj", "key_proj", "value_proj", "qkv_proj", "c_qkv", "W_pack",
         "q_a_proj", "kv_a_proj_with_mqa", "wq", "wk", "wv", "att_proj")


class CannotBuild(Exception):
    """The family's self-attention could not be built or found with a tiny config (the message says why)."""


class NotSelfAttention(CannotBuild):
    """The family's model has no self-attention module in the usual form (convolutions, state spaces, ...)."""


@dataclass
class Built:
    """A family's self-attention module, how to call it, and the doctor options it needs."""

    family: str
    module: nn.Module
    call: Callable
    options: dict = field(default_factory=dict)
    path: str = ""  # where in the model it was found
    make: Callable[[type], nn.Module] | None = None  # cls -> cls(*the arguments the model built it with)

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


def families() -> list[str]:
    """Every package under transformers.models that has a modeling_<family>.py, sorted."""
    import transformers.models as tm

    root = tm.__path__[0]
    return sorted(m.name for m in pkgutil.iter_modules(tm.__path__)
                  if m.ispkg and os.path.exists(os.path.join(root, m.name, f"modeling_{m.name}.py")))


def _config_class(family: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    types = [t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) == family]
    if not types:
        raise CannotBuild("no config class registered for the family")
    mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    main = family if family in types else min(types, key=len)
    found = getattr(mod, CONFIG_MAPPING_NAMES[main], None)
    if found is None:
        raise CannotBuild(f"config class {CONFIG_MAPPING_NAMES[main]} not found")
    return found


_LAYER_KEYS = {k for k, v in TINY.items() if v == 1}
_KV_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "head_dim", "d_kv", "attention_head_dim",
            "kv_channels"}


def _defaults(config_cls: type) -> dict[str, object]:
    """Each constructor field of the config class with its default (fields without one: None)."""
    out: dict[str, object] = {}
    for name, f in getattr(config_cls, "__dataclass_fields__", {}).items():
        out[name] = f.default if not isinstance(f.default, type(inspect.Parameter.empty)) else None
    try:
        for name, p in inspect.signature(config_cls.__init__).parameters.items():
            out.setdefault(name, None if p.default is inspect.Parameter.empty else p.default)
    except (TypeError, ValueError):
        pass
    return out


def _tiny_kwargs(config_cls: type, skip: set[str] = frozenset()) -> dict:
    """TINY's values for the fields the config has whose default is a number (a list-valued field, as in
    Swin's per-stage heads, keeps its default); float dropouts set to 0."""
    defaults = _defaults(config_cls)
    kwargs = {k: v for k, v in TINY.items() if k in defaults and k not in skip and
              (defaults[k] is None or (isinstance(defaults[k], int) and not isinstance(defaults[k], bool)))}
    for name, default in defaults.items():
        if ("dropout" in name or "pdrop" in name or name.endswith("drop_rate")) and isinstance(default, float):
            kwargs[name] = 0.0
    return kwargs


def tiny_config(family: str, overrides: dict | None = None):
    """The family's config with tiny sizes (sub-configs too), dropout 0.

    Tried with every tiny size, then keeping the default layer counts (configs that list a type per
    layer), then also the default kv heads and head dim (configs that check them against other fields).
    """
    config_cls = _config_class(family)
    sub = {k: v for k, v in (getattr(config_cls, "sub_configs", None) or {}).items() if isinstance(v, type)}
    errors = []
    for vocab, skip in ((True, set()), (False, set()), (False, _LAYER_KEYS), (False, _LAYER_KEYS | _KV_KEYS)):
        kwargs = _tiny_kwargs(config_cls, skip)
        if vocab:
            kwargs.update({k: v for k, v in SMALL_VOCAB.items() if k in _defaults(config_cls)})
        try:
            for name, sub_cls in sub.items():
                sub_kwargs = {**_tiny_kwargs(sub_cls, skip), **(overrides or {}).get(name, {})}
                if sub_kwargs:
                    kwargs[name] = sub_cls(**sub_kwargs)
            kwargs.update({k: v for k, v in (overrides or {}).items() if k not in sub})
            config = _shrink_sub_configs(config_cls(**kwargs), skip)
        except Exception as e:  # the next, less tiny, try
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if vocab and _token_ids_beyond(config, SMALL_VOCAB["vocab_size"]):
            errors.append("a special token id is beyond the small vocabulary")
            continue
        return _fit_latent_attention(config)
    raise CannotBuild(f"{config_cls.__name__}(tiny sizes) failed: {errors[0]}"[:300])


def _configs(config) -> Iterator:
    """The config and every sub-config in it (a composite model's text, vision, audio configs)."""
    from transformers import PretrainedConfig

    yield config
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            yield from _configs(value)


def _token_ids_beyond(config, vocab: int) -> bool:
    """A special token id (pad, bos, ...) that the small vocabulary would not hold: its embedding would fail."""
    return any(isinstance(v, int) and not isinstance(v, bool) and v >= vocab
               for c in _configs(config) for k, v in vars(c).items() if k.endswith("token_id"))


def _fit_latent_attention(config):
    """Multi-head latent attention (a ``kv_lora_rank``) makes keys for every head: its kv heads are its heads."""
    for c in _configs(config):
        if getattr(c, "kv_lora_rank", None) and getattr(c, "num_key_value_heads", None) is not None:
            c.num_key_value_heads = c.num_attention_heads
    return config


def fit_rope_sections(config, half: int) -> None:
    """Multimodal rotary (``mrope_section``: the rotary frequencies split between time, height and width) in the
    default's proportions 1/4, 3/8, 3/8 of ``half`` frequencies, for each (sub-)config with rope parameters."""
    quarter = max(half // 4, 1)
    sections = [quarter, (half - quarter) // 2, half - quarter - (half - quarter) // 2]
    for c in _configs(config):
        params = getattr(c, "rope_parameters", None)
        if isinstance(params, dict):
            params["mrope_section"] = sections


def _shrink_sub_configs(config, skip: set[str]):
    """Sub-configs created by default (a composite model's text or vision config) get the tiny sizes too."""
    from transformers import PretrainedConfig

    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            tiny = _tiny_kwargs(type(value), skip)
            if any(getattr(value, k, None) != v for k, v in tiny.items()):
                setattr(config, name, type(value).from_dict({**value.to_dict(), **tiny}))
    return config


MAX_PARAMETERS = 60_000_000  # a tiny model has far fewer; more means some part kept its full size


def _parameter_count(model_cls: type, config) -> int | None:
    """Parameters of the model, counted on the meta device (no memory); None when it cannot be built there."""
    try:
        with torch.device("meta"):
            model = model_cls(config)
    except Exception:  # some models compute on real tensors in __init__: counted when built
        return None
    return sum(p.numel() for p in model.parameters())


def _model_class(family: str, config) -> type:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    names = name if isinstance(name, (tuple, list)) else [name]
    for n in names:
        if n and hasattr(mod, n):
            return getattr(mod, n)
    for n, obj in vars(mod).items():
        if isinstance(obj, type) and n.endswith("Model") and not n.endswith("PreTrainedModel") and \
                isinstance(getattr(obj, "config_class", None), type) and isinstance(config, obj.config_class):
            return obj
    raise CannotBuild("no model class for the config")


def _owns_projections(m: nn.Module) -> bool:
    return any(name in _PROJ and not list(child.children()) for name, child in m.named_children())


_OTHER_MODALITY = ("vision", "visual", "audio", "image", "vqgan", "vqvae", "speech", "perceiver", "qformer")


def self_attention(model: nn.Module) -> tuple[str, nn.Module]:
    """The first self-attention module of the model: class name says Attention, it owns q/k/v projections.

    In a model that has a language part and a vision or audio part, the language part's comes first.
    """
    found = []
    for path, m in model.named_modules():
        name = type(m).__name__
        if "Attention" not in name or any(c in path.lower() or c in name.lower() for c in _CROSS):
            continue
        if _owns_projections(m):
            found.append((path, m))
    if not found:
        raise NotSelfAttention("no module whose class name says Attention owns q/k/v projections")
    return min(found, key=lambda pm: any(w in (pm[0] + type(pm[1]).__name__).lower() for w in _OTHER_MODALITY))


def _rotary(model: nn.Module, attention: nn.Module) -> Callable[[Tensor, Tensor], object] | None:
    rope = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")
                 and not any(c in type(m).__name__.lower() for c in ("vision", "audio"))), None)
    if rope is None:
        rope = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rope is None:
        return None
    params = inspect.signature(rope.forward).parameters
    layer_type = getattr(attention, "layer_type", None) or (getattr(getattr(model, "config", None), "layer_types",
                                                                    None) or [None])[0]
    if "layer_type" in params:
        return lambda x, pos: rope(x, pos, layer_type)
    return lambda x, pos: rope(x, pos)


def generic_call(attention: nn.Module, rope: Callable | None) -> Callable:
    """``call(module, x, mask)``: x as hidden_states, the mask to attention_mask (or mask), rotary positions."""
    params = inspect.signature(attention.forward).parameters
    mask_name = next((n for n in ("attention_mask", "mask", "attn_mask") if n in params), None)
    wants_rope = "position_embeddings" in params
    wants_ids = "position_ids" in params

    def call(m: nn.Module, x: Tensor, mask: object) -> object:
        kwargs: dict = {}
        if mask_name is not None:
            kwargs[mask_name] = mask
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        if wants_rope and rope is not None:
            kwargs["position_embeddings"] = rope(x, pos)
        if wants_ids:
            kwargs["position_ids"] = pos
        return m(x, **kwargs)

    return call


def _unsupplied(attention: nn.Module, has_rope: bool) -> list[str]:
    """Required forward arguments the generic adapter does not give (it gives x, the mask, positions)."""
    params = list(inspect.signature(attention.forward).parameters.values())[1:]
    given = {"attention_mask", "mask", "attn_mask", "position_ids"} | ({"position_embeddings"} if has_rope else set())
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in given]



def _bloom_call(attention: nn.Module, model: nn.Module) -> Callable:
    """Bloom's attention takes the residual (added inside) and the ALiBi tensor: zeros and the family's ALiBi."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    def call(m: nn.Module, x: Tensor, mask: object) -> object:
        alibi = build_alibi_tensor(torch.ones(x.shape[:2]), m.num_heads, x.dtype)
        return m(x, torch.zeros_like(x), alibi, attention_mask=mask)

    return call


# family -> config overrides ("config"), selfattn.check options ("options") and an adapter factory ("adapter":
# (attention, model) -> call) beyond the generic ones, and why (the sweep table's "options needed")
FAMILY_OPTIONS: dict[str, dict] = {
    "t5": {"options": {"scale": 1.0}, "why": "scale=1.0 (T5 folds 1/sqrt(d) into its initialisation)"},
    "gpt_neo": {"options": {"scale": 1.0}, "why": "scale=1.0 (GPT-Neo does not scale its scores)"},
    **{f: {"options": {"scale": 1.0}, "why": "scale=1.0 (T5-style: 1/sqrt(d) folded into the initialisation)"}
       for f in ("mt5", "umt5", "switch_transformers", "udop")},
    "dia": {"options": {"scale": 1.0}, "why": "scale=1.0 (Dia's attention sets scaling = 1.0)"},
    **{f: {"options": {"batch": 1}, "why": "batch=1 (the vision tower takes all patches as one batch row)"}
       for f in ("pixtral", "mlcd")},
    "bloom": {"adapter": _bloom_call, "why": "call: residual = 0 and the family's ALiBi tensor"},
    "big_bird": {"config": {"attention_type": "original_full"},
                 "why": "config attention_type='original_full' (block-sparse needs long inputs)"},
    "bigbird_pegasus": {"config": {"attention_type": "original_full"},
                        "why": "config attention_type='original_full' (block-sparse needs long inputs)"},
}


def _tiny_class(family: str, overrides: dict | None = None) -> tuple[object, type]:
    """The family's tiny config (eager attention) and model class; CannotBuild when the model would not be tiny."""
    config = tiny_config(family, overrides)
    model_cls = _model_class(family, config)
    config._attn_implementation = "eager"
    count = _parameter_count(model_cls, config)
    if count is not None and count > MAX_PARAMETERS:
        raise CannotBuild(f"the tiny config still gives {count / 1e6:.0f}M parameters (a part kept its full size)")
    return config, model_cls


def build(family: str, seed: int = 0) -> Built:
    """The family's self-attention from a tiny random config (seeded), with its adapter and options.

    Raises:
        CannotBuild: with the reason (import, config, model, no self-attention found).
    """
    extra = FAMILY_OPTIONS.get(family, {})
    try:
        config, model_cls = _tiny_class(family, extra.get("config"))
        torch.manual_seed(seed)
        with _recording_arguments(importlib.import_module(model_cls.__module__)) as arguments:
            model = model_cls(config).eval()
    except CannotBuild:
        raise
    except Exception as e:
        raise CannotBuild(f"{type(e).__name__}: {e}"[:300]) from e
    path, attention = self_attention(model)
    rope = _rotary(model, attention)
    missing = _unsupplied(attention, rope is not None) if "adapter" not in extra else []
    if missing:
        raise CannotBuild(f"{type(attention).__name__}.forward requires {', '.join(missing)}, which the generic "
                          "adapter does not supply (no adapter for this family yet)")
    call = extra["adapter"](attention, model) if "adapter" in extra else generic_call(attention, rope)
    args, kwargs = arguments.get(id(attention), (None, None))

    def make(cls: type) -> nn.Module:
        if args is None:
            raise CannotBuild(f"{type(attention).__name__} was not built by its modeling file's classes")
        m = cls(*args, **kwargs)
        m.load_state_dict(attention.state_dict())
        return m.eval()

    options = extra.get("options", {})
    options = options(attention, model) if callable(options) else dict(options)
    return Built(family, attention, call, options, path, make)


@contextlib.contextmanager
def _recording_arguments(module) -> Iterator[dict[int, tuple[tuple, dict]]]:
    """While the model is built: id(instance) -> (args, kwargs) of each Attention class of ``module``."""
    seen: dict[int, tuple[tuple, dict]] = {}
    originals = {cls: cls.__dict__["__init__"] for cls in vars(module).values()
                 if isinstance(cls, type) and issubclass(cls, nn.Module) and "Attention" in cls.__name__
                 and cls.__module__ == module.__name__ and "__init__" in cls.__dict__}

    def wrap(init: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            seen.setdefault(id(self), (args, kwargs))  # the outermost call: the class actually built
            init(self, *args, **kwargs)
        return __init__

    for cls, init in originals.items():
        cls.__init__ = wrap(init)
    try:
        yield seen
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def _uses_rope_sections(model_cls: type) -> bool:
    source = inspect.getsource(importlib.import_module(model_cls.__module__))
    return "mrope_section" in source


def _example_inputs(model: nn.Module, config, seed: int) -> Iterator[dict]:
    """Candidate example inputs for the model's forward, by what it takes: token ids (2, 7) (and decoder ids, and
    an all-ones attention mask); then each other input it takes (pixels, a video's frames, audio samples, audio
    features), with the ids (a model of text and images or sound) and alone."""
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    configs = list(_configs(config))

    def first(*names: str) -> object:
        return next((getattr(c, n) for c in configs for n in names if getattr(c, n, None) is not None), None)

    vocab = first("vocab_size")
    top = min(vocab, 1000) if isinstance(vocab, int) else 100  # a config without a vocabulary (bytes, code points)
    decoder = {"decoder_input_ids": torch.randint(0, top, (2, 5), generator=gen)} \
        if "decoder_input_ids" in params else {}
    texts: list[dict] = []
    if "input_ids" in params:
        ids = {"input_ids": torch.randint(0, top, (2, 7), generator=gen)}
        texts.append(ids)
        if "attention_mask" in params:  # a model that makes its mask from a padding id the config does not set
            texts.append({**ids, "attention_mask": torch.ones(2, 7, dtype=torch.long)})
    others: list[dict] = []
    if "pixel_values" in params:
        # a patch model takes its own image size; a convolutional backbone (DETR's, stride 32) gets 128 pixels,
        # so that its attention still sees 16 tokens
        size = first("image_size") if first("patch_size") else None
        size = (size[0] if isinstance(size, (list, tuple)) else size) or 128
        channels = first("num_channels") or 3
        others.append({"pixel_values": torch.randn(2, channels, size, size, generator=gen)})
        frames = first("num_frames")
        if isinstance(frames, int):
            others.append({"pixel_values": torch.randn(2, frames, channels, size, size, generator=gen)})
    if "input_values" in params:
        others.append({"input_values": torch.randn(2, 4000, generator=gen)})
    if "input_features" in params:
        bins = first("num_mel_bins", "feature_size", "input_feat_per_channel") or 80
        frames = 2 * (first("max_source_positions") or 50)
        others.append({"input_features": torch.randn(2, bins, frames, generator=gen)})
    for inputs in [*texts, *({**t, **o} for o in others for t in texts[:1]), *others]:
        yield {**inputs, **decoder}


def build_model(family: str, seed: int = 0) -> tuple[nn.Module, dict]:
    """The family's whole model from the same tiny random config (seeded, eager attention), with example inputs
    its forward runs on: token ids (2, 7) (and decoder token ids for an encoder-decoder), ids and pixels, pixel
    values (a video's frames), audio samples or features, the first of these the model runs on. When the one-layer
    model does not run (a hybrid whose only layer is not attention), it is built with eight layers.
    No per-family table: what ``selfattn.check_model`` needs is what the model gives its layers.

    Raises:
        CannotBuild: with the reason (config, model, no inputs the model runs on).
    """
    errors: list[str] = []
    layers = {k: 8 for k in _LAYER_KEYS if k in _defaults(_config_class(family))}
    for overrides in (None, layers):  # eight layers: a hybrid's first attention layer is within them
        try:
            config, model_cls = _tiny_class(family, overrides)
        except CannotBuild as e:
            errors.append(str(e))
            continue
        head_dim = getattr(config, "head_dim", None) or D
        halves = [head_dim // 2, head_dim // 4] if _uses_rope_sections(model_cls) else [None]
        for half in halves:
            if half is not None:
                fit_rope_sections(config, half)
            try:
                torch.manual_seed(seed)
                model = model_cls(config).eval()
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            candidates = list(_example_inputs(model, config, seed))
            if not candidates:
                raise CannotBuild(f"{model_cls.__name__}.forward takes none of input_ids, pixel_values, "
                                  "input_values, input_features")
            for inputs in candidates:
                try:
                    with torch.no_grad():
                        model(**inputs)
                except Exception as e:
                    errors.append(f"the model failed on {', '.join(inputs)}: {type(e).__name__}: {e}")
                    continue
                return model, inputs
    raise CannotBuild(errors[-1][:300] if errors else "no config")  # the last: the fullest inputs tried

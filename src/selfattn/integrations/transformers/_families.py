"""Which transformers model classes can run selfattn, and the refusal of those that cannot.

A model runs selfattn when its attention modules call transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``) with the mask that
transformers' mask interface built. transformers declares that on the class:
``_supports_attention_backend`` ("supports attention (mask) interface functions") and
``_supports_flex_attn`` (flex attention exists only through the interface); where neither is set,
its own reading of the modeling file (:func:`._upstream.can_set_attn_implementation`) decides.
A modeling file that picks attention classes from a table keyed by implementation name (Falcon,
GIT) has no entry for selfattn, whatever the flags say. A model that computes attention itself
(that table, Bloom's and MPT's scores plus the mask, DeBERTa-v2's disentangled attention) would
raise deep inside, or silently ignore selfattn:
it is refused when it is built, with a ``ValueError`` that names the family and suggests
``"sdpa"`` / ``"eager"``.
"""

from __future__ import annotations

import sys

from ._upstream import can_set_attn_implementation

__all__ = ["check_model_class", "unsupported_reason"]

# Families (model types) that do call the interface but read the 4-D mask's values on the way
# (found by running every family with selfattn, tests/test_transformers_families.py): why each.
KNOWN_UNSUPPORTED: dict[str, str] = {
    "deepseek_v4": "its attention concatenates the 4-D attention mask with a bias over its compressed key/value "
                   "blocks before calling transformers' attention interface",
    "doge": "its attention folds the 4-D attention mask's values into its own dynamic mask (Doge's dynamic mask "
            "attention) before calling transformers' attention interface",
    "hy_v4": "its sparse-attention indexer reads the 4-D attention mask's values to choose the keys each query "
             "attends to",
}


def _model_type(model_class: type) -> str | None:
    return getattr(getattr(model_class, "config_class", None), "model_type", None)


def _attention_class_table(model_class: type) -> str | None:
    """The implementations of a ``*_ATTENTION_CLASSES`` dict in the class's modeling module (Falcon's
    and GIT's way of choosing attention: a name missing from it is a ``KeyError``), or None."""
    module = sys.modules.get(getattr(model_class, "__module__", ""))
    keys: set[str] = set()
    for name, value in vars(module).items() if module is not None else ():
        if name.endswith("ATTENTION_CLASSES") and isinstance(value, dict):
            keys.update(k for k in value if isinstance(k, str))
    return ", ".join(sorted(keys)) if keys else None


def unsupported_reason(model_class: type) -> str | None:
    """Why ``model_class`` cannot run selfattn as its attention, or None when it can."""
    known = KNOWN_UNSUPPORTED.get(_model_type(model_class) or "")
    if known is not None:
        return known
    table = _attention_class_table(model_class)
    if table is not None:
        return (f"its modeling file picks attention classes from a table keyed by implementation name ({table}), "
                "which has no entry for selfattn")
    if getattr(model_class, "_supports_attention_backend", False) or getattr(model_class, "_supports_flex_attn", False):
        return None
    if can_set_attn_implementation(model_class):
        return None
    return ("its attention modules compute attention themselves instead of calling transformers' attention "
            "interface (the class declares neither _supports_attention_backend nor _supports_flex_attn, and its "
            "modeling file never calls ALL_ATTENTION_FUNCTIONS.get_interface)")


def check_model_class(model_class: type, name: str) -> None:
    """Raise ``ValueError`` if ``model_class`` cannot run the attention implementation ``name``."""
    reason = unsupported_reason(model_class)
    if reason is None:
        return
    family = _model_type(model_class) or "?"
    raise ValueError(f"{model_class.__name__} (model type {family!r}) cannot use attn_implementation={name!r}: "
                     f"{reason}. Load it with attn_implementation='sdpa' (where the class supports it) or 'eager'.")

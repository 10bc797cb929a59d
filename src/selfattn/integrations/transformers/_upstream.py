"""The places where the adapter leans on torch or transformers beyond their public API.

Each is one small function, with the versions it was checked against; ``tests/test_transformers.py``
(``test_upstream_seams_are_where_they_were``) fails loudly when one of them moves.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["allow_continuous_batching", "at_end_of_backward", "can_set_attn_implementation", "getitem_as_index",
           "guard_model_checks", "packed_sequences_always_found"]


def getitem_as_index() -> contextlib.AbstractContextManager:
    """A context in which ``tensor[i]`` with a 0-dim tensor ``i`` is an index op, so that
    ``torch.vmap`` can run predicates written for scalar indices (``table[q][kv]``).

    torch 2.13: ``torch._dynamo._trace_wrapped_higher_order_op.TransformGetItemToIndex`` (what
    transformers' ``sdpa_mask(use_vmap=True)`` uses for the same predicates); there is no public
    equivalent.
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    return TransformGetItemToIndex()


def at_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass now running has finished (every gradient accumulated), as
    DistributedDataParallel does to reduce its last buckets. Call it from inside the backward (a hook).

    torch 2.13: ``torch.autograd.Variable._execution_engine.queue_callback``; there is no public
    equivalent (post-accumulate-grad hooks run per parameter, before the pass ends).
    """
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(fn)


def can_set_attn_implementation(model_class: type) -> bool:
    """transformers' own finding of whether ``model_class`` runs its attention through the
    attention interface (it reads the modeling file for ``ALL_ATTENTION_FUNCTIONS.get_interface(``).

    transformers 5.24: the classmethod ``PreTrainedModel._can_set_attn_implementation``; older
    releases without it answer False here, and the declared flags decide alone.
    """
    check = getattr(model_class, "_can_set_attn_implementation", None)
    return bool(check()) if callable(check) else False


@contextlib.contextmanager
def packed_sequences_always_found() -> Iterator[None]:
    """A context in which transformers' packed-sequence detection returns the document ids of every call it
    makes, also when every row is one sequence (all zeros where it would return None), so that each mask
    built from ``position_ids`` carries its document part whatever the positions hold.

    Context parallelism needs it: whether a model reads packed documents is a property of the model (does it
    hand ``position_ids`` to its mask functions?), but transformers only shows it when the positions it is
    given restart, and a rank's shard may hold no restart although the global row does.

    transformers 5.24: ``transformers.masking_utils.find_packed_sequence_indices(position_ids)``, called by
    name from ``_preprocess_mask_arguments`` for every mask function given ``position_ids`` (with no
    attention mask and no cache), returns None for rows of one sequence each outside torch.compile (under
    compile it already always returns the ids). The wrapper is removed when the context ends.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    @functools.wraps(original)
    def always_found(position_ids: Any) -> Any:
        ids = original(position_ids)
        return ids if ids is not None else position_ids.new_zeros(position_ids.shape)

    masking_utils.find_packed_sequence_indices = always_found
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


_GUARDED: set[str] = set()


def guard_model_checks(name: str, refuse: Callable[[type, str], None]) -> None:
    """Have transformers call ``refuse(model_class, name)`` whenever a model is built or switched
    to the attention implementation ``name``, before it is used (``refuse`` raises to refuse).

    transformers 5.24 checks a requested implementation in the public
    ``PreTrainedModel.get_correct_attn_implementation`` (at ``__init__``, through
    ``_check_and_adjust_attn_implementation``, and for every sub-model in
    ``set_attn_implementation``), which accepts any registered name; a model class that cannot
    switch implementations is skipped by ``set_attn_implementation`` with only a log line. Both
    public methods are wrapped once, for every name registered.
    """
    from transformers import PreTrainedModel

    _GUARDED.add(name)
    if getattr(PreTrainedModel.get_correct_attn_implementation, "_selfattn_guard", None) is not None:
        PreTrainedModel.get_correct_attn_implementation._selfattn_guard = refuse  # type: ignore[attr-defined]
        return

    original_get = PreTrainedModel.get_correct_attn_implementation
    original_set = PreTrainedModel.set_attn_implementation

    @functools.wraps(original_get)
    def get_correct_attn_implementation(self: Any, requested_attention: str | None, *args: Any, **kwargs: Any) -> str:
        if requested_attention in _GUARDED:
            wrapped._selfattn_guard(type(self), requested_attention)
        return original_get(self, requested_attention, *args, **kwargs)

    @functools.wraps(original_set)
    def set_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        requested = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
        if requested in _GUARDED:
            wrapped._selfattn_guard(type(self), requested)
        return original_set(self, attn_implementation, *args, **kwargs)

    wrapped: Any = get_correct_attn_implementation
    wrapped._selfattn_guard = refuse
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation  # type: ignore[method-assign]
    PreTrainedModel.set_attn_implementation = set_attn_implementation  # type: ignore[method-assign]



_BATCHING: set[str] = set()


def allow_continuous_batching(name: str) -> None:
    """Let transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) run a model
    whose attention implementation is ``name``, as it is: no switch to another implementation.

    The implementation must then do what transformers expects of a mask-free (flash-like) one: continuous
    batching packs every request of a step into one row, passes no attention mask for implementations
    other than ``paged|eager`` and ``sdpa`` (and ``create_causal_mask`` returns None for its paged cache),
    and gives each attention call ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``is_causal=True``, each
    request's causal pattern aligned to its own bottom-right corner.

    transformers 5.24: ``ContinuousBatchingManager.switch_to_cb_friendly_attn(model, auto_switch_to_flash)``,
    called when a manager is made and again when a cached one is reused, raises ``ValueError`` for any
    implementation but ``paged|eager``, ``sdpa`` and flash ones, and may switch sdpa/eager models to flash.
    The wrapper returns early for the names registered here; every other name goes to the original.
    """
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    _BATCHING.add(name)
    if getattr(ContinuousBatchingManager.switch_to_cb_friendly_attn, "_selfattn_names", None) is not None:
        return
    original = ContinuousBatchingManager.switch_to_cb_friendly_attn

    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(model.config, "_attn_implementation", None) in _BATCHING:
            return None
        return original(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn._selfattn_names = _BATCHING  # type: ignore[attr-defined]
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn  # type: ignore[method-assign]

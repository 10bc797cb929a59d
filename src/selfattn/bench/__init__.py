"""``selfattn bench``: selfattn side by side with its anchors, in one run.

Suites:
- modules: ``MultiHeadAttention`` vs ``nn.MultiheadAttention`` (need_weights=False) and the
  tutorial's MultiHeadAttention, forward and forward+backward.
- overhead: ``attention(backend="auto")`` vs calling ``scaled_dot_product_attention`` directly.
- decode: one KV-cache decode step of a 12-layer, 768-wide model from a 2k-token cache, B = 1
  and B = 8, vs projecting the new token and calling SDPA on the cached tensors; and the same step
  with a PagedKVCache (pages of 16 and 128 tokens) vs the contiguous KVCache.
- masks: masked attention from 1k to 64k tokens: selfattn (auto, chunked) vs raw SDPA (with the
  dense mask where a mask is needed), SDPA is_causal (over the whole batch, and for padded
  batches over each item's real tokens only), the tutorial's textbook math and compiled
  FlexAttention (CPU: forward only, as it has no CPU backward).
- models: a Llama-shaped transformers model trained on one packed row, selfattn vs transformers'
  sdpa and eager, time and peak memory of the attention part and of the whole step; see
  ``bench.models``. Not part of ``all`` (minutes per point at 16k tokens).
- distributed: ``selfattn.distributed.attention`` on W = 1, 2, 4 processes at a fixed total length
  (time, per-rank peak memory, communication hidden behind compute); see ``bench.distributed``.
  Not part of ``all``.
- learned: fwd+bwd with a learned term and its gradient (a T5 bucket table closed over by a score
  modifier; a dense pair bias that requires grad), 4k-16k tokens: chunked vs SDPA with the term as
  a dense bias vs the reference, time and peak memory; see ``bench.learned``. Not part of ``all``.

Each suite is a module of this package (``modules``, ``overhead``, ``decode``, ``masks``,
``distributed``, ``models``) with its grid of points (``grid``), its measurement (``run``) and its
tables (``tables``); ``runner`` runs the suites asked for, prints their tables and writes the JSON.

Every suite times the implementations of one point in turns in one process
(:func:`~selfattn.bench.timing.time_interleaved`), so all see the same machine noise; a ratio is
taken repeat by repeat and reported as its median with the min-max over the repeats
(:mod:`selfattn.bench.ratios`; in the JSON, each row's ``ratios``). For the masks suite that
process is a worker of its own per point, and each implementation's peak memory is then measured
alone in a further worker, so it is its own (see ``worker``). Results are medians (with every
repeat and their relative spread). Timing is :mod:`selfattn.bench.timing`. The README's tables
are written from the JSON by ``scripts/readme_tables.py`` (:mod:`selfattn.bench.markdown`).

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

from .runner import main

__all__ = ["main"]

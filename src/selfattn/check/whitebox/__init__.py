"""The white box: which formula the attention follows, read from the operations it ran.

:mod:`.trace` (every operation recorded, with its operands as they were), :mod:`.positions` (rotary,
normalised q/k, where a scale came from), :mod:`.projections` (Q, K, V captured from the module's
linear maps, the attention recomputed under the definition and under each known bug),
:mod:`.products` (the attention checked from its own score, softmax and value products),
:mod:`.probe` (the white-box probe that runs them).
"""

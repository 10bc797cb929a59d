"""The black-box probes: what a module's outputs say about it, from outside.

:mod:`.blackbox` (determinism, finite outputs, extreme logits, batch independence, permutation
equivariance), :mod:`.masking` (causality and windows, the mask convention, padding, masked rows),
:mod:`.numerics` (half precision, gradients). Each imports only :mod:`..findings` and
:mod:`..subject`.
"""

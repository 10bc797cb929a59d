"""The doctor's own mutation score: how many small, realistic bugs in a correct module it names.

Apart from the doctor's runtime (:mod:`selfattn.check` never imports it): :mod:`.operators` makes
the mutants (AST edits of a class's source), :mod:`.score` runs :func:`selfattn.check` on each and
counts the named, the survivors, the equivalent and the stillborn. ``selfattn check --mutate
file.py:Class`` and ``scripts/mutate.py`` (the corpus) use it.
"""

from __future__ import annotations

from .operators import Mutant, mutants
from .score import Score, main, score

__all__ = ["Mutant", "Score", "main", "mutants", "score"]

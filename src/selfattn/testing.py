"""Helpers for users' own test suites."""

from __future__ import annotations

from torch import nn

from .check import Report, check

__all__ = ["assert_attention_correct"]


def assert_attention_correct(module: nn.Module | type | str, **kwargs: object) -> Report:
    """Fail (AssertionError) with every finding of :func:`selfattn.check` if there is any.

    Example:
        >>> def test_my_attention():
        ...     selfattn.testing.assert_attention_correct(MyAttention(64), causal=True)
    """
    report = check(module, **kwargs)  # type: ignore[arg-type]
    if not report.passed:
        lines = [f"- {f.id}: {f.message}\n  evidence: {f.evidence}\n  fix: {f.fix}" for f in report.findings]
        raise AssertionError("attention module has findings:\n" + "\n".join(lines))
    return report

"""The doctor's report: its findings, what it inferred, what it could not verify, and how it prints.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .findings import DROPOUT_IN_EVAL, EXPLAINS, Finding

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["COVERED", "Finding", "Report", "Verdict", "merge", "render"]

# The properties the report's coverage always names, each "verified", "not applicable: <why>" or
# "not verified: <why>".
COVERED = ("mask", "padding", "causal", "batch_independence", "equivariance", "half_precision", "gradients",
           "white_box")


Verdict = Literal["passed", "failed", "inconclusive"]


def unseen(coverage: dict[str, str]) -> list[str]:
    """The properties of ``coverage`` the doctor did not verify, but those the user chose not to
    (``--allow-nonstandard``)."""
    return [prop for prop, state in coverage.items()
            if state.startswith("not verified") and "--allow-nonstandard" not in state]


@dataclass
class Report:
    """What :func:`selfattn.check` found.

    ``verdict``: "failed" when a finding is an error (warnings, e.g. not-equivariant, do not fail); else
    "inconclusive" when a probe could not run (it raised: the module on the doctor's input, or the doctor
    itself) or a property the module has was not verified (a mask argument no convention fits, a white box
    that cannot follow the module), since a property nobody looked at is not certified; else "passed".
    What the user chose not to verify (``--allow-nonstandard``) does not count. ``passed`` is
    ``verdict == "passed"``. ``not_verified`` maps each probe that raised to "not verified: <exception type>:
    <message>" ("not verified (doctor error): ..." when the doctor's own code raised: a doctor bug);
    ``coverage`` says for each property of :data:`COVERED` whether it was "verified", is "not applicable:
    <why>" or is "not verified: <why>"; ``seconds``: how long finding the call and each probe took.
    """

    passed: bool
    inferred: dict
    findings: list[Finding] = field(default_factory=list)
    not_verified: dict[str, str] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, inferred: dict, findings: list[Finding], not_verified: dict[str, str],
           coverage: dict[str, str], seconds: dict[str, float] | None = None) -> Report:
        """The report of these results, its verdict derived from them."""
        errors = any(f.severity == "error" for f in findings)
        return cls(passed=not errors and not not_verified and not unseen(coverage), inferred=inferred,
                   findings=findings, not_verified=not_verified, coverage=coverage, seconds=dict(seconds or {}))

    @property
    def verdict(self) -> Verdict:
        """"passed", "failed" (an error finding) or "inconclusive" (no error, but a probe could not run or a
        property was not verified)."""
        if any(f.severity == "error" for f in self.findings):
            return "failed"
        return "passed" if self.passed else "inconclusive"

    @property
    def doctor_errors(self) -> list[str]:
        """The probes that could not run because the doctor's own code raised (a doctor bug)."""
        return [p for p, why in self.not_verified.items() if why.startswith("not verified (doctor error)")]

    def to_dict(self) -> dict:
        """The report as plain data (the ``--json`` output).

        Returns:
            {"passed", "verdict", "inconclusive", "inferred", "coverage", "findings": [{"id", "severity",
            "message", "evidence", "fix"}, ...], "not_verified", "doctor_errors", "seconds"}.
        """
        return {"passed": self.passed, "verdict": self.verdict, "inconclusive": self.verdict == "inconclusive",
                "inferred": self.inferred, "coverage": self.coverage,
                "findings": [f.to_dict() for f in self.findings], "not_verified": self.not_verified,
                "doctor_errors": self.doctor_errors, "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON (values JSON cannot hold are written with ``str``)."""
        return json.dumps(self.to_dict(), indent=1, default=str)

    @property
    def ids(self) -> set[str]:
        """The ids of the findings."""
        return {f.id for f in self.findings}


def merge(findings: Iterable[Finding]) -> list[Finding]:
    """Keep the first finding of each id (a direct one before a symptom) and fold the symptoms a diagnosis explains
    into it.

    Args:
        findings: in the order the probes reported them.

    Returns:
        One finding per id, in first-reported order; an explained symptom's evidence is under
        its diagnosis' ``evidence["also seen"][symptom id]``.
    """
    by_id: dict[str, Finding] = {}
    for f in findings:
        if by_id.setdefault(f.id, f) is not f and f.direct and not by_id[f.id].direct:
            by_id[f.id] = f  # the bug itself, seen by a later probe: what the id's symptom stands for
    for fid, explained in EXPLAINS.items():
        if fid in by_id:
            for other in sorted(explained & set(by_id)):
                if by_id[other].direct and fid != DROPOUT_IN_EVAL.id:  # the bug itself, seen: no symptom of another
                    continue  # (a random module's runs alone cannot be compared)
                by_id[fid].evidence.setdefault("also seen", {})[other] = by_id.pop(other).evidence
    return list(by_id.values())


def render(report: Report, console: Console) -> None:
    """Print a readable report.

    Args:
        report: what :func:`selfattn.check` returned.
        console: a ``rich.console.Console`` to print to.
    """
    from rich.panel import Panel
    from rich.table import Table

    errors = sum(f.severity == "error" for f in report.findings)
    if report.verdict == "passed":
        status = f"[green]PASSED[/green]: no error ({len(report.findings)} warning(s))"
    elif report.verdict == "inconclusive":
        status = (f"[yellow]INCONCLUSIVE[/yellow]: no error found, but {len(report.not_verified)} probe(s) could "
                  f"not run and {len(unseen(report.coverage))} propert(y/ies) were not verified, so the module is "
                  f"not certified ({len(report.findings)} warning(s))")
    else:
        status = f"[red]{errors} error(s)[/red], {len(report.findings) - errors} warning(s)"
    inferred = Table(show_header=False, box=None)
    for k, v in report.inferred.items():
        inferred.add_row(f"[bold]{k}[/bold]", json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))
    console.print(Panel(inferred, title="what the doctor inferred"))
    unchecked = {p: s for p, s in report.coverage.items() if s.startswith("not verified")}
    coverage = Table(show_header=False, box=None)
    for prop, state in report.coverage.items():
        colour = "yellow" if prop in unchecked else "green" if state == "verified" else "dim"
        coverage.add_row(f"[bold]{prop}[/bold]", f"[{colour}]{state}[/{colour}]")
    console.print(Panel(coverage, title="coverage" + (f" [yellow]({len(unchecked)} NOT VERIFIED)[/yellow]"
                                                       if unchecked else "")))
    for f in report.findings:
        colour = "red" if f.severity == "error" else "yellow"
        body = f"{f.message}\n\n[bold]evidence[/bold]: {json.dumps(f.evidence, default=str)[:1500]}\n\n" \
               f"[bold]fix[/bold]: {f.fix}"
        console.print(Panel(body, title=f"[{colour}]{f.id}[/{colour}] ({f.severity})"))
    if report.not_verified:
        unverified = Table(show_header=False, box=None)
        for probe, why in report.not_verified.items():
            unverified.add_row(f"[bold]{probe}[/bold]", why)
        console.print(Panel(unverified, title="[yellow]probes that could not run[/yellow]"))
        status += f" [yellow]({len(report.not_verified)} probe(s) not verified)[/yellow]"
    if unchecked:
        status += f" [yellow]; not verified: {', '.join(unchecked)}[/yellow]"
    console.print(status)

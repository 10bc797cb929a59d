"""The doctor's house rules: one catalogue of finding kinds, one declared probe table, layers that import
only the layers before them, and docs written from the catalogue.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from selfattn.check import FINDING_IDS, FIXES, SEVERITY, findings
from selfattn.check.doctor import CALLING_EMITS, DOCTOR_EMITS, PROBES
from selfattn.check.report import COVERED

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "src" / "selfattn" / "check"
LAYERS = ["findings", "_seams", "subject", "probes", "whitebox", "report", "doctor", "model", "__init__"]


def _layer(path: Path) -> str:
    rel = path.relative_to(CHECK)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _sources() -> list[Path]:
    return sorted(CHECK.rglob("*.py"))


def test_every_declared_kind_is_emitted_and_every_emitter_is_declared():
    """catches: a kind in the catalogue that no probe can emit (dead, or emitted by a probe that does not say so),
    a probe declaring an id the catalogue does not have, and a property no probe covers."""
    declared = set(CALLING_EMITS) | set(DOCTOR_EMITS)
    for probe in PROBES:
        declared |= probe.emits
    assert declared == set(findings.CATALOGUE), sorted(declared ^ set(findings.CATALOGUE))
    assert all(isinstance(k, findings.Kind) for k in declared)
    assert {p.covers for p in PROBES if p.covers} | {"mask", "padding"} <= set(COVERED)
    assert set(COVERED) <= {p.covers for p in PROBES}
    names = [p.name for p in PROBES]
    assert len(set(names)) == len(names)
    given = {"out"}
    for probe in PROBES:  # a probe reads only what the module gave or an earlier probe gives
        assert set(probe.needs) <= given, (probe.name, probe.needs, given)
        if probe.gives:
            given.add(probe.gives)


def test_probes_emit_constants_of_the_catalogue_never_bare_ids():
    """catches: a finding id typed as a string in a probe (a typo is a new, undocumented id), or a constant
    emitted that the catalogue does not define."""
    ids = "|".join(map(re.escape, FINDING_IDS))
    constants = {name for name, v in vars(findings).items() if isinstance(v, findings.Kind)}
    for path in _sources():
        if path.name == "findings.py":
            continue
        text = path.read_text()
        assert not re.search(rf"[\"']({ids})[\"']", text), f"{path.relative_to(ROOT)} spells a finding id as a string"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "of" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "Finding":
                arg = node.args[0]
                assert not isinstance(arg, ast.Constant), (path.name, node.lineno)
                if isinstance(arg, ast.Name) and arg.id.isupper():
                    assert arg.id in constants, (path.name, node.lineno, arg.id)


def test_each_layer_imports_only_the_layers_before_it():
    """catches: a probe importing the white box or the report, the subject importing a probe: the layering a
    newcomer relies on to know where a fix goes."""
    for path in _sources():
        mine = LAYERS.index(_layer(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = (base / (node.module or "").replace(".", "/"))
            if not target.is_relative_to(CHECK):
                continue  # selfattn's public API, outside the doctor
            rel = target.relative_to(CHECK)
            theirs = LAYERS.index(rel.parts[0].removesuffix(".py") if rel.parts else "__init__")
            if theirs == mine:
                continue
            assert theirs < mine, f"{path.relative_to(CHECK)} imports {rel}: a later layer"


def test_the_mutation_tool_is_apart_from_the_doctor():
    """catches: the doctor's runtime importing its own mutation tool (the tool is for measuring the doctor)."""
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "mutation" not in (node.module or ""), path
            elif isinstance(node, ast.Import):
                assert not any("mutation" in a.name for a in node.names), path


def test_the_catalogue_is_consistent():
    """catches: an explained symptom that is not an id, a diagnosis absorbing a finding of an unrelated kind
    (batch-mixing swallowing a causal-leak seen beside it), and the public tables drifting from the catalogue."""
    for k in findings.CATALOGUE.values():
        assert k.explains <= set(FINDING_IDS) - {k.id}, k
        assert FIXES[k.id] == k.fix and SEVERITY[k.id] == k.severity and k.summary
    assert "causal-leak" not in findings.EXPLAINS["batch-mixing"]
    assert set(findings.EXPLAINS) <= set(FINDING_IDS)


def test_the_docs_tables_are_written_from_the_catalogue():
    """catches: a finding added to the catalogue but not to the README's table or docs/doctor.md (or the other
    way round): those tables are generated."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "doctor_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

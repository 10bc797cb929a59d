"""The doctor on the corpus of real modules (tests/doctor_corpus.py): correct ones certified, buggy ones named.

Entries the doctor does not handle yet are marked xfail(strict=True) with the reason, in
:data:`NOT_YET` (and :data:`NOT_NAMED_YET`, bugs found under another id): each flips to a failure (XPASS)
once the doctor handles it, and then leaves the table.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import doctor_corpus as dc
import pytest

ROOT = Path(__file__).resolve().parent.parent
_HAS_LIBRARIES = all(importlib.util.find_spec(m) for m in ("torchvision", "timm", "x_transformers", "vit_pytorch",
                                                           "diffusers", "open_clip"))
needs_libraries = pytest.mark.skipif(not _HAS_LIBRARIES, reason="requirements-corpus.txt is not installed")

# What the doctor gets wrong on the corpus today (measured): entry -> why. (Error ids true of a module
# that is correct in normal use are the entry's ``known``, not false alarms.)
NOT_YET: dict[str, str] = {}
# buggy entries whose bug is found but named otherwise: entry -> how
NOT_NAMED_YET: dict[str, str] = {}


def _param(name: str, table: dict[str, str] = NOT_YET) -> object:
    why = table.get(name)
    return pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=why)] if why else [])


@functools.cache
def _report(name: str):
    """The doctor's report on a corpus entry (seed 0), computed once for the tests that read it."""
    return dc.check_entry(dc.CORPUS[name])


def _errors(report) -> set[str]:
    return {f.id for f in report.findings if f.severity == "error"}


@needs_libraries
@pytest.mark.parametrize("name", [_param(n) for n in dc.CORRECT])
def test_correct_corpus_is_certified(name):
    """catches: a false alarm or a crash on a correct module as users write or import it (config classes, fixed
    windows, post-norm, q/k norm, sliding windows, KV caches, required masks, float64/bfloat16, the libraries)."""
    report = dc.check_entry(dc.CORPUS[name])
    assert _errors(report) <= dc.CORPUS[name].known, [(f.id, f.message) for f in report.findings]


@needs_libraries
@pytest.mark.parametrize("name", [_param(n) for n in dc.BUGGY])
def test_buggy_corpus_is_not_certified(name):
    """catches: a bug only a measuring probe sees (mask dropped in half precision, a wrong custom backward, a
    scale bug behind LayerNorm or without projections, one accepted mask shape wrong) certified."""
    report = _report(name)
    assert not report.passed, report.inferred


@needs_libraries
@pytest.mark.parametrize("name", [_param(n, {**NOT_YET, **NOT_NAMED_YET}) for n in dc.BUGGY])
def test_buggy_corpus_gets_its_id(name):
    """catches: such a bug reported under another id (or with side effects)."""
    report = _report(name)
    assert _errors(report) == {dc.CORPUS[name].finding}, [(f.id, f.message) for f in report.findings]


@pytest.mark.slow
@needs_libraries
@pytest.mark.parametrize("seed", range(1, 200))
@pytest.mark.parametrize("name", [_param(n) for n in dc.CORRECT])
def test_correct_corpus_200_seeds(name, seed):
    """catches: a false alarm that only some weight draws or probe inputs trigger (seed 0 is the default test)."""
    report = dc.check_entry(dc.CORPUS[name], seed=seed)
    assert _errors(report) <= dc.CORPUS[name].known, [(f.id, f.message) for f in report.findings]


def test_corpus_table_is_complete():
    """catches: a corpus entry whose class cannot be found, a buggy entry without its id, or an id the doctor
    does not have (a typo would make its test wait forever)."""
    from selfattn.check import FINDING_IDS

    assert len(dc.CORPUS) == len(dc.CORRECT) + len(dc.BUGGY)
    for name in dc.BUGGY:
        assert dc.CORPUS[name].finding, name
    unknown = {dc.CORPUS[n].finding for n in dc.BUGGY} - set(FINDING_IDS)
    # ids for measuring probes (values in half precision, gradient values) the doctor is getting
    assert unknown <= {"wrong-gradient", "half-precision-mismatch"}, unknown
    for entry in dc.CORPUS.values():
        path, _, name = entry.target.rpartition(":")
        if entry.is_file:  # read, not imported: importing is what the doctor's own tests do
            tree = ast.parse((ROOT / path).read_text())
            assert name in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, entry.name
        elif _HAS_LIBRARIES:
            assert isinstance(dc.resolve(entry.target), type), entry.name
    assert set(NOT_YET) | set(NOT_NAMED_YET) <= set(dc.CORPUS)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT / "tests", env={**os.environ, **env})


@needs_libraries
def test_transformers_imports_in_a_fresh_process():
    """catches: torchvision installed for the corpus breaking transformers' model imports in processes that do not
    run the tests' conftest (the bench's and the examples' subprocesses): the startup hook must be installed."""
    done = subprocess.run([sys.executable, "-c", "from transformers.models.llama import modeling_llama"],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]


@needs_libraries
def test_torchvision_ops_are_still_needed():
    """catches: the torchvision workaround outliving its cause. If torchvision imports on its own, its C extension
    loads (a CPU build of torchvision, or a torch it matches): delete tests/torchvision_ops.py and its calls."""
    done = _python("import torchvision", SELFATTN_NO_TORCHVISION_HOOK="1")
    assert done.returncode != 0, "torchvision imports without tests/torchvision_ops.py: remove the workaround"
    assert "torchvision::nms does not exist" in done.stderr, done.stderr[-2000:]


@needs_libraries
def test_torchvision_ops_let_the_libraries_import():
    """catches: the workaround no longer enough (another unguarded operator registration, a schema changed)."""
    done = _python("from torchvision_ops import define_torchvision_ops as d; assert d()\n"
                   "import torchvision, timm, vit_pytorch, open_clip\n"
                   "from torchvision import extension\n"
                   "print(extension._has_ops())")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_corpus_files_run_from_the_command_line():
    """catches: the corpus files not loadable as users load theirs (`selfattn check file.py:Class`), or a buggy one
    exiting other than 1 with its id."""
    done = subprocess.run([sys.executable, "-m", "selfattn.cli", "check", "tests/corpus_buggy.py:KeyMaskTransposed",
                           "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "mask-broadcast" in {f["id"] for f in json.loads(done.stdout)["findings"]}

"""The scripts run on the CPU with tiny sizes: the GPU check's logic (slow: it compiles FlexAttention), the
balance of packed rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_gpu_check_smoke_on_cpu():
    """catches: a GPU script that cannot even run its own logic (found only when a GPU is lent)."""
    script = Path(__file__).parent.parent / "scripts" / "gpu_check.py"
    res = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick"], capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "all backends within the rule" in res.stdout
    assert "document fwd" in res.stdout.replace("  ", " ").replace("  ", " ")


def test_gpu_check_says_when_there_is_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    script = Path(__file__).parent.parent / "scripts" / "gpu_check.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no CUDA device" in res.stdout


@pytest.mark.slow  # times the layouts at 2,048 tokens
def test_cp_balance_runs_and_balances():
    """catches: the balance script drifting from the API, or its balanced column above the 1.05 target."""
    script = Path(__file__).parent.parent / "scripts" / "cp_balance.py"
    res = subprocess.run([sys.executable, str(script), "--length", "16384", "--seeds", "1", "--time",
                          "--time-length", "2048", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line.split("|") for line in res.stdout.splitlines() if line.startswith("| none") or
            line.startswith("| 1024")]
    assert len(rows) == 6 and all(float(r[-2]) <= 1.05 for r in rows), res.stdout
    assert "| balanced |" in res.stdout

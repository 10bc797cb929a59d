"""The demo and bench commands run end to end and report what they measured."""

from __future__ import annotations

import json

import pytest

from selfattn.cli import main


def test_demo_runs_and_writes_the_heatmap(tmp_path, capsys):
    """catches: a demo that crashes, or claims a heatmap it did not write."""
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(32, 10, 512)" in out and "(32, 10, 10)" in out
    assert "深度" in out
    for backend in ("reference", "sdpa", "chunked"):
        assert backend in out
    assert "MISMATCH" not in out
    png = tmp_path / "attention_4_tokens.png"
    assert png.exists() and png.stat().st_size > 1000
    assert str(png) in out.replace("\n", "")


@pytest.mark.slow  # multi-process or bench workers: run with -m slow
def test_bench_masks_smoke(tmp_path):
    """catches: a bench that reports numbers it did not measure (every point must carry its
    own time, from one worker that times its implementations interleaved, and its own peak
    memory, measured in a worker process of its own)."""
    path = tmp_path / "r.json"
    rc = main(["bench", "--suite", "masks", "--cases", "sliding_window(256)", "--lengths", "512",
               "--impls", "chunked", "sdpa", "textbook", "--modes", "fwd+bwd", "--repeats", "2",
               "--json", str(path), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    data = json.loads(path.read_text())
    rows = data["results"]
    assert len(rows) == 3
    for r in rows:
        assert r["status"] == "ok", r
        assert r["time_s"] > 0 and len(r["times"]) >= 1
        assert r["peak_bytes"] >= 0
        if r["impl"] != "sdpa":  # a ratio to the anchor, per repeat of the same interleaved run
            assert r["ratios"]["sdpa"]["n"] == len(r["times"])
    # the textbook code keeps the (8, 512, 512) float32 score matrix alive: at least 8 MiB
    tb = [r for r in rows if r["impl"] == "textbook" and r["mode"] == "fwd+bwd"]
    assert all(r["peak_bytes"] > 8 * 2**20 for r in tb)
    assert (tmp_path / "plots" / "time.png").exists() and (tmp_path / "plots" / "memory.png").exists()


def test_bench_rejects_unknown_case():
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "masks", "--cases", "nope"])

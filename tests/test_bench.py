"""The bench's interleaved ratios, its masks cases and the README tables written from its JSON.

Tiny sizes only: these check what is measured and how it is reported, never how fast anything is.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from selfattn.bench import markdown, worker
from selfattn.bench.ratios import attach_ratios, format_ratio, ratio_stats
from selfattn.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- ratios


def test_ratio_is_taken_repeat_by_repeat():
    """catches: a ratio of two medians reported as if it had a spread, or the spread of one
    implementation's times passed off as the ratio's."""
    stats = ratio_stats([2.0, 3.0, 8.0], [2.0, 2.0, 10.0])  # per repeat: 1.0, 1.5, 0.8
    assert stats == {"median": 1.0, "min": 0.8, "max": 1.5, "n": 3}
    assert format_ratio(stats) == "1.00x (0.80-1.50)"
    unpaired = ratio_stats([2.0, 4.0], [1.0, 2.0, 3.0])  # different runs: ratio of medians, no spread
    assert unpaired == {"median": 1.5, "min": 1.5, "max": 1.5, "n": 0} and format_ratio(unpaired) == "1.50x (unpaired)"
    assert ratio_stats([], [1.0]) is None and format_ratio(None) == ""
    assert format_ratio(ratio_stats([3.0], [2.0])) == "1.50x (1 run)"  # no spread to show, and it says so


def test_attach_ratios_only_within_one_point():
    rows = [dict(suite="masks", case="c", mode="fwd", L=8, impl=i, status="ok", times=t)
            for i, t in (("selfattn", [1.0, 2.0]), ("sdpa", [2.0, 2.0]), ("flex", [4.0, 4.0]))]
    rows.append(dict(suite="masks", case="c", mode="fwd", L=16, impl="sdpa", status="ok", times=[1.0, 1.0]))
    rows.append(dict(suite="masks", case="c", mode="fwd", L=16, impl="chunked", status="error"))
    attach_ratios(rows, "masks", ("case", "mode", "L"), ("sdpa", "flex"))
    assert rows[0]["ratios"] == {"sdpa": ratio_stats([1.0, 2.0], [2.0, 2.0]),
                                 "flex": ratio_stats([1.0, 2.0], [4.0, 4.0])}
    assert set(rows[1]["ratios"]) == {"flex"}  # no ratio of an anchor to itself
    assert rows[3]["ratios"] == {} and "ratios" not in rows[4]


# ----------------------------------------------------------------------------- masks suite


@pytest.mark.parametrize("case,lengths", [("padding(3L/4)+causal", [48]), ("padding(3L/4,L)+causal", [48, 64])])
def test_padded_cases_are_keys_only_with_the_tracked_lengths(case, lengths):
    """catches: the tracked padded batches built with other lengths, or padding the queries too."""
    mc = worker.mask_case(case, 64, "cpu")
    assert mc.batch == len(lengths) == worker.case_batch(case)
    assert mc.lengths is not None and mc.lengths.tolist() == lengths
    dense = mc.mask.dense(64, 64, "cpu")  # (B, 1, L, L)
    for b, n in enumerate(lengths):
        want = torch.ones(64, 64, dtype=torch.bool).tril() & (torch.arange(64) < n)
        assert torch.equal(dense[b, 0], want)
        flex = mc.mask_mod(torch.tensor(b), 0, torch.arange(64)[:, None], torch.arange(64))
        assert torch.equal(flex, want)


def test_varlen_case_implementations_compute_the_same_attention():
    """catches: a varlen anchor that does less (or other) work than varlen_attention: padded documents
    cut wrongly, a document mask that is not the packing, outputs in another layout."""
    case = worker.mask_case(worker.VARLEN, 200, "cpu")
    assert case.cu_seqlens is not None and case.cu_seqlens[-1] == 200 and len(case.cu_seqlens) == worker.DOCS + 1
    spec = dict(case=worker.VARLEN, L=200, H=2, D=8, device="cpu", dtype="float64", mode="fwd", impl="textbook")
    _, (q, k, v) = worker._attention_step(spec, small=False)
    want = worker._varlen_impl("textbook", q, k, v, case)()[0]  # (H, L, D)
    for impl in ("selfattn", "chunked", "document", "sdpa", "sdpa-padded"):
        out = worker._varlen_impl(impl, q, k, v, case)()
        out = out.transpose(0, 1) if impl in ("selfattn", "chunked") else out.reshape(want.shape)
        torch.testing.assert_close(out, want, msg=impl)


def test_time_group_times_every_impl_in_the_same_rounds():
    """catches: implementations of one point timed in separate runs (their ratio would mix two
    runs' noise), or one failing implementation taking the others down."""
    spec = dict(suite="masks", case="padding(3L/4,L)+causal", mode="fwd+bwd", L=64, H=2, D=8, device="cpu",
                dtype="float32", repeats=4, seconds=5.0, impls=["selfattn", "chunked", "nope", "sdpa-causal-valid"])
    res = worker.time_group(spec)
    assert list(res) == spec["impls"]
    assert "error" in res["nope"] and "nope" in res["nope"]["error"]
    for impl in ("selfattn", "chunked", "sdpa-causal-valid"):
        assert len(res[impl]["times"]) == 4 and res[impl]["first_s"] > 0, res[impl]


def test_bench_masks_times_a_point_in_one_worker_and_memory_in_one_each(tmp_path, capsys, monkeypatch):
    """catches: implementations of a point timed in separate processes (the ratio would mix two
    processes' noise), peak memory not measured per implementation, or ratios in the JSON and
    the table that are not per repeat of that one interleaved run. The workers run in this
    process here (tests/test_cli.py runs them as real subprocesses)."""
    from selfattn.bench import masks as bench_masks

    specs: list[dict] = []

    def fake_worker(spec: dict) -> dict:
        specs.append(spec)
        if "impls" in spec:
            return worker.time_group(spec)
        return {"peak_bytes": 1000 + len(specs), "first_s": 0.0}

    monkeypatch.setattr(bench_masks, "run_worker", fake_worker)
    path = tmp_path / "r.json"
    rc = main(["bench", "--suite", "masks", "--cases", "padding(3L/4)+causal", "--lengths", "64", "--modes", "fwd",
               "--impls", "selfattn", "sdpa-causal", "flex-nope", "--repeats", "3", "--json", str(path)])
    assert rc == 1  # the unknown implementation is an error row; the others are measured
    assert [s.get("impls") for s in specs] == [["selfattn", "sdpa-causal", "flex-nope"], None, None]
    assert [s.get("impl") for s in specs[1:]] == ["selfattn", "sdpa-causal"]  # memory: one worker each
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    assert [(r["impl"], r["status"]) for r in rows] == [("selfattn", "ok"), ("sdpa-causal", "ok"),
                                                       ("flex-nope", "error")]
    ours, anchor, _ = rows
    assert len(ours["times"]) == len(anchor["times"]) == 3
    assert (ours["peak_bytes"], anchor["peak_bytes"]) == (1002, 1003)
    assert ours["ratios"]["sdpa-causal"] == ratio_stats(ours["times"], anchor["times"])
    assert anchor["ratios"] == {}
    assert format_ratio(ours["ratios"]["sdpa-causal"]) in out
    assert "x is_causal" in out


def test_decode_anchor_computes_what_the_module_computes():
    """catches: a decode anchor that does less (or other) work than the module it is compared
    with: a wrong slot, a missed projection, keys it should see left out."""
    import selfattn
    from selfattn.bench.decode import decode_steps, paged_copies

    torch.manual_seed(0)
    b, e, h, cached = 3, 32, 4, 10
    mods = [selfattn.MultiHeadAttention(e, h).eval() for _ in range(2)]
    caches = [selfattn.KVCache(b, cached + 4, h, e // h) for _ in range(2)]
    with torch.no_grad():
        for m, c in zip(mods, caches, strict=True):
            m(torch.randn(b, cached, e), cache=c, positions=torch.arange(cached).expand(b, -1))
        paged = {"paged-3": paged_copies(caches, cached, 3)}
        steps = decode_steps(mods, caches, torch.randn(b, 1, e), cached, paged)
        torch.testing.assert_close(steps["selfattn"](), steps["sdpa"]())
        for _ in range(2):  # the paged step leaves its caches as it found them
            torch.testing.assert_close(steps["paged-3"](), steps["selfattn"]())
        assert [c.length(s) for c in paged["paged-3"] for s in c.sequences] == [cached] * 2 * b


def test_bench_decode_reports_both_batches_with_spread(tmp_path):
    path = tmp_path / "d.json"
    assert main(["bench", "--suite", "decode", "--quick", "--repeats", "3", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["results"]
    assert sorted({r["B"] for r in rows}) == [1, 8]
    for r in rows:
        if r["impl"] == "selfattn":
            assert r["ratios"]["sdpa"]["n"] == 3


# ----------------------------------------------------------------------------- README tables


def _row(suite: str, impl: str, times: list[float], **fields) -> dict:
    return dict(suite=suite, impl=impl, status="ok", times=times, time_s=sorted(times)[len(times) // 2],
                **fields)


def _fixture() -> dict:
    """A small bench JSON: every suite the README blocks read, with times chosen so each ratio is
    known by hand."""
    rows = []
    for mode, ours, torch_, tut in (("fwd", [1.0, 1.0, 1.0], [2.0, 2.0, 1.0], [3.0, 4.0, 3.0]),
                                    ("fwd+bwd", [2.0, 2.0, 2.0], [2.0, 2.5, 1.0], [6.0, 6.0, 6.0])):
        for impl, t in (("selfattn", ours), ("torch", torch_), ("tutorial", tut)):
            rows.append(_row("modules", impl, t, B=2, L=64, E=32, H=4, mode=mode))
    for case in ("none", "causal"):
        rows.append(_row("overhead", "selfattn", [1.0, 1.1], case=case, mode="fwd", L=4096, B=1, H=8, D=64))
        rows.append(_row("overhead", "sdpa", [1.0, 1.0], case=case, mode="fwd", L=4096, B=1, H=8, D=64))
    for b in (1, 8):
        rows.append(_row("decode", "selfattn", [0.020, 0.021, 0.019], case="12x768, cache 2048", B=b,
                         mode="decode step", L=2048))
        rows.append(_row("decode", "sdpa", [0.020, 0.020, 0.020], case="12x768, cache 2048", B=b,
                         mode="decode step", L=2048))
    masks = {  # case -> impl -> (fwd times, fwd+bwd times, peak MiB)
        "causal": {"selfattn": ([0.1, 0.1], [0.3, 0.3], 10), "chunked": ([0.12, 0.11], [0.4, 0.4], 12),
                   "sdpa": ([0.1, 0.1], [0.3, 0.3], 10), "flex": ([0.2, 0.2], None, 20)},
        "padding(3L/4,L)+causal": {"selfattn": ([0.2, 0.2], [0.5, 0.6], 30), "sdpa": ([0.8, 1.0], [2.0, 2.0], 300),
                                   "sdpa-causal": ([0.2, 0.25], [0.5, 0.5], 20),
                                   "sdpa-causal-valid": ([0.1, 0.1], [0.4, 0.4], 15)},
    }
    for length in (512, 1024):
        for case, impls in masks.items():
            for impl, (fwd, bwd, mib) in impls.items():
                for mode, t in (("fwd", fwd), ("fwd+bwd", bwd)):
                    base = dict(case=case, mode=mode, L=length, H=8, D=64)
                    if t is None:
                        rows.append(dict(suite="masks", impl=impl, status="skipped", note="no CPU backward", **base))
                    else:
                        scale = length / 512
                        rows.append(_row("masks", impl, [x * scale for x in t], peak_bytes=mib * 2**20, **base))
    meta = dict(torch="2.13.0+cpu", device="cpu", dtype="float32", cpus=2, date="2026-12-01 00:00:00")
    return {"meta": meta, "results": rows}


README_TEXT = """# title

text before
<!-- bench:modules -->
old modules table
<!-- /bench:modules -->
between
<!-- bench:decode -->
old decode table
<!-- /bench:decode -->
<!-- bench:masks -->
old masks
<!-- /bench:masks -->
<!-- bench:masks-targets -->
<!-- /bench:masks-targets -->
<!-- bench:distributed -->
kept: no data for it
<!-- /bench:distributed -->
text after
"""


def _outside(text: str) -> list[str]:
    return re.split(r"<!-- bench:[\w-]+ -->\n.*?<!-- /bench:[\w-]+ -->", text, flags=re.S)


def test_readme_tables_round_trip(tmp_path, capsys):
    """catches: README tables that do not follow the JSON (a ratio that is not the JSON's, lost
    spreads), a rewrite that touches text outside its markers, or one that changes on a rerun."""
    data = tmp_path / "bench.json"
    data.write_text(json.dumps(_fixture()))
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    script = _script()
    assert script.main([str(data), "--readme", str(readme), "--length", "512"]) == 0
    once = readme.read_text()
    assert _outside(once) == _outside(README_TEXT)
    assert "kept: no data for it" in once and "old masks" not in once and "old modules table" not in once
    assert "overhead" in capsys.readouterr().err  # a block with data but no markers is reported
    # rerun: nothing changes, and --check agrees
    assert script.main([str(data), "--readme", str(readme), "--length", "512"]) == 0
    assert readme.read_text() == once
    assert script.main([str(data), "--readme", str(readme), "--length", "512", "--check"]) == 0
    assert script.main([str(data), "--readme", str(readme), "--length", "1024", "--check"]) == 1

    lines = once.splitlines()
    modules = next(x for x in lines if "(B, L, E, H) = (2, 64, 32, 4)" in x)
    assert "| 0.50x (0.50-1.00) | 1.00x (0.80-2.00) | <= 1.0x |" in modules  # ours / torch, per repeat
    assert "| 3.00x (3.00-4.00) | 3.00x (3.00-3.00) | >= 1.8x |" in next(x for x in lines if "tutorial" in x)
    decode = next(x for x in lines if x.startswith("| decode step"))
    assert "1.00x (0.95-1.05); 20.0 ms vs 20.0 ms" in decode
    causal = next(x for x in lines if x.startswith("| causal |"))
    assert causal == ("| causal | 100 ms / 300 ms | - | - | 1.00x (1.00-1.00) / 1.00x (1.00-1.00) | "
                      "0.50x (0.50-0.50) | 10 / - / 10 |")
    chunked = next(x for x in lines if x.startswith('| causal, backend="chunked"'))
    assert "1.15x (1.10-1.20) / 1.33x (1.33-1.33)" in chunked and "0.57x (0.55-0.60)" in chunked
    padded = next(x for x in lines if x.startswith("| padding(3L/4,L)+causal |"))
    assert "| 1000 ms / 2000 ms |" in padded  # the dense-mask SDPA anchor's medians (as the fixture gives them)
    assert "4.50x (4.00-5.00) / 3.67x (3.33-4.00)" in padded  # speed-up: its time / ours
    assert "30 / 300 / 20 |" in padded
    targets = "\n".join(lines)
    assert "padding(3L/4,L)+causal 1.50x" in targets  # peak vs SDPA is_causal
    assert "padding(3L/4,L)+causal: 2.00x (2.00-2.00) fwd, 1.38x (1.25-1.50) fwd+bwd" in targets
    assert '| L = 1024, fwd+bwd, backend="chunked" | causal 0.8 s; peak at most 0.0 GiB |' in targets


def test_readme_has_a_marked_block_for_every_table_the_script_writes():
    """catches: README markers renamed or lost, so a regenerated table would silently not land."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in markdown.BLOCKS:
        assert text.count(f"<!-- bench:{name} -->") == 1 and text.count(f"<!-- /bench:{name} -->") == 1, name
    assert markdown.rewrite(text, {}) == (text, [])


def test_models_training_step_attends_within_the_packed_documents(monkeypatch):
    """catches: the models suite's training step called with a cache (transformers' default use_cache), so that
    transformers did not read the packed documents and every point measured full causal attention instead."""
    pytest.importorskip("transformers")
    from selfattn import functional
    from selfattn.bench.models import model_step

    seen: list[str] = []
    real = functional.attention

    def spy(*args, **kwargs):
        seen.append(repr(kwargs.get("mask")))
        return real(*args, **kwargs)
    monkeypatch.setattr(functional, "attention", spy)
    step, _ = model_step("selfattn", 512)  # above the size at which the adapter passes a small mask dense
    step()
    assert seen and all("document" in m for m in seen), seen


def test_distributed_model_points_and_their_tables():
    """catches: the model points missing from the distributed suite's grid, a budget point whose length is not
    W x the tokens per rank, or tables (terminal and README) that compare a point with another length's W = 1."""
    import argparse

    from selfattn.bench import distributed

    args = argparse.Namespace(cases=["model", "model-budget"], lengths=[1024], quick=False, repeats=None)
    todo = distributed.grid(args)
    assert {(p["part"], p.get("memory"), p["L"], p["W"]) for p in todo if "per_rank" not in p} == {
        (part, memory, 1024, w) for part, memory in (("attention", "overlap"), ("attention", "low"), ("model", None))
        for w in (1, 2, 4)}
    assert sorted((p["W"], p["L"]) for p in todo if "per_rank" in p) == [(1, 1024), (2, 2048), (4, 4096)]
    with pytest.raises(SystemExit, match="divisible"):
        distributed.grid(argparse.Namespace(cases=["model"], lengths=[1020], quick=False, repeats=None))
    mib = 2**20
    results = [{**p, "status": "ok", "time_s": 1.0 / p["W"], "first_s": 1.0, "peak_bytes": 100 * mib // p["W"]}
               for p in todo]
    assert [t.row_count for t in distributed.tables(results)] == [9, 3]
    text = markdown.blocks(results)["distributed-model"]
    assert "| model | 1024 | 4 | 0.2 s | 0.25x | 25 MiB | 0.25x | 0.30x |" in text
    assert "| attention (memory=low) | 1024 | 2 | 0.5 s | 0.50x | 50 MiB | 0.50x | 0.60x |" in text
    assert "| 1024 | 4 | 4096 | 25 MiB | 0.25x |" in text


def test_decode_grid_takes_batches_contexts_and_skips_what_cannot_fit():
    """catches: a decode point whose caches cannot fit in memory allocated anyway (the machine swaps or
    dies) instead of reported as skipped, with its reason."""
    import argparse

    from rich.progress import Progress

    from selfattn.bench import decode

    args = argparse.Namespace(device="cpu", dtype="float32", quick=False, repeats=1, page_sizes=[16],
                              lengths=[10**7], batches=[64])
    points = decode.grid(args)
    assert points == [dict(B=64, L=10**7)]
    with Progress() as progress:
        rows = decode.run(points, args, progress, progress.add_task("decode", total=1))
    assert {r["impl"] for r in rows} == {"selfattn", "sdpa", "paged-16"}
    assert all(r["status"] == "skipped" and "GiB of caches" in r["note"] for r in rows)


def test_learned_suite_steps_reach_the_terms_gradient_and_agree():
    """catches: a learned-term benchmark whose implementations compute different things (the dense
    bias built from the table wrongly), or a step that skips the term's gradient (timing less work)."""
    from selfattn.bench import learned

    for case in learned.CASES:
        steps = learned._steps(case, 64, learned.IMPLS)
        results = {impl: step() for impl, step in steps.items()}
        for impl in ("chunked", "sdpa"):
            for got, want in zip(results[impl], results["reference"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    spec = dict(case="t5 buckets", L=64, impls=learned.IMPLS, repeats=1)
    assert set(learned.worker(spec)) == set(learned.IMPLS)

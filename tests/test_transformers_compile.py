"""selfattn inside compiled transformers models: one graph per shape, and eager's tokens and gradients.

``generate()`` with a static cache builds each step's masks outside the compiled forward and
passes them in, so a mask whose structure changed with the step (an offset kept as a Python
number) would recompile the forward at every token. Graphs are counted with a backend that
records each compilation (dynamo only, no code generation, to keep the tests cheap), against
transformers' own eager attention under the same settings: Llama, Qwen 2 and GPT-2 compile
once with ``dynamic=False``; the sliding-window families (Mistral, Gemma 2, gpt-oss) compile
exactly as often as eager does, which is twice, because transformers' sliding static cache
keeps its length as a Python int (a recompile that makes it dynamic, then none).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import NAME, ORACLE, build  # noqa: E402

from selfattn.testing import GRADIENT_FACTOR, compare_to_reference  # noqa: E402

NEW_TOKENS = 12  # more steps than dynamo's default recompile limit (8): recompiling per token fails


def _compile_config(graphs: list, dynamic: bool | None) -> transformers.CompileConfig:
    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list, **options: object) -> object:
        graphs.append(gm)
        return gm.forward
    config = transformers.CompileConfig(fullgraph=True, dynamic=dynamic, backend=counting_backend)
    config._compile_all_devices = True  # transformers 5.24: generate() compiles on a CPU only with this flag
    return config


def _generate(model, prompt: dict, graphs: list, dynamic: bool | None) -> torch.Tensor:
    torch.compiler.reset()
    return model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          cache_implementation="static", compile_config=_compile_config(graphs, dynamic))


CASES = [pytest.param("llama", False, id="llama"), pytest.param("mistral", None, id="mistral", marks=pytest.mark.slow),
         pytest.param("qwen2", False, id="qwen2", marks=pytest.mark.slow),
         pytest.param("gpt2", False, id="gpt2", marks=pytest.mark.slow),
         pytest.param("gemma2", None, id="gemma2", marks=pytest.mark.slow),
         pytest.param("gpt_oss", None, id="gpt_oss", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("model", "dynamic"), CASES)
def test_static_cache_generation_compiles_once_per_shape(model, dynamic):
    """catches: the static-cache mask captured a Python offset (or changed structure with the
    step), so the compiled forward recompiled at every new token (FailOnRecompileLimitHit with
    fullgraph), and the tokens differing from eager's."""
    ours, naive = build(model, NAME, experts="grouped_mm"), build(model, "eager", experts="grouped_mm")
    naive.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(5)
    prompt = dict(input_ids=torch.randint(1, 100, (2, 10), generator=g),
                  attention_mask=torch.ones(2, 10, dtype=torch.long))
    prompt["attention_mask"][1, :3] = 0  # left padding
    want = naive.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    ours_graphs: list = []
    got = _generate(ours, prompt, ours_graphs, dynamic)
    assert torch.equal(got, want)
    if dynamic is False:
        assert len(ours_graphs) == 1
    else:  # as many as eager needs under the same settings
        eager_graphs: list = []
        _generate(naive, prompt, eager_graphs, dynamic)
        assert len(ours_graphs) == len(eager_graphs), (len(ours_graphs), len(eager_graphs))


@pytest.mark.parametrize("model", ["llama", pytest.param("mistral", marks=pytest.mark.slow)])
def test_training_step_compiles_fullgraph(model):
    """catches: the mask carrier not traceable (dynamo cannot trace Tensor._make_wrapper_subclass:
    graph breaks, and fullgraph=True fails), and compiled gradients that differ from eager's."""
    ref, naive, ours = build(model, ORACLE, torch.float64), build(model, "eager"), build(model, NAME)
    naive.load_state_dict(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 100, (2, 24), generator=g)
    am = torch.ones(2, 24, dtype=torch.long)
    am[1, 15:] = 0
    torch.compiler.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    grads = []
    for m, run in ((ref, ref), (naive, naive), (ours, compiled)):
        m.zero_grad()
        run(input_ids=ids, attention_mask=am, labels=ids).loss.backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    assert grads[2].keys() == grads[0].keys()
    for key in grads[0]:
        result = compare_to_reference(grads[2][key], grads[0][key], grads[1][key], factor=GRADIENT_FACTOR, name=key)
        assert result.ok, str(result)


_PACKED_COMPILE = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from hf_oracle import NAME, build
model = build("llama", NAME, torch.float64)
ids = torch.randint(1, 100, (2, 24), generator=torch.Generator().manual_seed(3))
pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
grads = []
for run in (model, compiled):
    model.zero_grad()
    loss = run(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    grads.append({{k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}})
worst = max(float((grads[1][k] - g).abs().max() / g.abs().max()) for k, g in grads[0].items() if g.abs().max() > 0)
print(json.dumps({{"keys": sorted(grads[0]) == sorted(grads[1]), "worst": worst}}))
"""


@pytest.mark.slow  # a fresh process compiling a model
def test_packed_training_forward_compiles_fullgraph_in_a_fresh_process():
    """catches: dynamo failing on transformers' packed-sequence predicates (position_ids[b, q] with a symbolic
    index: InternalTorchDynamoError NameError '___tuple_iterator_getitem'), which showed only in a process's first
    compile, so it runs in a process of its own."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = _PACKED_COMPILE.format(tests=str(Path(__file__).resolve().parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["keys"] and result["worst"] < 1e-12, result

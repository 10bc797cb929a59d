"""Context parallelism through the transformers adapter: ``context_parallel`` on W gloo processes gives the loss
and every parameter gradient of the single-process model on the gathered batch.

Families: Llama (GQA, rotary), Qwen2, Mistral (sliding window), Gemma 2 (soft-capping, alternating sliding and
full layers, query_pre_attn_scalar), gpt-oss (sinks, alternating layers); batches with packed documents (global
position_ids restart) and with padding (a global attention mask). float64, tiny random configs. Each test spawns
W processes that run their cases and write the errors; the test judges them.

Shape legend: B batch, L the global length, W the world size.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import traceback
import weakref
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from selfattn.bench.spawn import free_port, spawn_and_join

FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt_oss")
L = 24  # divisible by 2W for W = 1..4
# The loss goes through transformers' float32 cross-entropy (logits.float()): summed in another order on W
# ranks it differs in float32's last bits; the gradients reach the float64 model through per-token float32
# terms computed alike, and agree to float64 rounding.
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-9
# Gemma 2's RMSNorm computes in float32 even for a float64 model (x.float()): its gradients are float32's.
FLOAT32_INSIDE = {"gemma2": 1e-5}



def _entry(rank: int, fn_name: str, world: int, port: int, outdir: str, args: dict) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = globals()[fn_name](rank, world, **args)
        Path(outdir, f"{rank}.json").write_text(json.dumps(result))
        code = 0
    except BaseException:
        Path(outdir, f"{rank}.err").write_text(traceback.format_exc())
    finally:
        os._exit(code)


def _spawn(fn_name: str, world: int, tmp_path: Path, limit: float = 300.0, **args: object) -> list[dict]:
    outdir = tmp_path / f"{fn_name}-{world}-{len(list(tmp_path.iterdir()))}"
    outdir.mkdir()
    done = spawn_and_join(_entry, (fn_name, world, free_port(), str(outdir), args), world, limit)
    errors = {r: (outdir / f"{r}.err").read_text() for r in range(world) if (outdir / f"{r}.err").exists()}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert done, f"{fn_name} on {world} ranks: a process died without a result, or ran past {limit} s"
    return [json.loads((outdir / f"{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- run in the workers


def _model(family: str, seed: int = 0):
    import transformers

    from selfattn.integrations import transformers as sa_hf

    sa_hf.register()
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    extra: dict = {}
    if family == "llama":
        config = transformers.LlamaConfig(**common)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=5)
    elif family == "opt":  # positions from the attention mask (cumsum(mask) - 1) when none are given
        config = transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                        vocab_size=64, max_position_embeddings=128, word_embed_proj_dim=32,
                                        dropout=0.0)
    elif family == "gpt2":  # a learned table of absolute positions (no row for -1)
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=128,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif family == "roberta":  # positions from the token ids (padding_idx + 1 + count of non-pad tokens)
        config = transformers.RobertaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, vocab_size=64, max_position_embeddings=128,
                                            is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    elif family == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, sliding_window=5, query_pre_attn_scalar=8,
                                           attn_logit_softcapping=1.0, final_logit_softcapping=None)
    else:
        config = transformers.GptOssConfig(**common, head_dim=8, sliding_window=5, num_local_experts=2,
                                           num_experts_per_tok=1)
        extra = {"experts_implementation": "eager"}  # the grouped-mm experts take no float64
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="selfattn",
                                                          dtype=torch.float64, **extra)


def _batch(case: str, seed: int = 1) -> dict:
    """A global batch of 2 rows: packed documents (position_ids restart), documents of L / 2 tokens ("aligned":
    every boundary on the contiguous layout's shard boundary at W = 2), or padding in row 1 on the right
    ("padding") or on the left ("left"), with no position_ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (2, L), generator=g)  # 1 is RoBERTa's padding token
    labels = ids.clone()
    if case == "packed-odd":  # a length no layout divides: padded inside, exact
        pos = torch.cat([torch.arange(n) for n in (7, 9, 5)]).expand(2, 21).clone()
        pos[1] = torch.cat([torch.arange(n) for n in (13, 8)])
        return dict(input_ids=ids[:, :21], position_ids=pos, labels=labels[:, :21], use_cache=False)
    if case in ("packed", "aligned"):
        pos = torch.cat([torch.arange(n) for n in (7, 9, 8)]).expand(2, L).clone()
        pos[1] = torch.cat([torch.arange(n) for n in (13, 11)])
        if case == "aligned":
            pos = torch.arange(L // 2).repeat(2).expand(2, L)
        labels[0, 3] = -100
        return dict(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)  # packed rows train without a
    mask = torch.ones(2, L, dtype=torch.long)                                           # cache (transformers reads
    padded = slice(L - 5, L) if case == "padding" else slice(0, 5)                     # documents only then)
    mask[1, padded] = 0
    labels[1, padded] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / max(1e-300, float(b.double().abs().max())))


def _grad_error(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """The largest relative error of a parameter gradient against one process's, over the parameters whose
    gradient is not zero in exact arithmetic: a key projection's bias (the softmax is blind to it, OPT and RoBERTa
    have one) gets rounding noise, below 1e-12 of the largest gradient, on both sides."""
    grads = dict(model.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    return max(_rel(grads[n].grad, p.grad) for n, p in ref.named_parameters()
               if p.grad is not None and float(p.grad.abs().max()) > 1e-12 * scale)


def exact_worker(rank: int, world: int, families: list[str], cases: list[str], combos: list[list[str]],
                 steps: int = 1) -> dict:
    """For each family x case x (layout, strategy): the CP model's loss and gradients against one process's
    (over ``steps`` SGD steps when steps > 1: the weights after them)."""
    from selfattn.integrations.transformers import context_parallel

    out: dict = {}
    for family in families:
        for case in cases:
            batch = _batch(case)
            for layout, strategy, *memory in combos:
                if strategy == "all_to_all" and 2 % world:  # 2 kv heads split across the ranks
                    continue
                ref, cp_model = _model(family), _model(family)
                opt_ref, opt_cp = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, cp_model))
                errors: dict = {"loss": 0.0, "grad": 0.0}
                for _ in range(steps):
                    opt_ref.zero_grad()
                    opt_cp.zero_grad()
                    ref_out = ref(**batch)
                    ref_out.loss.backward()
                    with context_parallel(cp_model, layout=layout, strategy=strategy,
                                          memory=(memory or ["overlap"])[0]) as cp:
                        cp_out = cp_model(**cp.shard(**batch))
                        cp_out.loss.backward()
                        logits = cp.unshard(cp_out.logits.detach())  # (B, L, V): the padding dropped
                    ref_loss, loss = ref_out.loss, cp_out.loss
                    errors["loss"] = max(errors["loss"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
                    errors["logits"] = max(errors.get("logits", 0.0), _rel(logits, ref_out.logits.detach()))
                    errors["grad"] = max(errors["grad"], _grad_error(cp_model, ref))
                    opt_ref.step()
                    opt_cp.step()
                if steps > 1:
                    cp_weights = dict(cp_model.named_parameters())
                    errors["weights"] = max(_rel(cp_weights[n].detach(), p.detach()) for n, p in ref.named_parameters())
                out["/".join([family, case, layout, strategy, *memory])] = errors
    return out


def _judge(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res, "no case ran"
        bad = {k: e for k, e in res.items() if max(e["loss"], e["logits"]) > LOSS_RTOL or
               max(e["grad"], e.get("weights", 0.0)) > FLOAT32_INSIDE.get(k.split("/")[0], GRAD_RTOL)}
        assert not bad, f"rank {rank}: {bad}"


def test_every_family_matches_one_process_on_two_ranks(tmp_path):
    """catches: a mask built from the local shard instead of the global sequence (causal offsets, windows,
    packed documents, padding), rotary positions from local indices, labels shifted inside a shard, a loss
    that is not the global mean, gradients not summed over the group, sinks or soft-capping lost, and the ring's
    memory="low" backward not reaching the model's attention or losing a block's dK/dV."""
    _judge(_spawn("exact_worker", 2, tmp_path, families=list(FAMILIES), cases=["packed", "padding"],
                  combos=[["zigzag", "ring"], ["contiguous", "all_to_all"], ["zigzag", "ring", "low"]]))


def test_balanced_layout_and_rows_of_any_length(tmp_path):
    """catches: a balanced layout computed differently on the ranks (the agreement refuses it) or from the shard,
    a row no layout divides refused or padded into the loss (labels, the padding's keys), and cp.unshard keeping
    the padding or the chunks out of order."""
    _judge(_spawn("exact_worker", 2, tmp_path, families=["llama", "mistral", "gpt_oss"],
                  cases=["packed", "packed-odd", "padding"],
                  combos=[["balanced", "ring"], ["balanced", "all_to_all"], ["zigzag", "ring"]]))


def test_global_decisions_are_made_from_the_global_batch(tmp_path):
    """catches: whether the model reads packed documents decided from each rank's shard (documents whose boundaries
    all fall on shard boundaries: no rank sees a restart, the document mask dropped), and positions a model derives
    from the attention mask (OPT's cumsum(mask) - 1) replaced by 0 .. L-1 under left padding."""
    _judge(_spawn("exact_worker", 2, tmp_path, families=[*FAMILIES, "opt", "gpt2"], cases=["aligned", "left"],
                  combos=[["contiguous", "ring"]]))


def refused_positions_worker(rank: int, world: int) -> dict:
    """A model deriving its positions from the token ids: refused without position_ids, exact with them; rotary
    frequencies that depend on the length, refused past it."""
    import transformers

    from selfattn.integrations.transformers import context_parallel

    def refusal(model, *batches: dict) -> str | None:
        """cp.shard's ValueError for these batches, or None when it takes them."""
        try:
            with context_parallel(model) as cp:
                for batch in batches:
                    cp.shard(**batch)
        except ValueError as e:
            return str(e)
        return None

    out: dict = {}
    batch = _batch("left")
    out["refused"] = refusal(_model("roberta"), batch)
    ref, model = _model("roberta"), _model("roberta")
    ref(**batch).loss.backward()
    pos = ref.roberta.embeddings.create_position_ids_from_input_ids(batch["input_ids"], ref.config.pad_token_id)
    given = {**batch, "position_ids": pos}
    with context_parallel(model) as cp:
        model(**cp.shard(**given)).loss.backward()
    out["grad"] = _grad_error(model, ref)
    # rotary frequencies that change past a length ("dynamic" scaling): each rank sees only its own positions
    for limit in (16, 128):
        config = _model("llama").config
        config.max_position_embeddings = limit
        config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        dynamic = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="selfattn")
        out[f"dynamic-{limit}"] = refusal(dynamic, _batch("packed"), _batch("left"))
    # the same within the length, after an earlier longer call grew its frequencies (transformers keeps them)
    config = _model("llama").config
    config.max_position_embeddings = L
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    grown = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="selfattn")
    with torch.no_grad():
        grown(input_ids=torch.randint(2, 64, (1, 2 * L)))
    out["dynamic-grown"] = refusal(grown, _batch("left"))
    return out


def test_positions_a_model_derives_from_its_tokens_are_refused(tmp_path):
    """catches: a model that computes its positions from the token ids (RoBERTa) silently given 0 .. L-1 under
    context parallelism, instead of being asked for the positions it would compute on the whole batch; and rotary
    embeddings whose frequencies depend on the largest position of the call ("dynamic", "longrope") computed from
    each rank's own positions past the length where they change."""
    for res in _spawn("refused_positions_worker", 2, tmp_path):
        assert res["refused"] and "position_ids" in res["refused"] and "RobertaForCausalLM" in res["refused"], res
        assert res["grad"] < GRAD_RTOL, res
        assert res["dynamic-16"] and "'dynamic' rotary" in res["dynamic-16"] and res["dynamic-128"] is None, res
        assert res["dynamic-grown"] and "an earlier call grew" in res["dynamic-grown"], res


def compiled_worker(rank: int, world: int) -> dict:
    """The model compiled inside the block, zigzag, on one plain sequence (whose local positions jump on a rank, so
    transformers builds a packed-sequence mask): the first compile of a fresh process (each spawned rank is one)."""
    from selfattn.integrations.transformers import context_parallel

    out: dict = {}
    for case in ("plain",):
        batch = _batch("packed")
        del batch["position_ids"]
        ref, model = _model("llama"), _model("llama")
        ref(**batch).loss.backward()
        compiled = torch.compile(model, backend="aot_eager")
        with context_parallel(model, layout="zigzag") as cp:
            loss = compiled(**cp.shard(**batch)).loss
            loss.backward()
        out[case] = {"loss": abs(loss.item() - ref(**batch).loss.item()) / abs(loss.item()),
                     "grad": _grad_error(model, ref)}
    return out


@pytest.mark.slow
def test_the_model_compiles_inside_the_block(tmp_path):
    """catches: torch.compile of a model inside context_parallel crashing in the mask lowering (a rank's zigzag
    positions jump, so transformers hands even one plain sequence's mask a packed-sequence predicate, which dynamo
    could not trace), and compiled gradients that differ from one process's."""
    for res in _spawn("compiled_worker", 2, tmp_path):
        for case, e in res.items():
            assert e["loss"] <= LOSS_RTOL and e["grad"] <= GRAD_RTOL, (case, e)


@pytest.mark.slow  # multi-process or bench workers: run with -m slow
def test_several_optimizer_steps_give_the_same_weights(tmp_path):
    """catches: gradients reduced more than once per backward, or a reduction left over from a previous step."""
    _judge(_spawn("exact_worker", 2, tmp_path, families=["llama"], cases=["packed"], combos=[["zigzag", "ring"]],
                  steps=3))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_world_size_layout_and_strategy(world, tmp_path):
    """catches: errors that only show at some world sizes or in one layout or strategy."""
    combos = [[layout, strategy] for layout in ("contiguous", "zigzag", "balanced")
              for strategy in ("ring", "all_to_all")]
    _judge(_spawn("exact_worker", world, tmp_path, limit=1800, families=list(FAMILIES),
                  cases=["packed", "packed-odd", "padding"], combos=combos))


def accumulation_worker(rank: int, world: int) -> dict:
    """Gradients accumulated over two micro-batches (two backward passes, one step), and a backward left outside
    the block."""
    from selfattn.integrations.transformers import context_parallel

    ref, model = _model("llama"), _model("llama")
    batches = [_batch("packed", seed=1), _batch("padding", seed=2)]
    for batch in batches:
        ref(**batch).loss.backward()
    with context_parallel(model) as cp:
        for batch in batches:
            model(**cp.shard(**batch)).loss.backward()
    grads = dict(model.named_parameters())
    out = {"grad": max(_rel(grads[n].grad, p.grad) for n, p in ref.named_parameters() if p.grad.abs().max() > 0)}
    try:
        with context_parallel(model) as cp:
            loss = model(**cp.shard(**batches[0])).loss
        loss.backward()
        out["outside"] = None
    except RuntimeError as e:
        out["outside"] = str(e)
    with torch.no_grad(), context_parallel(model) as cp:  # a loss for logging: no backward needed
        model(**cp.shard(**batches[0]))
    return out


def contract_worker(rank: int, world: int) -> dict:
    """The contract's cases that need processes, in one spawn: accumulation, edges, mismatched batches."""
    return {"accumulation": accumulation_worker(rank, world), "edges": edges_worker(rank, world),
            "mismatch": mismatch_worker(rank, world)}


@pytest.fixture(scope="module")
def contract_run(tmp_path_factory):
    return _spawn("contract_worker", 2, tmp_path_factory.mktemp("contract"))


def test_gradient_accumulation_and_a_backward_outside_the_block(contract_run):
    """catches: a second micro-batch's reduction summing the first one's (already global) gradients W times
    again, and a backward after the block silently keeping each rank's own share."""
    for res in (r["accumulation"] for r in contract_run):
        assert res["grad"] < GRAD_RTOL, res
        assert res["outside"] and "inside the `with` block" in res["outside"], res


def edges_worker(rank: int, world: int) -> dict:
    """Batches and models at the edges of the contract (each case's outcome, judged by the test)."""
    import transformers

    from selfattn.integrations.transformers import context_parallel

    out: dict = {}

    def grads_against(ref, model, batch) -> float:
        ref(**batch).loss.backward()
        with context_parallel(model) as cp:
            model(**cp.shard(**batch)).loss.backward()
        mine = dict(model.named_parameters())
        return max(_rel(mine[n].grad, p.grad) for n, p in ref.named_parameters() if p.grad is not None
                   and p.grad.abs().max() > 0)

    # an all-ones attention mask with restarting positions: transformers then reads no documents
    batch = _batch("packed")
    batch["attention_mask"] = torch.ones(2, L, dtype=torch.long)
    out["ones_mask_packed"] = grads_against(_model("llama"), _model("llama"), batch)
    # inputs_embeds: the token embedding gets no gradient, and keeps None as in one process
    model = _model("llama")
    embeds = model.get_input_embeddings()(_batch("packed")["input_ids"]).detach()
    with context_parallel(model) as cp:
        loss = model(**cp.shard(inputs_embeds=embeds, labels=_batch("packed")["labels"])).loss
        loss.backward()
    out["unused_grad_is_none"] = model.get_input_embeddings().weight.grad is None
    # a float32 model's loss stays float32
    model = _model("llama").float()
    with context_parallel(model) as cp:
        loss = model(**cp.shard(**_batch("packed"))).loss
        out["loss_dtype"] = str(loss.dtype)
        loss.backward()
    # a loss backpropagated twice inside (retain_graph), then another left for after the block
    model = _model("llama")
    try:
        with context_parallel(model) as cp:
            first = model(**cp.shard(**_batch("packed"))).loss
            first.backward(retain_graph=True)
            first.backward()
            second = model(**cp.shard(**_batch("packed"))).loss
        second.backward()
        out["retain_graph_then_outside"] = None
    except RuntimeError as e:
        out["retain_graph_then_outside"] = str(e)
    # ranks passing different token ids
    batch = _batch("packed", seed=1 + rank)
    try:
        with context_parallel(_model("llama")) as cp:
            cp.shard(**batch)
        out["different_tokens"] = None
    except ValueError as e:
        out["different_tokens"] = str(e)
    # labels for a model that is not a causal language model
    bert = transformers.AutoModelForMaskedLM.from_config(
        transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                vocab_size=64), attn_implementation="selfattn")
    try:
        with context_parallel(bert) as cp:
            cp.shard(input_ids=batch["input_ids"], labels=batch["labels"])
        out["masked_lm_labels"] = None
    except ValueError as e:
        out["masked_lm_labels"] = str(e)
    return out


def test_edges_of_the_contract(contract_run):
    """catches: an all-ones attention mask with restarting positions read as packed documents (one process reads
    none), a parameter no gradient reached given a zero gradient, a float32 loss turned float64, a loss left for
    after the block hidden by a retain_graph backward, ranks with different token ids training on a mixture, and
    a masked LM's labels shifted as a causal LM's."""
    for res in (r["edges"] for r in contract_run):
        assert res["ones_mask_packed"] < GRAD_RTOL, res
        assert res["unused_grad_is_none"] and res["loss_dtype"] == "torch.float32", res
        assert res["retain_graph_then_outside"] and "inside the `with` block" in res["retain_graph_then_outside"]
        assert res["different_tokens"] and "input_ids" in res["different_tokens"], res
        assert res["masked_lm_labels"] and "BertForMaskedLM" in res["masked_lm_labels"], res


def test_models_mixing_tokens_outside_attention_are_refused():
    """catches: a model whose convolutions, linear-attention or chunked-attention layers mix tokens within each
    rank's shard accepted, and silently wrong."""
    import transformers

    from selfattn.integrations.transformers import context_parallel, register

    register()
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    lfm2 = transformers.AutoModelForCausalLM.from_config(
        transformers.Lfm2Config(**small, num_hidden_layers=2, layer_types=["conv", "full_attention"]),
        attn_implementation="selfattn")
    with pytest.raises(ValueError, match="conv"), context_parallel(lfm2):
        pass
    llama4 = transformers.AutoModelForCausalLM.from_config(
        transformers.Llama4TextConfig(**small, num_hidden_layers=2, attention_chunk_size=4, head_dim=8,
                                      num_local_experts=2), attn_implementation="selfattn")
    with pytest.raises(ValueError, match="chunked_attention"), context_parallel(llama4):
        pass


def mismatch_worker(rank: int, world: int) -> dict:
    """Rank 1 passes other document boundaries: the ranks' agreement must refuse, on every rank."""
    from selfattn.integrations.transformers import context_parallel

    model = _model("llama")
    batch = _batch("packed")
    if rank == 1:
        batch["position_ids"] = torch.arange(L).expand(2, L)
    try:
        with context_parallel(model, timeout=20) as cp:
            model(**cp.shard(**batch)).loss.backward()
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def test_ranks_with_different_batches_get_the_agreement_error(contract_run):
    """catches: ranks that disagree about the global batch (documents) computing a silent mixture: cp.shard
    compares the batches (the attention's agreement would catch the mask later)."""
    for res in (r["mismatch"] for r in contract_run):
        assert res["error"] and "position_ids differ" in res["error"], res


def test_refusals_without_processes():
    """catches: a model not using selfattn, or a bad layout, reaching the ranks before it is refused."""
    import transformers

    from selfattn.integrations.transformers import context_parallel

    eager = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=32), attn_implementation="eager")
    with pytest.raises(ValueError, match="selfattn"), context_parallel(eager):
        pass
    with pytest.raises(ValueError, match="layout"), context_parallel(_model("llama"), layout="sideways"):
        pass
    with pytest.raises(ValueError, match="memory must be 'overlap' or 'low'"), context_parallel(_model("llama"),
                                                                                               memory="least"):
        pass


def mesh_worker(rank: int, world: int) -> dict:
    """A 2 x 2 mesh (data parallel x context parallel): each data-parallel replica trains on its row of the batch,
    split over its context-parallel group; with the data-parallel group given to the context, and with DDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from selfattn.integrations.transformers import context_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp_group, dp_group = mesh.get_local_rank("dp"), mesh.get_group("cp"), mesh.get_group("dp")
    out = {}
    for case in ("dp_group", "ddp"):
        batch = _batch("packed")
        if case == "ddp":  # DDP averages the replicas' gradients: equal when the replicas count equal tokens
            batch["labels"] = batch["input_ids"].clone()
        ref = _model("llama")
        ref(**batch).loss.backward()
        model = _model("llama")
        row = {k: v[dp:dp + 1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        wrapped = DistributedDataParallel(model, process_group=dp_group) if case == "ddp" else model
        with context_parallel(wrapped, group=cp_group, data_parallel_group=dp_group if case == "dp_group" else None,
                              layout="zigzag") as cp:
            wrapped(**cp.shard(**row)).loss.backward()
        grads = dict(model.named_parameters())
        out[case] = max(_rel(grads[n].grad, p.grad) for n, p in ref.named_parameters() if p.grad.abs().max() > 0)
        if case == "ddp":  # the context's communication hook must not keep the DDP model alive
            alive = weakref.ref(wrapped)
            del wrapped, cp
            gc.collect()
            out["ddp_freed"] = alive() is None
    return out


@pytest.mark.slow  # multi-process or bench workers: run with -m slow
def test_data_parallel_times_context_parallel(tmp_path):
    """catches: gradients reduced over only one of the two dimensions of a data x context mesh, the loss
    normalised per replica instead of over every replica's tokens, DDP's averaging fighting the context's sum, or
    the context's communication hook keeping a DDP model alive after its last use."""
    for res in _spawn("mesh_worker", 4, tmp_path):
        assert res["dp_group"] < GRAD_RTOL and res["ddp"] < GRAD_RTOL, res
        assert res["ddp_freed"], res


@pytest.mark.slow
def test_example_trains_and_matches_one_process():
    """catches: the example drifting from the API, or its first-step check against one process failing."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "examples" / "hf_context_parallel.py"), "--steps", "3",
                           "--length", "256"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "-> equal" in proc.stdout and "loss" in proc.stdout.splitlines()[-1], proc.stdout



def _clipped_adamw_steps(model: torch.nn.Module, batches: list[dict], shard: object = None, cp_args: dict | None = None,
                         steps: int = 3, sync_last_only: bool = False) -> None:
    """``steps`` AdamW steps, each over the micro-batches ``batches`` (the mean of their losses, accumulated in
    ``.grad``), the gradients clipped to a global norm of 0.05 (below theirs: the clipping acts). With ``cp_args``
    each micro-batch runs inside ``context_parallel(model, **cp_args)``, ``shard`` cutting this replica's row;
    ``sync_last_only``: FSDP or DDP reduces only the last micro-batch's gradients (``set_requires_gradient_sync``,
    ``no_sync``)."""
    from selfattn.integrations.transformers import context_parallel

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            if cp_args is None:
                (model(**batch).loss / len(batches)).backward()
                continue
            if sync_last_only and hasattr(model, "set_requires_gradient_sync"):  # FSDP2
                model.set_requires_gradient_sync(last)
            local = model.no_sync() if sync_last_only and not last and hasattr(model, "no_sync") else nullcontext()
            with local, context_parallel(model, **cp_args) as cp:
                (model(**cp.shard(**shard(batch))).loss / len(batches)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        assert float(norm) > 0.05, float(norm)
        opt.step()


def fsdp_worker(rank: int, world: int) -> dict:
    """A 2 x 2 mesh (data parallel x context parallel): FSDP2 over "dp" and DDP over "dp", the context over "cp";
    each data-parallel replica trains on its row of every micro-batch. The weights after three clipped AdamW steps
    of two micro-batches each, against one process on the whole batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp = mesh.get_local_rank("dp")
    batches = [_batch("packed", seed) for seed in (1, 2)]
    for b in batches:  # every replica's row counts the same tokens: the mean of the replicas' means is the batch's
        b["labels"] = b["input_ids"].clone()

    def row(batch: dict) -> dict:
        return {k: v[dp:dp + 1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    ref = _model("llama")
    _clipped_adamw_steps(ref, batches)
    out = {}
    for case in ("fsdp", "fsdp_sync_last", "ddp", "ddp_sync_last"):
        model = _model("llama")
        if case.startswith("fsdp"):
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            wrapped, cp_args = model, {"mesh": mesh["cp"]}
        else:
            wrapped = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
            cp_args = {"mesh": mesh, "mesh_dim": "cp"}
        _clipped_adamw_steps(wrapped, batches, row, {**cp_args, "layout": "zigzag"},
                             sync_last_only=case.endswith("sync_last"))
        weights = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
        out[case] = max(_rel(weights[n].detach(), p.detach()) for n, p in ref.named_parameters())
        out[case + "_moved"] = max(_rel(weights[n].detach(), p.detach()) for n, p in _model("llama").named_parameters())
    return out


def test_fsdp2_and_ddp_with_context_parallelism_on_one_mesh(tmp_path):
    """catches: FSDP2's reduce-scatter leaving out the context group (each context rank would step on its own
    share), the context's own hooks summing FSDP's sharded parameters a second time, accumulation summing a
    micro-batch's gradients more than once (DDP reduces the whole accumulated .grad again), clipping by a norm
    of the shares, or the mesh forms picking the wrong dimension."""
    for res in _spawn("fsdp_worker", 4, tmp_path):
        for case in ("fsdp", "fsdp_sync_last", "ddp", "ddp_sync_last"):
            assert res[case] < GRAD_RTOL, res
            assert res[case + "_moved"] > 1e-3, res  # the steps moved the weights: the comparison means something

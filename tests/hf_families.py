"""Tiny random models of every transformers text family, for the selfattn family sweep.

``tiny_config(model_type)`` builds a family's config with small sizes (hidden 32, 2 layers, 4
heads, 2 key/value heads, vocabulary 99), setting only the arguments the config takes;
``build(model_type, impl, dtype)`` makes the model (a causal LM for decoders, a masked LM for
encoders) from it. ``run_family`` compares selfattn's logits on a right-padded batch with the
float64 oracle and eager attention, under the tolerance rule. The sweep's results make the README's
table (``python tests/hf_families.py > sweep.tsv``, then ``python tests/hf_families.py --markdown sweep.tsv``).
"""

from __future__ import annotations

import inspect
import sys
import warnings

import torch

SIZES = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
             vocab_size=99, max_position_embeddings=64, head_dim=8, n_embd=32, n_layer=4, n_head=4, n_positions=64,
             d_model=32, num_layers=4, num_heads=4, d_ff=37, ffn_dim=37, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
             moe_intermediate_size=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4,
             shared_expert_intermediate_size=16, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
             qk_nope_head_dim=4, v_head_dim=8, sliding_window=6, embedding_size=32, hidden_dim=32, n_heads=4,
             n_layers=4, dim=32, num_hidden_groups=1, inner_group_num=1, rotary_dim=4,
             partial_rotary_factor=0.5)
L, VOCAB = 16, 99


def families() -> dict[str, str]:
    """model_type -> "decoder" or "encoder", for every family with a causal or masked LM head."""
    from transformers.models.auto import modeling_auto as ma
    out = {mt: "decoder" for mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    out.update({mt: "encoder" for mt in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES if mt not in out})
    return dict(sorted(out.items()))


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _sizes(cls: type, layers: int) -> dict:
    params = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "__dataclass_fields__", {}))
    return {k: layers if k in LAYER_KEYS else v for k, v in SIZES.items() if k in params}


def tiny_config(model_type: str, layers: int = 4):
    """The family's config with small sizes, setting only what its constructor (and those of its
    sub-configs: a composite model's text part) takes. 4 layers, so that hybrid families whose
    pattern places attention every few layers have some; 2 for the few that need it."""
    from transformers import AutoConfig
    cls = type(AutoConfig.for_model(model_type))
    kwargs = _sizes(cls, layers)
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type) and sub is not AutoConfig:
            kwargs[name] = _sizes(sub, layers)
    cfg = cls(**kwargs)
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, attr, None), int) and getattr(cfg, attr) >= VOCAB:
            setattr(cfg, attr, 0)
    return cfg


def model_class(model_type: str, kind: str) -> type:
    import transformers
    from transformers.models.auto import modeling_auto as ma
    names = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if kind == "decoder" else ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    name = names[model_type]
    return getattr(transformers, name[0] if isinstance(name, (list, tuple)) else name)


MAX_PARAMS = 3_000_000  # a "tiny" model; a config that will not shrink below it is not built


def parameter_count(model_type: str, kind: str, layers: int = 4) -> int:
    """Parameters of the tiny model, counted on the meta device (nothing allocated)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(model_type, kind)._from_config(tiny_config(model_type, layers), attn_implementation="eager")
    return sum(p.numel() for p in model.parameters())


def build(model_type: str, kind: str, impl: str, dtype: torch.dtype = torch.float32, layers: int = 4):
    cfg = tiny_config(model_type, layers)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(model_type, kind)._from_config(cfg, attn_implementation=impl,
                                                           experts_implementation="eager")  # float64 too
    return model.to(dtype).eval()


def batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, L), generator=g)
    am = torch.ones(2, L, dtype=torch.long)
    am[1, L - 5:] = 0
    return dict(input_ids=ids, attention_mask=am)


def markdown(lines: list[str]) -> str:
    """The README's table from the sweep's lines (model_type, kind, outcome, detail; tab-separated)."""
    rows = [line.rstrip("\n").split("\t") for line in lines if line.strip()]
    by: dict[str, list[list[str]]] = {}
    for r in rows:
        by.setdefault(r[2], []).append(r)
    out = [f"| outcome | families ({len(rows)}) |", "| --- | --- |"]
    names = {"supported": "runs selfattn, logits within the float32 rule of the float64 oracle",
             "refused": "refused when built, with a `ValueError` saying why: attention not routed through "
                        "transformers' interface (a class table keyed by implementation name, or attention of their "
                        "own; for `deepseek_v4`, `doge` and `hy_v4`, the mask's values read on the way)"}
    for key in ("supported", "refused"):
        fams = ", ".join(f"`{r[0]}`" for r in by.get(key, []))
        out.append(f"| {names[key]} ({len(by.get(key, []))}) | {fams} |")
    fams = ", ".join(f"`{r[0]}`" for r in by.get("unbuildable", []))
    out.append(f"| not built tiny here: too large at the smallest sizes its config takes, an extra missing, or "
               f"failing without selfattn at those sizes ({len(by.get('unbuildable', []))}) | {fams} |")
    if by.get("fails"):
        out.append(f"| failing ({len(by['fails'])}) | {', '.join(f'`{r[0]}`' for r in by['fails'])} |")
    return "\n".join(out)


if __name__ == "__main__":  # the sweep, one family a line: model_type kind outcome detail
    sys.path.insert(0, "tests")
    if sys.argv[1:2] == ["--markdown"]:  # python tests/hf_families.py --markdown sweep.tsv
        with open(sys.argv[2]) as f:
            print(markdown(f.readlines()))
        raise SystemExit(0)
    from test_transformers_families import outcome
    only = sys.argv[1:]
    for mt, kind in families().items():
        if only and mt not in only:
            continue
        res, detail = outcome(mt, kind)
        print(f"{mt}\t{kind}\t{res}\t{detail}", flush=True)

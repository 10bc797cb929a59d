"""Every transformers text family: selfattn runs it and matches the oracle, or refuses it clearly.

For each family with a causal-LM or masked-LM head that transformers builds from a tiny config
(``hf_families``): a model class whose attention goes through transformers' attention
interface gives the float64 oracle's logits on a right-padded batch within the float32 rule
(2x eager's error); one that does not raises ``ValueError`` when built with selfattn, naming
the family and suggesting "sdpa"/"eager". A family transformers cannot build tiny is recorded
with transformers' own error. The default run takes a few families; ``-m slow`` takes all.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402
from hf_oracle import NAME, ORACLE  # noqa: E402

from selfattn.integrations import transformers as sa_hf  # noqa: E402
from selfattn.testing import OUTPUT_FACTOR, compare_to_reference  # noqa: E402

FAST = {"llama", "bert", "falcon", "bloom", "mpt", "deberta-v2", "git", "gpt_neox", "roberta"}


def outcome(model_type: str, kind: str) -> tuple[str, str]:
    """("supported" | "refused" | "unbuildable" | "fails", detail) for one family."""
    try:
        cls = hf_families.model_class(model_type, kind)
        hf_families.tiny_config(model_type)
    except Exception as e:  # transformers cannot make this family here (a missing extra, a required part)
        return "unbuildable", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    reason = sa_hf.unsupported_reason(cls)
    if reason is not None:  # refused in __init__, before any weight is made
        try:
            hf_families.build(model_type, kind, NAME)
        except ValueError as e:
            said = str(e)
            if cls.__name__ in said and "'sdpa'" in said and "'eager'" in said:
                return "refused", reason
            return "fails", f"refused without naming the class and the alternatives: {said[:200]}"
        except Exception as e:
            return "fails", f"refusal raised {type(e).__name__}: {str(e)[:200]}"
        return "fails", "built with selfattn although it cannot route attention"
    failed = ""
    for layers in (4, 2):  # a few families build only with one of the two
        try:
            size = hf_families.parameter_count(model_type, kind, layers)
        except Exception as e:
            failed = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        if size > hf_families.MAX_PARAMS:
            failed = f"{size / 1e6:.0f}M parameters at the smallest sizes its config takes"
            continue
        batch = hf_families.batch(kind)
        try:  # the family without selfattn: the float64 oracle and eager
            ref = hf_families.build(model_type, kind, ORACLE, torch.float64, layers)
            naive = hf_families.build(model_type, kind, "eager", layers=layers)
            naive.load_state_dict(ref.state_dict())
            with torch.no_grad():
                r, n = ref(**batch).logits, naive(**batch).logits
        except Exception as e:
            failed = f"without selfattn: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        break
    else:
        return "unbuildable", failed
    try:
        ours = hf_families.build(model_type, kind, NAME, layers=layers)
        ours.load_state_dict(ref.state_dict())
        with torch.no_grad():
            o = ours(**batch).logits
    except Exception as e:
        return "fails", f"{type(e).__name__}: {str(e)[:300]}"
    outs = (r, n, o)
    real = batch["attention_mask"].bool()
    r, n, o = (x[real] for x in outs)
    if not torch.isfinite(r).all():
        return "unbuildable", "the float64 oracle model gives non-finite logits at this size"
    result = compare_to_reference(o, r, n, factor=OUTPUT_FACTOR, name=model_type)
    return ("supported", "") if result.ok else ("fails", str(result))


def _routes_through_a_class_table(model_type: str) -> bool:
    """Does the family's modeling module pick attention classes from a table keyed by implementation name (as
    Falcon's did until transformers routed it through the interface)? Such a table has no entry for selfattn."""
    import importlib

    module = importlib.import_module(hf_families.model_class(model_type, hf_families.families()[model_type]).__module__)
    return any(name.endswith("ATTENTION_CLASSES") for name in vars(module))


# families selfattn must refuse: their attention does not go through transformers' interface, whatever flags the
# class sets (Bloom and MPT compute it themselves, DeBERTa-v2 runs its own, GIT's text part has a class table);
# Falcon while its modeling file keeps a class table (newer transformers route it through the interface)
REFUSED = ["bloom", "mpt", "deberta-v2", "git", *(["falcon"] if _routes_through_a_class_table("falcon") else [])]


def _params():
    out = []
    for mt, kind in hf_families.families().items():
        marks = () if mt in FAST else (pytest.mark.slow,)
        out.append(pytest.param(mt, kind, id=mt, marks=marks))
    return out


@pytest.mark.parametrize(("model_type", "kind"), _params())
def test_family_runs_selfattn_or_is_refused(model_type, kind):
    """catches: a family that routes attention through the interface but gives other logits with
    selfattn, and one that cannot route it but is accepted (KeyError, AttributeError deep inside,
    or selfattn silently never called)."""
    result, detail = outcome(model_type, kind)
    assert result != "fails", f"{model_type}: {detail}"
    if model_type in REFUSED:
        assert result == "refused", (result, detail)


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_families_say_so_when_built_or_switched(model_type):
    """catches: Falcon's and GIT's KeyError('selfattn') (attention classes from a table keyed by
    implementation name, which GIT's flags do not reveal), Bloom's and MPT's AttributeError from
    the mask, DeBERTa-v2 silently running its own attention."""
    kind = hf_families.families()[model_type]
    with pytest.raises(ValueError, match=r"cannot use attn_implementation='selfattn'.*'sdpa'.*'eager'") as info:
        hf_families.build(model_type, kind, NAME)
    assert hf_families.model_class(model_type, kind).__name__ in str(info.value)
    assert repr(model_type) in str(info.value)
    model = hf_families.build(model_type, kind, "eager")
    with pytest.raises(ValueError, match="cannot use attn_implementation='selfattn'"):
        model.set_attn_implementation(NAME)
    assert model.config._attn_implementation == "eager"

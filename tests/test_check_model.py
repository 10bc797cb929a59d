"""The doctor on whole models: every attention layer found by behaviour and checked with the call the model makes.

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import selfattn
from selfattn.check import CannotRun, check_model
from selfattn.check.model import find_attention


def _rope(length: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.cat([pos * freq, pos * freq], dim=-1)
    return ang.cos()[None], ang.sin()[None]  # (1, L, D): the model computes them once for every layer


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return t * cos[:, None] + torch.cat([-b, a], dim=-1) * sin[:, None]


class Attention(nn.Module):
    """Rotary attention taking the model's position embeddings and additive mask as keywords."""

    def __init__(self, e: int, h: int, scale: float | None = None) -> None:
        super().__init__()
        self.h, self.d = h, e // h
        self.qkv, self.out = nn.Linear(e, 3 * e), nn.Linear(e, e)
        self.scale = scale if scale is not None else self.d ** -0.5

    def forward(self, hidden, *, position_embeddings, attention_mask=None):
        b, n, e = hidden.shape
        q, k, v = self.qkv(hidden).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        cos, sin = position_embeddings
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        s = q @ k.transpose(-1, -2) * self.scale
        if attention_mask is not None:
            s = s + attention_mask
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class Experts(nn.Module):
    """A mixture of experts: a softmax router over experts (not attention: its weights never meet a matmul)."""

    def __init__(self, e: int, n: int = 4) -> None:
        super().__init__()
        self.router, self.experts = nn.Linear(e, n), nn.ModuleList(nn.Linear(e, e) for _ in range(n))

    def forward(self, x):
        w = self.router(x).softmax(-1)
        return sum(w[..., i : i + 1] * f(x) for i, f in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, e: int, h: int, scale: float | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(e), nn.LayerNorm(e)
        self.attn, self.mlp = Attention(e, h, scale), Experts(e)

    def forward(self, x, cos_sin, mask):
        x = x + self.attn(self.norm1(x), position_embeddings=cos_sin, attention_mask=mask)
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """A decoder: embeddings, rotary computed once, a causal additive mask, blocks."""

    def __init__(self, e: int = 32, h: int = 4, layers: int = 2, scales: dict[int, float] | None = None) -> None:
        super().__init__()
        self.h = h
        self.emb = nn.Embedding(50, e)
        self.blocks = nn.ModuleList(Block(e, h, (scales or {}).get(i)) for i in range(layers))

    def forward(self, ids):
        x = self.emb(ids)
        n = ids.shape[1]
        cos_sin = _rope(n, x.shape[-1] // self.h)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None].expand(ids.shape[0], 1, n, n)
        for block in self.blocks:
            x = block(x, cos_sin, mask)
        return x


def _ids(b: int = 2, n: int = 7) -> torch.Tensor:
    return torch.randint(0, 50, (b, n), generator=torch.Generator().manual_seed(0))


def test_attention_layers_are_found_by_behaviour_not_by_name():
    """catches: the block (it contains the attention) or the mixture of experts (a softmax, but over experts and
    never multiplied into a tensor) taken for an attention layer, or a layer missed."""
    torch.manual_seed(0)
    found = find_attention(Model(), _ids())
    assert [(layer.name, type(layer.module).__name__) for layer in found] == \
        [("blocks.0.attn", "Attention"), ("blocks.1.attn", "Attention")]
    layer = found[0]
    assert layer.x == ((0,)) and layer.mask == "attention_mask" and (layer.batch, layer.length) == (2, 7)


def test_every_layer_is_checked_with_the_call_the_model_makes():
    """catches: a whole model whose layers need the model's own inputs (rotary position embeddings passed as a
    keyword, a mask) left uncheckable without a hand-written adapter, or a model-level mask taken as the module's
    own causality."""
    torch.manual_seed(0)
    report = check_model(Model(), _ids())
    assert report.verdict == "passed", report.to_json()
    assert list(report.layers) == ["blocks.0.attn", "blocks.1.attn"]
    for r in report.layers.values():
        assert r.coverage["mask"] == "verified" and r.coverage["white_box"] == "verified"
        assert "rotary" in r.coverage["equivariance"]
    assert [row["verdict"] for row in report.summary()] == ["passed", "passed"]
    assert json.loads(report.to_json())["verdict"] == "passed"


def test_a_bug_in_one_layer_is_named_in_that_layer():
    """catches: a bug in one layer of a model averaged away by the others, or reported on the wrong layer."""
    torch.manual_seed(0)
    d = 32 // 4
    report = check_model(Model(scales={1: 1 / d}), _ids())
    assert report.verdict == "failed"
    assert report.layers["blocks.0.attn"].verdict == "passed"
    assert report.layers["blocks.1.attn"].ids == {"wrong-scale"}
    assert check_model(Model(scales={1: 1 / d}), _ids(), layers=["blocks.0.attn"]).verdict == "passed"
    assert list(check_model(Model(), _ids(), layers=1).layers) == ["blocks.0.attn"]


class _Core(nn.Module):
    """An attention core that takes q, k, v (x-transformers' Attend, diffusers' processors): no projections."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class _Outer(nn.Module):
    def __init__(self, e: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h, self.to_qkv, self.to_out, self.core = h, nn.Linear(e, 3 * e, bias=False), nn.Linear(e, e), _Core()

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        return self.to_out(self.core(q, k, v).transpose(1, 2).reshape(b, n, e))


def test_a_core_that_takes_q_k_v_is_checked_through_its_parent():
    """catches: a q/k/v core (no (B, L, E) input) taken as the layer, which the doctor cannot call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Outer())
    report = check_model(model, torch.randn(2, 7, 32))
    assert list(report.layers) == ["1"] and report.classes["1"] == "_Outer"
    assert report.verdict == "passed", report.to_json()


def test_torch_transformer_encoder_layers_are_found_and_checked():
    """catches: nn.MultiheadAttention called as self_attn(x, x, x, ...) not recognised (three slots, one tensor),
    and the encoder layer's fused inference path hiding the attention from the run."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    found = find_attention(model, torch.randn(2, 7, 32))
    assert [f.name for f in found] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert found[0].x == (0, 1, 2)
    report = check_model(model, torch.randn(2, 7, 32), layers=1)
    assert report.verdict == "passed", report.to_json()


def test_transformers_models_are_checked_whole():
    """catches: the layers of a real transformers model (rotary embeddings, position ids, cache positions and
    a cache object in the call) not found or not callable from the recorded call."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=64)
    config._attn_implementation = "eager"
    model = transformers.LlamaModel(config)
    report = check_model(model, {"input_ids": torch.randint(0, 64, (2, 7))})
    assert list(report.layers) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert report.verdict == "passed", report.to_json()
    assert all(r.coverage["mask"] == "verified" for r in report.layers.values())


class _Cross(nn.Module):
    """Cross-attention over a memory the model passes in: queries from x, keys and values from the memory."""

    def __init__(self, e: int = 32) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(e, e), nn.Linear(e, 2 * e), nn.Linear(e, e)

    def forward(self, x, memory):
        k, v = self.kv(memory).chunk(2, -1)
        return self.o(torch.softmax(self.q(x) @ k.transpose(-1, -2) / math.sqrt(x.shape[-1]), -1) @ v)


class _Decoder(nn.Module):
    def __init__(self, e: int = 32) -> None:
        super().__init__()
        self.self_attn, self.cross = _Outer(e), _Cross(e)

    def forward(self, x, memory):
        return self.cross(self.self_attn(x), memory)


def test_cross_attention_is_told_apart_and_not_checked_as_self_attention():
    """catches: a cross-attention layer (its output rows mix another sequence's tokens, not its own) probed as
    self-attention, where every query "sees only its own token" and is named causal-leak."""
    torch.manual_seed(0)
    report = check_model(_Decoder(), (torch.randn(2, 7, 32), torch.randn(2, 5, 32)))
    assert list(report.layers) == ["self_attn"] and "cross" in report.not_self_attention
    assert report.verdict == "passed", report.to_json()
    assert {row["layer"]: row["verdict"] for row in report.summary()} == {"self_attn": "passed",
                                                                          "cross": "not checked"}


def test_bad_input_is_a_clear_error():
    """catches: a model without attention reported as passed, a model that fails on its inputs raising from
    inside the doctor, and options check_model cannot honour accepted silently."""
    with pytest.raises(CannotRun, match="no attention layer found"):
        check_model(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 3, 8))
    with pytest.raises(CannotRun, match="failed on the example inputs"):
        check_model(Model(), torch.randn(2, 3))
    with pytest.raises(ValueError, match="replays the call"):
        check_model(Model(), _ids(), call=lambda m, x: m(x))
    with pytest.raises(ValueError, match="does not take"):
        check_model(Model(), _ids(), colour="red")
    with pytest.raises(ValueError, match="no attention layer named"):
        check_model(Model(), _ids(), layers=["blocks.7.attn"])
    with pytest.raises(TypeError, match="example_inputs"):
        check_model(Model(), [1, 2])
    assert selfattn.check_model is check_model


def test_cli_checks_a_model_from_a_factory(tmp_path, capsys):
    """catches: `selfattn check --model` not wired, or its exit status not the verdict's."""
    src = tmp_path / "net.py"
    src.write_text(textwrap.dedent(f"""
        import torch
        from torch import nn

        class Attn(nn.Module):
            def __init__(self, e, scale):
                super().__init__()
                self.qkv, self.o, self.scale = nn.Linear(e, 3 * e), nn.Linear(e, e), scale
            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, -1)
                return self.o(torch.softmax(q @ k.transpose(-1, -2) * self.scale, -1) @ v)

        def good():
            return nn.Sequential(nn.Linear(16, 16), Attn(16, {1 / math.sqrt(16)})), torch.randn(2, 5, 16)

        def bad():
            return nn.Sequential(nn.Linear(16, 16), Attn(16, 1.0)), torch.randn(2, 5, 16)
        """))
    run = [sys.executable, "-m", "selfattn.cli", "check", "--model", "--json"]
    good = subprocess.run([*run, f"{src}:good"], capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stdout + good.stderr
    assert json.loads(good.stdout)["summary"][0]["layer"] == "1"
    from selfattn.cli import main  # the other exit statuses in this process

    capsys.readouterr()
    assert main(["check", "--model", "--json", f"{src}:bad"]) == 1
    assert "missing-scale" in json.loads(capsys.readouterr().out)["summary"][0]["findings"]
    assert main(["check", "--model", "--json", f"{src}:nothing"]) == 2
    assert "no function named" in capsys.readouterr().out


def test_torch_decoder_with_its_causal_flag_and_cross_attention_in_training_mode():
    """catches: the model's is_causal=True replayed beside the doctor's mask (torch then drops the mask, or refuses
    a None one: doctor errors and mask-ignored), the (L, L) attn_mask chosen over key_padding_mask (a layer read
    otherwise than alone), and cross-attention probed as self-attention because dropout made two runs differ."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    model = nn.TransformerDecoder(layer, 1)  # left in training mode, as built
    tgt, memory = torch.randn(2, 6, 32), torch.randn(2, 5, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    report = check_model(model, {"tgt": tgt, "memory": memory, "tgt_mask": causal, "tgt_is_causal": True})
    assert report.verdict == "passed", report.to_json()
    assert list(report.layers) == ["layers.0.self_attn"] and "layers.0.multihead_attn" in report.not_self_attention
    assert report.layers["layers.0.self_attn"].doctor_errors == []
    assert model.training


class _PassesItsMask(nn.Module):
    """timm's ViT attention: the mask given goes to SDPA as it is; three heads."""

    def __init__(self, e: int = 48, h: int = 3) -> None:
        super().__init__()
        self.num_heads, self.qkv, self.proj = h, nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(b, n, e))


def test_a_mask_passed_to_sdpa_is_not_read_per_item_when_the_batch_equals_the_heads():
    """catches: a (B, L, L) mask that SDPA broadcasts onto the heads taken as per item when the probe batch equals
    the head count (3), so that the padding probe then saw real tokens change: a false mask-ignored."""
    torch.manual_seed(0)
    report = selfattn.check(_PassesItsMask())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.coverage["mask"] == "verified" and report.coverage["padding"] == "verified"


def test_an_attention_over_an_image_map_is_found_and_checked():
    """catches: a layer that maps an image (B, H, W, E) to one (ViTDet's, segment-anything's) not taken as an
    attention layer, so that a model of them reported no attention at all."""
    from test_check_designs import ChannelsLastImageAttention

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), ChannelsLastImageAttention(32))
    report = check_model(model, torch.randn(2, 4, 4, 32))
    assert list(report.layers) == ["1"] and report.verdict == "passed", report.to_json()


class _KeepMaskAttention(nn.Module):
    """Attention taking a bool mask; ``reads``: "keep" (True = may attend, as its model means it) or "ignore"
    (True = masked: correct on its own, wrong for a model that passes True = token), "minus" for a float mask
    (the additive mask subtracted), or "none" (the mask is never applied)."""

    def __init__(self, e: int, h: int, reads: str = "keep") -> None:
        super().__init__()
        self.h, self.reads = h, reads
        self.qkv = nn.Linear(e, 3 * e)

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is None or self.reads == "none":
            pass
        elif mask.dtype == torch.bool:
            s = s.masked_fill(mask if self.reads == "ignore" else ~mask, float("-inf"))
        else:
            s = s - mask if self.reads == "minus" else s + mask
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)


class _PaddedEncoder(nn.Module):
    """An encoder that turns transformers' attention_mask (1 = token) into a (B, 1, 1, L) mask once, bool or
    additive, and passes it to every layer; ``reads`` is its second layer's reading."""

    def __init__(self, reads: str = "keep", additive: bool = False) -> None:
        super().__init__()
        self.additive = additive
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(_KeepMaskAttention(32, 4, reads if i == 1 else "keep") for i in range(3))

    def forward(self, ids, attention_mask):
        x = self.emb(ids)
        keep = attention_mask[:, None, None, :].bool()
        mask = (~keep).float() * -10000.0 if self.additive else keep
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        return x


def test_a_layer_that_reads_the_models_mask_the_other_way_is_named():
    """catches: a layer certified although it reads the mask its model passes the other way round (a bool
    keep-mask read as True = masked, an additive mask subtracted): each layer's own convention was found and checked
    with the doctor's masks, never with the model's. The layer's call is replayed with the model's own mask and
    its padded tokens changed: the real tokens' outputs must not move."""
    ids = _ids()
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 4:] = 0
    for model, inputs in ((_PaddedEncoder(), {"ids": ids, "attention_mask": padding}),
                          (_PaddedEncoder(additive=True), (ids, padding))):
        report = check_model(model, inputs)
        assert report.verdict == "passed", report.summary()
    for model, inputs in ((_PaddedEncoder("ignore"), {"ids": ids, "attention_mask": padding}),
                          (_PaddedEncoder("minus", additive=True), (ids, padding))):
        rows = {row["layer"]: row for row in check_model(model, inputs).summary()}
        assert "mask-inverted" in rows["layers.1"]["findings"], rows
        assert rows["layers.0"]["verdict"] == rows["layers.2"]["verdict"] == "passed", rows


class _CachedAttention(nn.Module):
    """Meta's reference Llama attention in short: preallocated cache buffers written in place at ``start_pos``,
    the keys read back from them; the model passes a causal (L, L) additive mask."""

    def __init__(self, e: int = 32, h: int = 4, max_batch: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.h = h
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(e, e, bias=False) for _ in range(4))
        self.register_buffer("cache_k", torch.zeros(max_batch, max_len, h, e // h))
        self.register_buffer("cache_v", torch.zeros(max_batch, max_len, h, e // h))

    def forward(self, x, start_pos: int, mask=None):
        b, n, e = x.shape
        q, k, v = (w(x).view(b, n, self.h, -1) for w in (self.wq, self.wk, self.wv))
        self.cache_k[:b, start_pos:start_pos + n] = k
        self.cache_v[:b, start_pos:start_pos + n] = v
        keys, values = (c[:b, :start_pos + n].transpose(1, 2) for c in (self.cache_k, self.cache_v))
        s = q.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(keys.shape[-1])
        if mask is not None:
            s = s + mask
        return self.wo((s.softmax(-1) @ values).transpose(1, 2).reshape(b, n, e))


class _CachedDecoder(nn.Module):
    """``diagonal``: where the model's causal mask starts hiding (1 is right; 2 lets each token see the next)."""

    def __init__(self, diagonal: int = 1) -> None:
        super().__init__()
        self.diagonal = diagonal
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(_CachedAttention() for _ in range(3))

    def forward(self, ids, start_pos: int = 0):
        x = self.emb(ids)
        n = ids.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(self.diagonal)
        for layer in self.layers:
            x = x + layer(x, start_pos, mask)
        return x


def test_layers_whose_cache_the_models_run_wrote_are_checked_as_the_model_holds_them():
    """catches: identical cached layers getting different verdicts (inconclusive, state-dependent) because the
    doctor's own run of the model, with autograd on, left its history in the cache buffers written in place; the
    run now gives every buffer its value back, without history."""
    report = check_model(_CachedDecoder(), (_ids(),))
    assert [row["verdict"] for row in report.summary()] == ["passed"] * 3, report.summary()


def test_gpt2_layers_scaled_by_their_index_are_a_stated_scale():
    """catches: GPT-2 with scale_attn_by_inverse_layer_idx (a transformers config option) named wrong-scale on
    every layer but the first: the scores' extra 1 / (layer_idx + 1) is read from the config, as
    scale_attn_weights is. A model whose padding mask is given checks the layers' reading of it too."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=3, n_positions=32, vocab_size=64,
                                     scale_attn_by_inverse_layer_idx=True)
    config._attn_implementation = "eager"
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 5:] = 0
    report = check_model(transformers.GPT2Model(config).eval(), {"input_ids": _ids() % 64, "attention_mask": padding})
    assert [row["verdict"] for row in report.summary()] == ["passed"] * 3, report.summary()


class ReducedKeys(nn.Module):
    """Attention with keys and values from a strided convolution over the feature map, in the style of pyramid
    vision backbones: ``forward(x, feat_size)`` takes the map's (H, W) as numbers."""

    def __init__(self, dim: int, heads: int, sr: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.sr = nn.Conv2d(dim, dim, sr, sr)

    def forward(self, x: torch.Tensor, feat_size: list[int]) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        m = self.sr(x.transpose(1, 2).reshape(b, c, *feat_size)).flatten(2).transpose(1, 2)
        k, v = self.kv(m).view(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


class WindowTable(nn.Module):
    """Attention within fixed windows of ``window`` tokens with a learned (heads, window, window) bias: it runs only
    at its window's length."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, window, window) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


class Pyramid(nn.Module):
    """Two stages on a 16 x 16 image: an 8 x 8 map of width 64 (64 tokens, as many as the width), reduced keys; then
    windows of 2 x 2 = 4 tokens with 4 heads (as many tokens as heads), then an 4 x 4 map of width 32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed1, self.embed2 = nn.Conv2d(3, 64, 2, 2), nn.Conv2d(64, 32, 2, 2)
        self.stage1, self.windows, self.stage2 = ReducedKeys(64, 4), WindowTable(64, 4, 4), ReducedKeys(32, 2)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.embed1(image)  # (B, 64, 8, 8)
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.stage1(t, [h, w])
        win = t.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
        win = win + self.windows(win)
        t = win.view(b, h // 2, w // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h * w, c)
        x = self.embed2(t.transpose(1, 2).reshape(b, c, h, w))
        t = x.flatten(2).transpose(1, 2)
        return t + self.stage2(t, [4, 4])


def test_a_layer_tied_to_its_recorded_length_is_probed_there():
    """catches: layers called with their feature map's (H, W), or with a fixed window, probed only at the doctor's
    own lengths: the one that lined up with the width (64 tokens) was batch-mixing, the one that lined up with the
    heads (4 tokens) shape-dependent, the others could not run; the model's own call shows the layer's length."""
    torch.manual_seed(0)
    report = check_model(Pyramid().eval(), torch.randn(2, 3, 16, 16))
    assert report.verdict == "passed" and len(report.layers) == 3, report.summary()


class Attend(nn.Module):
    """The attention core alone, as x-transformers splits it: q (B, H, L, D) with keys and values that carry learned
    memory slots and fewer heads (grouped), and talking heads (a 1 x 1 convolution over the heads of the weights)."""

    def __init__(self, heads: int, groups: int, over_queries: bool = False) -> None:
        super().__init__()
        self.groups, self.over_queries = groups, over_queries
        self.talk = nn.Conv2d(heads, heads, 1, bias=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-2 if self.over_queries else -1)
        return self.talk(weights) @ v


class MemoryAttention(nn.Module):
    """Grouped-query attention with two learned memory key/value slots, calling its core with q, k, v."""

    def __init__(self, dim: int = 64, heads: int = 4, groups: int = 2, over_queries: bool = False) -> None:
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, dim // heads
        self.to_q, self.to_kv = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 2 * groups * self.d, bias=False)
        self.mem_k, self.mem_v = (nn.Parameter(torch.randn(groups, 2, self.d)) for _ in range(2))
        self.attend, self.out = Attend(heads, groups, over_queries), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = self.to_kv(x).view(b, n, 2, self.groups, self.d).permute(2, 0, 3, 1, 4)
        k = torch.cat((self.mem_k.expand(b, -1, -1, -1), k), dim=2)
        v = torch.cat((self.mem_v.expand(b, -1, -1, -1), v), dim=2)
        return self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, n, -1))


class MemoryModel(nn.Module):
    def __init__(self, over_queries: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.layers = nn.ModuleList(MemoryAttention(over_queries=over_queries) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_the_layer_around_a_core_with_memory_and_grouped_keys_is_checked():
    """catches: a core called with memory keys or grouped keys (q, k and v of different shapes) taken for the layer,
    so the layer was never checked (inconclusive, and a bug in it not named); weights mixed across heads by a
    convolution before the values product (talking heads) hid the layer."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 7))
    report = check_model(MemoryModel().eval(), ids)
    assert report.verdict == "passed" and list(report.layers) == ["layers.0", "layers.1"], report.summary()
    buggy = check_model(MemoryModel(over_queries=True).eval(), ids)
    assert all("softmax-dim" in r.ids for r in buggy.layers.values()) and len(buggy.layers) == 2, buggy.summary()


class ZeroGainAttention(nn.Module):
    """Attention whose output goes through a norm with its gain initialised at 0 (as LeViT's and some residual
    branches do, so that a fresh block is the identity): at initialisation the layer's output is constant."""

    def __init__(self, dim: int = 64, heads: int = 4, over_queries: bool = False) -> None:
        super().__init__()
        self.heads, self.over_queries = heads, over_queries
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        nn.init.zeros_(self.norm.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-2 if self.over_queries else -1)
        return self.norm(self.proj((w @ v).transpose(1, 2).reshape(b, n, e)))


def test_a_layer_silenced_by_a_zero_gain_is_still_found_and_checked():
    """catches: a layer whose zero-initialised gain makes its output constant was set aside as not self-attention
    before its zeros were drawn at random, so a bug in it was never named (the whole model certified)."""
    torch.manual_seed(0)
    model = nn.Sequential(ZeroGainAttention(), ZeroGainAttention(over_queries=True)).eval()
    report = check_model(model, torch.randn(2, 7, 64))
    assert report.layers["0"].verdict == "passed" and "softmax-dim" in report.layers["1"].ids, report.summary()


def test_cli_factory_may_import_a_file_beside_it_when_called(tmp_path):
    """catches: the target's folder was importable only while its file was imported, so a factory importing a
    sibling file inside its body (a model built from a module chosen by name) exited 2 with ModuleNotFoundError."""
    (tmp_path / "blocks.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Attn(nn.Module):
            def __init__(self, e):
                super().__init__()
                self.qkv, self.o = nn.Linear(e, 3 * e), nn.Linear(e, e)
            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, -1)
                return self.o(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)
        """))
    src = tmp_path / "net.py"
    src.write_text(textwrap.dedent("""
        import importlib
        import torch

        def make():
            blocks = importlib.import_module("blocks")
            return blocks.Attn(16), torch.randn(2, 5, 16)
        """))
    run = [sys.executable, "-m", "selfattn.cli", "check", "--model", "--json", f"{src}:make"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stdout + done.stderr


class DistanceBias(nn.Module):
    """A learned bias per head and clipped distance, shared by every layer and passed to each in its call."""

    def __init__(self, heads: int = 4, reach: int = 8) -> None:
        super().__init__()
        self.reach, self.table = reach, nn.Embedding(2 * reach + 1, heads)

    def forward(self, n: int) -> torch.Tensor:
        i = torch.arange(n, device=self.table.weight.device)
        return self.table((i[None, :] - i[:, None]).clamp(-self.reach, self.reach) + self.reach).permute(2, 0, 1)


class BiasedAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rel_pos: nn.Module) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + rel_pos(n)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class SharedBiasModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rel, self.layers = DistanceBias(), nn.ModuleList(BiasedAttention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, rel_pos=self.rel)
        return x


def test_a_module_the_model_passes_to_its_layers_follows_the_probes_dtype():
    """catches: a bias module the model passes in its call (x-transformers' rel_pos) replayed in float32 beside the
    layer's half-precision copy, so its correct layers were half-precision-overflow."""
    torch.manual_seed(0)
    report = check_model(SharedBiasModel().eval(), torch.randn(2, 7, 64))
    assert report.verdict == "passed" and len(report.layers) == 2, report.summary()


class ScratchAttention(nn.Module):
    """From-scratch grouped-query attention: ``forward(x, mask, cos, sin)``, the (L, L) bool mask required and True
    where a key is hidden (the model builds it with triu), rotary from the model's tables."""

    def __init__(self, d: int = 64, heads: int = 4, groups: int = 2) -> None:
        super().__init__()
        self.heads, self.groups, self.hd = heads, groups, d // heads
        self.W_query = nn.Linear(d, d, bias=False)
        self.W_key, self.W_value = (nn.Linear(d, groups * self.hd, bias=False) for _ in range(2))
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = (w(x).view(b, n, self.groups, self.hd).transpose(1, 2) for w in (self.W_key, self.W_value))
        q, k = _rotate(q, cos[:, :n], sin[:, :n]), _rotate(k, cos[:, :n], sin[:, :n])
        k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
        scores = (q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf)
        w = torch.softmax(scores / self.hd ** 0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, -1))


class ScratchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.blocks = nn.Embedding(100, 64), nn.ModuleList(ScratchAttention() for _ in range(2))
        cos, sin = _rope(32, 16)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)
        for block in self.blocks:
            x = x + block(x, mask, self.cos, self.sin)
        return x


def test_a_required_mask_that_hides_where_true_is_sent_so():
    """catches: a layer whose (L, L) bool mask is required and True where hidden: its "hide nothing" mask made in
    the keep convention hid everything, no other was tried, and every layer could not run (from-scratch LLMs)."""
    torch.manual_seed(0)
    report = check_model(ScratchModel().eval(), torch.randint(0, 100, (2, 9)))
    assert report.verdict == "passed" and len(report.layers) == 2, report.summary()


class SequenceFirstLM(nn.Module):
    """PyTorch's language-model tutorial: token ids (L, B), an nn.TransformerEncoder with batch_first=False and the
    square subsequent mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[0])
        return self.encoder(self.emb(src), mask=mask, is_causal=True)


def test_layers_a_model_calls_sequence_first_are_replayed_so():
    """catches: a layer the model calls with (L, B, E) (batch_first=False) probed batch first, its (L, L) mask cut
    on the batch's axis: every layer could not run."""
    torch.manual_seed(0)
    report = check_model(SequenceFirstLM().eval(), torch.randint(0, 100, (10, 2)))
    assert report.verdict == "passed" and len(report.layers) == 2, report.summary()


def test_xlnet_relative_attention_is_replayed_with_its_positions_cut_on_the_batch_axis():
    """catches: XLNet's relative attention, called sequence first with (2L, B, D) positions, was replayed with the
    positions of the model's whole batch for an item alone (batch-mixing on an output of batch 2); its (L, L, B, 1)
    mask was tried in no shape (inconclusive); its bool mask, turned into a float32 term, raised in float16
    (half-precision-overflow) where the model gives it a float mask in its own dtype."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.XLNetConfig(d_model=32, n_head=4, d_inner=64, n_layer=2, vocab_size=64)
    report = check_model(transformers.XLNetModel(config).eval(), {"input_ids": _ids() % 64})
    assert [row["verdict"] for row in report.summary()] == ["passed"] * 2, report.summary()
    layer = next(iter(report.layers.values()))
    assert layer.inferred["mask"]["shape"] == "(L, L, B, 1)", layer.inferred["mask"]


def test_a_layer_that_ignores_the_models_mask_is_mask_ignored_and_not_inverted():
    """catches: a layer that never applies the mask its model passes was named mask-ignored and also
    mask-inverted (the replay with the model's mask saw the padded tokens move the real ones, read as polarity)."""
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 4:] = 0
    rows = {row["layer"]: row for row in check_model(_PaddedEncoder("none"), (_ids(), padding)).summary()}
    assert "mask-ignored" in rows["layers.1"]["findings"] and "mask-inverted" not in rows["layers.1"]["findings"], rows


class _BiasAttention(_KeepMaskAttention):
    """The model's padding passed as an additive ``attn_bias`` (xformers' name, no mask name); ``applies``: whether
    the layer adds it."""

    def __init__(self, e: int, h: int, applies: bool = True) -> None:
        super().__init__(e, h, "keep" if applies else "none")

    def forward(self, x, attn_bias=None):
        return super().forward(x, attn_bias)


class _BiasEncoder(nn.Module):
    def __init__(self, applies: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(_BiasAttention(32, 4, applies) for _ in range(2))

    def forward(self, ids, attention_mask):
        x = self.emb(ids)
        bias = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            x = x + layer(x, bias)
        return x


def test_the_models_padding_under_another_name_is_replayed_and_must_hide_the_padding():
    """catches: a layer that takes the model's padding as ``attn_bias`` (not named like a mask, so the doctor's own
    masks never go there) and never adds it was certified; the argument that carries the model's padding is found
    by its values and the call replayed with the padded tokens changed."""
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 4:] = 0
    assert check_model(_BiasEncoder(), (_ids(), padding)).verdict == "passed"
    rows = check_model(_BiasEncoder(applies=False), (_ids(), padding)).summary()
    assert all("mask-ignored" in row["findings"] for row in rows), rows


class _SequenceFirstByDefault(nn.Module):
    """torch's MultiheadAttention, ``batch_first`` left at its default (False) or set, handed (B, L, E) states."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first)

    def forward(self, ids):
        x = self.emb(ids)
        return x + self.attn(x, x, x, need_weights=False)[0]


def test_a_sequence_first_layer_handed_batch_first_states_attends_over_the_batch():
    """catches: nn.MultiheadAttention left at batch_first=False and given (B, L, E) (each token attends over the
    other items at its position) was certified: its batch_first=False alone made the doctor replay it sequence
    first, the way it should have been called."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    assert check_model(_SequenceFirstByDefault(True), (ids,)).verdict == "passed"
    assert "batch-mixing" in check_model(_SequenceFirstByDefault(False), (ids,)).summary()[0]["findings"]


class _CachedBias(nn.Module):
    """Attention with a learned bias per head and token pair, cached in a dict by device in eval mode and dropped
    when training starts (as LeViT keeps its attention biases): the model's run with autograd on leaves tensors
    with history in the dict."""

    def __init__(self, e: int = 32, h: int = 4, n: int = 7) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(e, 3 * e)
        self.biases = nn.Parameter(0.1 * torch.randn(h, n, n))
        self.cache: dict[str, torch.Tensor] = {}

    def train(self, mode: bool = True) -> _CachedBias:
        super().train(mode)
        if mode:
            self.cache = {}
        return self

    def bias(self) -> torch.Tensor:
        if self.training:
            return self.biases
        key = str(self.biases.device)
        if key not in self.cache:
            self.cache[key] = self.biases * 1.0
        return self.cache[key]

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.bias()[:, :n, :n]
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)


def test_a_layer_whose_cache_holds_tensors_with_history_is_copied():
    """catches: a bias cache (a dict attribute) filled during the model's run with autograd on held tensors with
    history, which deepcopy refuses: every copy the probes make failed (inconclusive, the doctor's own failure)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), _CachedBias())
    layer = check_model(model.eval(), (_ids(),)).layers["1"]
    assert not layer.not_verified and "not verified" not in str(layer.coverage), layer.coverage


def test_a_model_cast_to_bfloat16_keeps_its_rotary_tables_rounding_and_passes():
    """catches: Llama cast to bfloat16 was rotary-mismatch: its rotary cos and sin, recorded in bfloat16, rotate by
    matrices orthogonal only to bfloat16's rounding in the float64 replay, which the one-token-everywhere check held
    to 1e-4 of the scores."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "eager"
    model = transformers.LlamaModel(config).to(torch.bfloat16).eval()
    report = check_model(model, {"input_ids": torch.randint(0, 64, (2, 7))})
    assert report.verdict == "passed", report.summary()


def test_bloom_with_padding_reads_its_alibi_per_item():
    """catches: BLOOM with a padded item (its ALiBi counts each item's positions from its padding, (B * H, 1, L))
    was definition-mismatch, a term that differs between items, and its ALiBi was not cut for an item alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=64)
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 5:] = 0
    report = check_model(transformers.BloomModel(config).eval(), {"input_ids": _ids() % 64, "attention_mask": padding})
    assert report.verdict == "passed", report.summary()


class _PooledEncoder(nn.Module):
    """An encoder layer, then attention pooling as SigLIP's head computes it: one learned query per item attends
    over the encoder's tokens (torch's MultiheadAttention, batch first)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layer = _KeepMaskAttention(32, 4)
        self.probe = nn.Parameter(torch.randn(1, 1, 32))
        self.pool = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.layer(x)
        probe = self.probe.repeat(x.shape[0], 1, 1)
        return self.pool(probe, x, x, need_weights=False)[0][:, 0]


def test_an_attention_pooling_head_is_not_checked_as_self_attention():
    """catches: SigLIP's pooling head (one learned query over the tokens) was probed with the query as its input,
    (B, 1, E): definition-mismatch, and the whole model failed."""
    torch.manual_seed(0)
    report = check_model(_PooledEncoder().eval(), (_ids(),))
    assert report.verdict == "passed" and "one token" in report.not_self_attention["pool"], report.summary()


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, -1)
    return torch.cat((-b, a), -1)


class _StackedRotary(nn.Module):
    """Rotary attention whose model passes cos and sin stacked in one (2, L, D) table, and a causal padding mask."""

    def __init__(self, e: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.qkv, self.o = nn.Linear(e, 3 * e, bias=False), nn.Linear(e, e, bias=False)

    def forward(self, x, freqs, mask):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        q, k = (t * freqs[0] + _rotate_half(t) * freqs[1] for t in (q, k))
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, e))


class _StackedRotaryLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(_StackedRotary() for _ in range(2))

    def forward(self, ids, attention_mask):
        n = ids.shape[1]
        f = torch.outer(torch.arange(n).float(), 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)).repeat(1, 2)
        freqs = torch.stack([f.cos(), f.sin()])
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer(x, freqs, mask)
        return x


def test_a_table_whose_first_size_is_the_batch_is_not_cut_per_item():
    """catches: a (2, L, D) stack of rotary cos and sin, given by a model run at batch 2, was cut to one item for an
    item alone, as if per item: the padding probe raised (inconclusive). The model is run on one item alone too:
    what keeps its first size there is a table."""
    torch.manual_seed(0)
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 5:] = 0
    report = check_model(_StackedRotaryLM().eval(), (_ids(), padding))
    assert report.verdict == "passed", report.summary()


@pytest.mark.parametrize("diagonal", [2, 0], ids=["shows-the-next", "hides-the-diagonal"])
def test_a_causal_mask_the_model_builds_off_by_one_is_a_causal_leak(diagonal):
    """catches: a model whose causal mask shows each token the next one (triu(2) for triu(1)), or hides each
    token's own key (triu(0)), was certified: each layer's probes replace the model's mask with the doctor's. The
    recorded call is replayed with the model's own mask and each row's dependencies read."""
    torch.manual_seed(0)
    rows = check_model(_CachedDecoder(diagonal=diagonal), (_ids(),)).summary()
    assert all("causal-leak" in row["findings"] for row in rows), rows


class _SharedBiasAttention(nn.Module):
    """T5's attention: no scale on the scores; the first layer owns a learned bias per head and relative distance,
    adds the padding mask into it and returns it, later layers take that ``position_bias`` and leave ``mask``
    unread. ``adds_mask``: the first layer adds the mask into the bias it passes on (False: the bug, later layers
    see the padding)."""

    def __init__(self, e: int = 32, h: int = 4, owns_bias: bool = False, adds_mask: bool = True) -> None:
        super().__init__()
        self.h, self.adds_mask = h, adds_mask
        self.q, self.k, self.v, self.o = (nn.Linear(e, e, bias=False) for _ in range(4))
        self.relative_attention_bias = nn.Embedding(16, h) if owns_bias else None

    def forward(self, x, mask=None, position_bias=None):
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        if position_bias is None:
            assert self.relative_attention_bias is not None
            rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]  # T5's buckets: exact ones, each direction
            buckets = torch.where(rel > 0, 8 + rel.clamp(max=7), (-rel).clamp(max=7))
            position_bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]
            if mask is not None and self.adds_mask:
                position_bias = position_bias + mask
        w = (q @ k.transpose(-1, -2) + position_bias).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, e)), position_bias


class _SharedBiasEncoder(nn.Module):
    def __init__(self, adds_mask: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(_SharedBiasAttention(owns_bias=i == 0, adds_mask=adds_mask) for i in range(2))

    def forward(self, ids, attention_mask):
        x = self.emb(ids)
        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        bias = None
        for layer in self.layers:
            y, bias = layer(x, mask, bias)
            x = x + y
        return x


def test_t5s_later_layers_take_the_padding_and_the_bias_from_the_first():
    """catches: T5's later layers (given the first layer's position_bias, with the padding added in, and no bias
    table of their own) were mask-ignored (their mask argument is not read) and missing-scale (T5's unscaled
    design was read only on the layer that owns the table). Padding that does not reach the later layers is still
    named."""
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 4:] = 0
    torch.manual_seed(0)
    report = check_model(_SharedBiasEncoder().eval(), (_ids(), padding))
    assert report.verdict == "passed", report.summary()
    rows = {row["layer"]: row for row in check_model(_SharedBiasEncoder(adds_mask=False).eval(),
                                                     (_ids(), padding)).summary()}
    assert "mask-ignored" in rows["layers.1"]["findings"], rows


class _TupleEinsum(nn.Module):
    """Attention whose values product is written ``einsum(eq, (weights, v))``, the operands in a tuple (as
    Longformer's sliding-window code writes it)."""

    def __init__(self, e: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(e, 3 * e)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        w = torch.einsum("bhqd,bhkd->bhqk", (q, k)).div(math.sqrt(q.shape[-1])).softmax(-1)
        return torch.einsum("bhqk,bhkd->bqhd", (w, v)).reshape(b, n, e)


def test_a_product_whose_operands_come_in_a_tuple_is_found():
    """catches: einsum(eq, (weights, v)) hid the weights from the search for attention layers (only the call's own
    arguments were looked at): LED's and Longformer's encoder layers were left out of the report, which said
    "passed" over the decoder's alone."""
    torch.manual_seed(0)
    report = check_model(nn.Sequential(nn.Embedding(50, 32), _TupleEinsum()), (_ids(),))
    assert list(report.layers) == ["1"] and report.verdict == "passed", report.summary()


def test_led_encoder_layers_are_reported():
    """catches: LED's sliding-window encoder attention (its weights turned from a band of diagonals into chunks with
    pad before the product) was missing from the report; found, its white box cannot read that layout, which is
    said (inconclusive), not a definition-mismatch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LEDConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, max_encoder_position_embeddings=64,
                                    max_decoder_position_embeddings=64, attention_window=4)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    layer = "encoder.layers.0.self_attn.longformer_self_attn"
    report = check_model(transformers.LEDModel(config).eval(), {"input_ids": ids, "decoder_input_ids": ids[:, :5]},
                         layers=[layer])
    assert report.layers[layer].verdict in ("passed", "inconclusive"), report.summary()


class _FiniteFillDecoder(_CachedDecoder):
    """The same decoder with its causal mask filled with finfo.min: hiding the diagonal too leaves the first query
    a uniform weight over every key instead of NaN."""

    def forward(self, ids, start_pos: int = 0):
        x = self.emb(ids)
        n = ids.shape[1]
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(self.diagonal)
        for layer in self.layers:
            x = x + layer(x, start_pos, mask)
        return x


@pytest.mark.parametrize("diagonal", [1, 0], ids=["correct", "hides-the-diagonal"])
def test_a_causal_mask_filled_with_finfo_min_that_hides_the_diagonal_is_a_causal_leak(diagonal):
    """catches: a model's causal mask that hides the diagonal too, filled with finfo.min, was certified: the first
    query's weights spread over every key, the later rows see only the past."""
    torch.manual_seed(0)
    rows = check_model(_FiniteFillDecoder(diagonal=diagonal), (_ids(),)).summary()
    if diagonal:
        assert all(row["verdict"] == "passed" for row in rows), rows
    else:
        assert all("causal-leak" in row["findings"] for row in rows), rows

"""A tiny character-level GPT built only from selfattn modules, trained on the CPU.

The text is the source of Python's own ``argparse`` module (it ships with every Python, so
nothing is downloaded). After training it prints the loss curve, then generates greedily twice:
with the KV cache (one token per step) and by recomputing the whole sequence each step; the two
must agree token for token.

    python examples/tiny_gpt.py            # a few minutes
    python examples/tiny_gpt.py --quick    # under a minute

Shape legend: B batch, T tokens, E embed dim, V vocabulary.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time

import torch
from torch import Tensor, nn

import selfattn
from selfattn import KVCache, MultiHeadAttention, PagedKVCache


class Block(nn.Module):
    def __init__(self, e: int, heads: int, kv_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(e), nn.LayerNorm(e)
        self.attn = MultiHeadAttention(e, heads, num_kv_heads=kv_heads, dropout=dropout, rope=True)
        self.mlp = nn.Sequential(nn.Linear(e, 4 * e), nn.GELU(), nn.Linear(4 * e, e))

    def forward(self, x: Tensor, cache: KVCache | PagedKVCache | None, positions: Tensor | None,
                seq_ids: list[int] | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        h = self.ln1(x)
        if cache is None:
            x = x + self.attn(h, causal=True)
        elif isinstance(cache, PagedKVCache):  # a packed step of many sequences (examples/serve.py)
            x = x + self.attn(h, cache=cache, seq_ids=seq_ids, cu_seqlens=cu_seqlens)
        else:
            x = x + self.attn(h, cache=cache, positions=positions)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, e: int = 96, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, e)
        self.blocks = nn.ModuleList(Block(e, heads, kv_heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(e)
        self.head = nn.Linear(e, vocab, bias=False)
        self.heads, self.kv_heads, self.e = heads, kv_heads, e

    def forward(self, idx: Tensor, caches: list[KVCache] | list[PagedKVCache] | None = None,
                positions: Tensor | None = None, seq_ids: list[int] | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """Logits (B, T, V). With KVCaches: ``positions`` (B, T). With PagedKVCaches (one per block):
        idx (1, T) packs new tokens of the sequences ``seq_ids`` as ``cu_seqlens`` says."""
        x = self.embed(idx)  # (B, T, E)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], positions, seq_ids, cu_seqlens)
        return self.head(self.ln(x))  # (B, T, V)

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        return [KVCache(batch, max_len, self.kv_heads, self.e // self.heads) for _ in self.blocks]


@torch.no_grad()
def generate(model: TinyGPT, prompt: Tensor, steps: int, use_cache: bool) -> list[int]:
    """Greedy decoding of ``steps`` tokens after ``prompt`` (1, T)."""
    model.eval()
    idx = prompt
    if not use_cache:
        for _ in range(steps):
            nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx[0, prompt.shape[1]:].tolist()
    caches = model.new_caches(1, prompt.shape[1] + steps)
    logits = model(idx, caches, torch.arange(idx.shape[1])[None])
    out = []
    for step in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        out.append(int(nxt))
        pos = torch.tensor([[prompt.shape[1] + step]])
        logits = model(nxt, caches, pos)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    p.add_argument("--steps", type=int, default=None, help="training steps")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    text = inspect.getsource(argparse)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text])
    steps = args.steps or (120 if args.quick else 1500)
    block, batch = (64, 16) if args.quick else (128, 32)
    model = TinyGPT(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup_cosine = lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    print(f"tiny GPT: {sum(p.numel() for p in model.parameters()):,} parameters, {len(text):,} characters "
          f"of argparse.py, vocabulary {len(chars)}; selfattn {selfattn.__version__}")
    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(steps):
        ix = torch.randint(len(data) - block - 1, (batch,))
        x = torch.stack([data[i:i + block] for i in ix])
        y = torch.stack([data[i + 1:i + block + 1] for i in ix])
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % max(1, steps // 15) == 0 or step == steps - 1:
            bar = "#" * int(40 * loss.item() / max(losses[0], 1e-9))
            print(f"step {step:5d}  loss {loss.item():.3f}  {bar}  ({time.perf_counter() - t0:.0f}s)")
    prompt = data[:32][None]
    n = 40 if args.quick else 200
    cached = generate(model, prompt, n, use_cache=True)
    uncached = generate(model, prompt, n, use_cache=False)
    same = cached == uncached
    print("prompt:", repr("".join(chars[i] for i in prompt[0].tolist())))
    print("generated (KV cache):", repr("".join(chars[i] for i in cached)))
    print(f"cached and uncached greedy generation agree token for token: {same}")
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    summary = {"loss_first10": first, "loss_last10": last, "cached_equals_uncached": same, "steps": steps}
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

"""Train a small causal language model with its sequence split over 2 processes (context parallelism).

    torchrun --nproc-per-node 2 examples/context_parallel.py
    python examples/context_parallel.py          # the same, spawning the 2 processes itself

Each rank holds L / W tokens of every sequence (zigzag layout, which balances causal work). The
model's weights are replicated; only attention needs the other ranks' tokens, and
``selfattn.distributed.attention`` brings them (K/V around a ring). Gradients of the replicated
weights are averaged with all_reduce, as data parallelism would. Packed documents are masked
with ``masks.document(ids) & masks.causal()``, given on global positions.

Shape legend: B batch, L global length, n = L / W local tokens, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from selfattn import distributed as sad
from selfattn import masks

VOCAB, E, H, L, B, STEPS = 32, 64, 4, 256, 2, 30


class TinyLM(nn.Module):
    """Embedding, one context-parallel causal attention block with an MLP, and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, E)
        self.pos = nn.Embedding(L, E)
        self.qkv = nn.Linear(E, 3 * E)
        self.proj = nn.Linear(E, E)
        self.mlp = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: masks.Mask) -> torch.Tensor:
        b, n = tokens.shape  # this rank's tokens and their global positions
        x = self.embed(tokens) + self.pos(positions)  # (B, n, E)
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, H, E // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, n, D)
        a = sad.attention(q, k, v, layout="zigzag", mask=mask)  # (B, H, n, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, E))
        x = x + self.mlp(self.norm2(x))
        return x @ self.embed.weight.T  # (B, n, VOCAB)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents of a counting task (each token is the previous + 1); ids mark the documents."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, VOCAB, (B, 8), generator=gen)
    tokens = (starts.repeat_interleave(L // 8, dim=1) + torch.arange(L).remainder(L // 8)) % VOCAB  # (B, L)
    ids = torch.arange(L).div(L // 8, rounding_mode="floor").expand(B, L)  # 8 documents per row
    return tokens, ids


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = TinyLM().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    positions = sad.shard(torch.arange(L, device=dev).view(1, 1, L, 1), layout="zigzag").view(1, -1)  # (1, n)
    for step in range(STEPS):
        tokens, ids = batch(step)
        mask = masks.document(ids) & masks.causal()  # on global positions, the same on every rank
        tokens, ids = tokens.to(dev), ids.to(dev)
        inputs = sad.shard(tokens.view(B, 1, L, 1), layout="zigzag").view(B, -1)  # (B, n)
        targets = sad.shard(torch.roll(tokens, -1, dims=1).view(B, 1, L, 1), layout="zigzag").view(B, -1)
        last = positions.expand(B, -1) == L - 1  # the last position has no next token
        logits = model(inputs, positions.expand(B, -1), mask)
        loss = nn.functional.cross_entropy(logits[~last], targets[~last])
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # replicated weights: average the ranks' gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == STEPS - 1):
            print(f"step {step:3d}  loss {total.item() / world:.3f}")


def _spawned(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        main()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        try:
            main()
        finally:
            dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        mp.spawn(_spawned, args=(2, free_port), nprocs=2)

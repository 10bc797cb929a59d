"""Train a transformers Llama with each packed row split over the processes (context parallelism).

    torchrun --nproc-per-node 2 examples/hf_context_parallel.py     # gloo on CPUs, NCCL on GPUs
    python examples/hf_context_parallel.py                          # the same, spawning 2 processes itself
    python examples/hf_context_parallel.py --world 4 --steps 10     # 4 processes, fewer steps

    # two machines, 8 GPUs each (the same command on both; one rendezvous endpoint):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/hf_context_parallel.py --length 131072

The model is an ordinary ``AutoModelForCausalLM`` with ``attn_implementation="selfattn"``; nothing in it
changes. Inside ``context_parallel(model)``, ``cp.shard(...)`` cuts the global batch (token ids, the
``position_ids`` that restart at each packed document, the labels) into this rank's L / W tokens (zigzag
layout); every attention layer then attends over the whole row, bringing the other ranks' keys and values
around a ring; the loss the model returns is the global one, and the gradients are summed over the ranks
when the backward ends. The weights stay replicated, so every rank takes the same optimizer step.

Before training, the first step is checked against the same model run in one process on the whole row:
the loss and every gradient must agree (float32 round-off), or the script exits with status 1.

Shape legend: L tokens in a packed row, W processes, V vocabulary.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig

from selfattn.integrations import transformers as sa_hf

V = 64
IGNORE = -100


def packed_row(length: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One global row of counting documents (s, s+1, ... modulo V) packed to ``length`` tokens:
    input_ids, position_ids (restarting per document) and labels (a document's first token unlabelled)."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    while len(ids) < length:
        n = min(int(torch.randint(16, 96, (1,), generator=gen)), length - len(ids))
        start = int(torch.randint(0, V, (1,), generator=gen))
        doc = [(start + i) % V for i in range(n)]
        ids += doc
        pos += range(n)
        labels += [IGNORE, *doc[1:]]
    return {k: torch.tensor(v).unsqueeze(0) for k, v in
            (("input_ids", ids), ("position_ids", pos), ("labels", labels))}


def build(device: torch.device, length: int) -> torch.nn.Module:
    """A small Llama with selfattn attention, the same weights on every rank (seeded)."""
    sa_hf.register()
    cfg = LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="selfattn").to(device)


def check_first_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], group_rank: int,
                     layout: str = "zigzag") -> bool:
    """One step under the context against the same model in one process on the whole row."""
    reference = copy.deepcopy(model)
    want = reference(**batch, use_cache=False).loss  # transformers finds packed documents only without a cache
    want.backward()
    with sa_hf.context_parallel(model, layout=layout) as cp:
        got = model(**cp.shard(**batch)).loss
        got.backward()
    loss_err = abs(got.item() - want.item()) / abs(want.item())
    grad_err = max(float((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-30))
                   for p, r in zip(model.parameters(), reference.parameters(), strict=True))
    model.zero_grad(set_to_none=True)
    ok = loss_err < 1e-5 and grad_err < 1e-4
    if group_rank == 0:
        print(f"first step vs one process on the whole row: loss rel. error {loss_err:.1e}, largest gradient "
              f"rel. error {grad_err:.1e} -> {'equal' if ok else 'DIFFERENT'}")
    return ok


def main(length: int, steps: int, layout: str = "zigzag") -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = build(dev, length)
    gen = torch.Generator().manual_seed(1)  # the same global batches on every rank
    if not check_first_step(model, {k: v.to(dev) for k, v in packed_row(length, gen).items()}, rank, layout):
        return 1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = last = 0.0
    for step in range(steps):
        batch = {k: v.to(dev) for k, v in packed_row(length, gen).items()}
        with sa_hf.context_parallel(model, layout=layout) as cp:
            loss = model(**cp.shard(**batch)).loss  # the global loss; each rank holds its share of the row
            loss.backward()  # gradients summed over the ranks at the end of the backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        first, last = (loss.item() if step == 0 else first), loss.item()
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {last:.3f}  ({world} processes, {layout} layout)")
    if rank == 0 and steps > 1:
        print(f"loss {first:.3f} -> {last:.3f}")
    return 0


def _spawned(rank: int, world: int, port: int, length: int, steps: int, layout: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        code = main(length, steps, layout)
    finally:
        dist.destroy_process_group()
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens per packed row (any: padded inside)")
    parser.add_argument("--layout", choices=("zigzag", "contiguous", "balanced"), default="zigzag",
                        help="balanced: each row's documents shared out by their causal work")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        try:
            status = main(args.length, args.steps, args.layout)
        finally:
            dist.destroy_process_group()
        raise SystemExit(status)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world, free_port, args.length, args.steps, args.layout), nprocs=args.world)

"""Train a tiny transformers Llama on packed sequences with selfattn as its attention.

Packing puts several documents in one row; ``position_ids`` restart at each document, and
transformers turns that into a "same document and causal" mask. With selfattn the mask stays an
object (``document & causal``): tiles across documents are skipped, never materialised.

The data is simple on purpose: each document counts up from a random start (s, s+1, s+2, ...
modulo V), so the loss falls within a few dozen steps; the first token of each document is not
predictable and is not labelled. At the end, the model's loss is compared with the same model
run with ``eager`` attention (they must agree), and the loss must have dropped.

    python examples/hf_packed_training.py            # ~1 minute on 2 CPU cores
    python examples/hf_packed_training.py --quick    # a few seconds

Shape legend: L tokens in a packed row, V vocabulary.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from selfattn.integrations import transformers as sa_hf

V = 64


def packed_row(length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (1, L), position_ids (1, L), labels (1, L)) of counting documents packed until the
    row is full; each document's first token is unlabelled (-100)."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    while len(ids) < length:
        n = int(torch.randint(8, 40, (1,), generator=gen))
        start = int(torch.randint(0, V, (1,), generator=gen))
        doc = [(start + i) % V for i in range(n)]
        ids += doc
        pos += list(range(n))
        labels += [-100, *doc[1:]]

    def row(x: list[int]) -> torch.Tensor:
        return torch.tensor(x[:length]).unsqueeze(0)
    return row(ids), row(pos), row(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter steps")
    args = parser.parse_args()
    steps, length = (30, 256) if args.quick else (100, 1024)

    name = sa_hf.register()  # "selfattn"
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)

    start, losses = time.perf_counter(), []
    for step in range(steps):
        ids, pos, labels = packed_row(length, gen)
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, steps // 6) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    print(f"{steps} steps of {length} packed tokens in {time.perf_counter() - start:.1f} s")

    model.eval()
    ids, pos, labels = packed_row(length, gen)
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=pos, labels=labels).loss.item()
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, position_ids=pos, labels=labels).loss.item()
    print(f"held-out loss: selfattn {ours:.5f}, eager {eager:.5f}")
    assert abs(ours - eager) < 1e-4 * max(1.0, abs(eager)), "selfattn and eager disagree"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}")
    assert last < first, "the loss did not drop"


if __name__ == "__main__":
    main()

"""Train a tiny language model on a memmap token dataset, with async checkpoints and resume.

    python examples/lm_train.py                          # tiny synthetic corpus, CPU, ~10 s
    python examples/lm_train.py --workdir run --crash-at 17   # dies after step 17 ...
    python examples/lm_train.py --workdir run            # ... and resumes from the last save

The corpus is written with ``feedpipe.MemmapWriter`` (fixed layout: ``seq_len + 1`` int32 tokens
per record) and read with ``feedpipe.MemmapDataset`` through ``feedpipe.DataLoader`` (thread
workers, one vectorised gather per batch). Every ``--save-every`` steps the model, the
optimizer, the loader's position and the RNG states go to a ``ckpt.CheckpointManager``: the loop
pays only for the copy into the staging pool, the write and commit run in the background. With
a GPU, batches reach it through the loader's GPU feed (``device="cuda"``). On
start, the newest checkpoint that verifies is restored, and training continues exactly where it
was: the same batches and (on CPU) bit-identical losses as a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import ckpt
import feedpipe


def write_corpus(path: Path, records: int, seq_len: int, vocab: int, seed: int) -> None:
    """A learnable synthetic corpus: each token is an affine function of the previous one,
    with 10% random tokens mixed in."""
    rng = np.random.default_rng(seed)
    with feedpipe.MemmapWriter(path, shape=(seq_len + 1,), dtype="int32") as w:
        for _ in range(records):
            seq = np.empty(seq_len + 1, dtype=np.int64)
            seq[0] = rng.integers(vocab)
            for t in range(1, seq_len + 1):
                seq[t] = (5 * seq[t - 1] + 3) % vocab
            noise = rng.random(seq_len + 1) < 0.1
            seq[noise] = rng.integers(vocab, size=int(noise.sum()))
            w.append(seq.astype(np.int32))


class TinyLM(nn.Module):
    """Embedding, one causal transformer layer, output head."""

    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.block = nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.block(h, src_mask=self.mask, is_causal=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="dataset + checkpoints (default: a temporary directory)")
    p.add_argument("--records", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="thread workers of the loader")
    p.add_argument("--crash-at", type=int, help="die (os._exit) right after this step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cuda' or 'cpu'")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # deterministic and light: leave the cores to the loader
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = Path(tmp.name)
    else:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "tokens"
    if not (data / "index.json").exists():
        write_corpus(data, args.records, args.seq_len, args.vocab, args.seed)
    dataset = feedpipe.MemmapDataset(data)
    print(f"dataset: {len(dataset)} sequences of {dataset.shape[0]} tokens in {data}")

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.seq_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = feedpipe.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        worker_type="thread",
        generator=torch.Generator().manual_seed(args.seed),
        # on a GPU, batches arrive on the device through feedpipe's pinned ring (GPU feed);
        # "cpu" gives host batches, as without device=
        device=device,
    )
    # Everything that defines "where training is": saved together, restored together.
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}

    manager = ckpt.CheckpointManager(workdir / "checkpoints", keep_last=args.keep_last)
    if manager.latest_step() is not None:
        manager.restore(into=state)  # newest step that verifies; RNG states too
        print(f"resumed from step {state['step']} ({manager.stats.last_restore.nbytes} bytes)")

    step, blocked, start = int(state["step"]), 0.0, time.perf_counter()
    while step < args.steps:
        for batch in loader:  # a resumed loader continues mid-epoch
            x, y = batch[:, :-1].long(), batch[:, 1:].long()
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            print(f"step {step} loss {loss.item()!r}")
            if step % args.save_every == 0 or step == args.steps:
                state["step"] = step
                handle = manager.save(step, state, rng=True)  # returns after the copy
                blocked += handle.stats.blocked_s
            if args.crash_at is not None and step == args.crash_at:
                print(f"crashing after step {step}", flush=True)
                os._exit(3)  # no cleanup: saves in flight may be lost, committed ones are not
            if step >= args.steps:
                break
    manager.close()  # waits for the saves in flight
    elapsed = time.perf_counter() - start
    print(
        f"done: step {step}, {elapsed:.2f} s; checkpoints {manager.steps()} in "
        f"{manager.directory}; the loop was blocked {blocked * 1e3:.1f} ms by saves; "
        f"input: {loader.meter.summary()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

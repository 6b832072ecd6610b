"""The main job: train a small model on a sharded on-disk dataset, with async checkpoints.

No arguments, no GPU, no network; runs in well under a minute:

    make demo        # or: .venv/bin/python examples/demo.py

1. Writes a synthetic classification dataset with ``feedpipe.MemmapWriter`` (float32 feature
   rows plus an int64 ``label`` side field, in a few shards) to a temporary directory.
2. Trains a small MLP for a few hundred steps through ``feedpipe.DataLoader`` over
   ``feedpipe.MemmapDataset`` (thread workers: its batched gather releases the GIL).
3. Saves an asynchronous checkpoint with ``ckpt.CheckpointManager`` every ``SAVE_EVERY`` steps
   (model, optimizer, loader position) and reports how long each save blocked the loop.
4. Restores the latest checkpoint into a fresh model, optimizer and loader: the checksums
   verify and the weights equal the trained ones.
5. Prints the throughput, how long the loop waited for data and the stall report.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import ckpt
import feedpipe

FEATURES, CLASSES, SAMPLES = 32, 10, 16_384
BATCH, EPOCHS, SAVE_EVERY, SEED = 128, 3, 64, 0


def write_dataset(root: Path) -> feedpipe.MemmapDataset:
    """A learnable synthetic task (labels from a random linear teacher), in 4 shards."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)).argmax(1)
    shard_bytes = SAMPLES * FEATURES * 4 // 4
    with feedpipe.MemmapWriter(
        root, shape=(FEATURES,), dtype="float32", fields={"label": "int64"}, shard_bytes=shard_bytes
    ) as writer:
        writer.append_batch(x, label=y)
    return feedpipe.MemmapDataset(root)


def make_run(dataset: feedpipe.MemmapDataset) -> dict:
    """Everything that defines "where training is": saved and restored together."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    loader = feedpipe.DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        worker_type="thread",
        persistent_workers=True,  # one thread pool for the whole run
        generator=torch.Generator().manual_seed(SEED),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}


def main() -> int:
    torch.set_num_threads(1)  # a tiny model: leave the other core to the loader's threads
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_dataset(Path(tmp) / "data")
        print(f"dataset: {len(dataset)} records in {len(dataset.index.shards)} shards")
        run = make_run(dataset)
        model, optimizer, loader = run["model"], run["optimizer"], run["loader"]
        manager = ckpt.CheckpointManager(Path(tmp) / "checkpoints", keep_last=2)
        step, samples, blocked, last = 0, 0, [], EPOCHS * len(loader)
        start = time.perf_counter()
        for epoch in range(EPOCHS):
            correct = seen = 0
            for batch in loader:
                x, y = batch["data"], batch["label"]
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step, samples = step + 1, samples + len(y)
                correct, seen = correct + int((logits.argmax(1) == y).sum()), seen + len(y)
                if step % SAVE_EVERY == 0 or step == last:
                    run["step"] = step
                    handle = manager.save(step, run)  # returns once the state is copied
                    blocked.append(handle.stats.blocked_s)
            print(f"epoch {epoch}: loss {loss.item():.3f}, train accuracy {correct / seen:.1%}")
        elapsed = time.perf_counter() - start
        manager.wait()
        print(
            f"checkpoints: {len(blocked)} async saves (every {SAVE_EVERY} steps), each blocked "
            f"the loop {1e3 * np.mean(blocked):.2f} ms on average ({1e3 * max(blocked):.2f} ms "
            f"max); kept {manager.steps()}"
        )

        fresh = make_run(feedpipe.MemmapDataset(Path(tmp) / "data"))
        manager.restore(into=fresh)  # the newest step, checksums verified
        restored = manager.stats.last_restore
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                model.state_dict().values(), fresh["model"].state_dict().values(), strict=True
            )
        )
        assert same and fresh["step"] == step, "the restored checkpoint does not match"
        print(
            f"restored step {fresh['step']}: {restored.nbytes} bytes read and checksums verified "
            f"in {1e3 * restored.read_s:.1f} ms; weights identical to the trained model"
        )
        manager.close()
    waited = loader.meter.stall_s
    print(
        f"{step} steps, {samples} samples in {elapsed:.2f} s: {samples / elapsed:,.0f} samples/s; "
        f"the loop waited {waited:.3f} s for data ({waited / elapsed:.1%} of the time)"
    )
    print(loader.meter.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

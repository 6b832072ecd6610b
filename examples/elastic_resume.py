"""Elastic resume: train with torchrun on N processes, stop, resume on M processes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/elastic_resume.py --workdir run --stop-at 6      # 2 ranks, stop after step 6
    python -m torch.distributed.run --standalone --nproc-per-node 3 \\
        examples/elastic_resume.py --workdir run                  # 3 ranks finish the epoch

Each rank reads its share through ``feedpipe.DistributedSampler`` (``pad=False``,
``equal_batches=True``: every sample once per epoch, every rank the same number of batches) and
``feedpipe.DataLoader``; the model is trained with DDP over gloo (CPU). Rank 0 saves the model,
the optimizer and the loader position with ``ckpt.CheckpointManager`` (async). One rank's loader
state describes every rank's progress, so on restart every rank loads rank 0's state into its
own loader, at whatever world size it now runs: the samples no rank has consumed yet are dealt
afresh to the new ranks, each exactly once, and no consumed sample is read again.

Every rank appends the sample ids of each step to ``WORKDIR/seen-ws<W>-rank<r>.jsonl`` so the
claim can be checked (``tests/test_examples.py`` does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import ckpt
import feedpipe


def write_dataset(path: Path, n: int, features: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ rng.standard_normal(features).astype(np.float32)).astype(np.float32)
    with feedpipe.MemmapWriter(
        path, shape=(features,), dtype="float32", fields={"idx": "int64", "y": "float32"}
    ) as w:
        w.append_batch(x, idx=np.arange(n), y=y)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="elastic_run", help="dataset, checkpoints, id logs")
    p.add_argument("--records", type=int, default=200)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--stop-at", type=int, help="save and stop after this global step")
    p.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = Path(args.workdir)
    data = workdir / "data"
    if rank == 0 and not (data / "index.json").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        write_dataset(data, args.records, args.features)
    dist.barrier()

    dataset = feedpipe.MemmapDataset(data)
    sampler = feedpipe.DistributedSampler(
        dataset, shuffle=True, seed=0, pad=False, equal_batches=True, batch_size=args.batch_size
    )
    loader = feedpipe.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Linear(args.features, 1)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "epoch": 0}

    manager = ckpt.CheckpointManager(workdir / "checkpoints", keep_last=2)
    if manager.latest_step() is not None:
        manager.restore(into=state)  # every rank reads the same committed step
        if rank == 0:
            print(f"resumed from step {state['step']} at world size {world}", flush=True)
    step, epoch = int(state["step"]), int(state["epoch"])
    seen = open(workdir / f"seen-ws{world}-rank{rank}.jsonl", "a")  # noqa: SIM115

    stop = False
    while epoch < args.epochs and not stop:
        sampler.set_epoch(epoch)  # keeps a loaded state for this epoch
        for batch in loader:
            loss = nn.functional.mse_loss(ddp(batch["data"]).squeeze(1), batch["y"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            seen.write(json.dumps({"step": step, "ids": batch["idx"].tolist()}) + "\n")
            seen.flush()
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step % args.save_every == 0 or step == args.stop_at:
                state["step"], state["epoch"] = step, epoch
                if rank == 0:
                    manager.save(step, state)
            if step == args.stop_at:
                stop = True
                break
        else:
            epoch += 1
            state["epoch"] = epoch
    seen.close()
    if rank == 0:
        if not stop and step not in manager.steps():
            state["step"], state["epoch"] = step, epoch
            manager.save(step, state)  # the end of training
        manager.close()  # the saves in flight are durable before anyone exits
        print(f"rank 0 done at step {step}: checkpoints {manager.steps()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    if os.environ.get("RANK", "0") == "0":
        print(f"{time.perf_counter() - t0:.1f} s")
    sys.exit(code)

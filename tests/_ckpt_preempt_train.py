"""A small training run for the preemption tests: ``python _ckpt_preempt_train.py DIR STEPS OUT
PROGRESS SYNC_EVERY DELAY``.

It resumes from the newest checkpoint in DIR (model, optimizer, RNG states), trains to STEPS with
dropout and random inputs drawn from the global RNG (so a resume that lost any of them would
differ), saves every 10 steps, and follows the preemption idiom of docs/guides/preemption.md.
After each step it writes the step number to PROGRESS. A finished run writes its final model and
optimizer state to OUT with ``ckpt.save``. With ``WORLD_SIZE`` > 1 in the environment it joins a
gloo group first (``MASTER_ADDR``/``MASTER_PORT``/``RANK``), each rank with its own DIR.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch

import ckpt
from ckpt.manager import CheckpointManager
from ckpt.preemption import PreemptionOptions


def main(argv: list[str]) -> None:
    directory, total, out, progress, sync_every, delay = argv
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        # deadlock guards, not speed bounds: a loaded machine starts three torch processes slowly
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    torch.set_num_threads(1)  # the same float results in every process
    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = PreemptionOptions(sync_every=int(sync_every), deadline_s=120.0)
    manager = CheckpointManager(
        directory, keep_last=2, save_interval_steps=10, save_on_preemption=options
    )
    start = 0
    if manager.latest_step() is not None:
        restored = manager.restore(into={"model": model, "opt": opt, "step": 0})
        start = restored["step"] + 1
    for step in range(start, int(total)):
        loss = model(torch.randn(32, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        Path(progress).write_text(str(step))
        time.sleep(float(delay))
        state = {"model": model, "opt": opt, "step": step}
        if manager.reached_preemption(step):
            manager.save_and_exit(step, state, rng=True)
        if manager.should_save(step):
            manager.save(step, state, rng=True)
    manager.close()
    ckpt.save(out, {"model": model.state_dict(), "opt": opt.state_dict()})


if __name__ == "__main__":
    main(sys.argv[1:])

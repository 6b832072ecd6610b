"""A training job shaped like the README's loop: the README's loader, a model with dropout, ckpt.

``python _resume_dropout_train.py DATA OUT STEPS KILL_AT...`` runs ``train`` in forked children
(one import for all of them): OUT/full uninterrupted, then OUT/killed once per KILL_AT and once
to the end. ``train`` trains to STEPS (resuming from WORKDIR/checkpoints if there is one),
saving every 4 steps with ``rng=True``; with ``kill_at`` it SIGKILLs itself right after that
step. It logs ``step first-index`` per step and writes the final parameters to
WORKDIR/params.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import ckpt
import feedpipe


def train(data: Path, workdir: Path, steps: int, kill_at: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1))
    # the README's loader
    loader = feedpipe.DataLoader(feedpipe.MemmapDataset(data), batch_size=16,
                                 shuffle=True, num_workers=2, worker_type="thread")  # fmt: skip
    manager = ckpt.CheckpointManager(workdir / "checkpoints", keep_last=3)
    # plain SGD by hand: torch.optim's first use imports torch._dynamo (seconds)
    state = {"model": model, "loader": loader, "step": 0}
    if manager.latest_step() is not None:
        manager.restore(into=state)
    log = (workdir / "steps.log").open("a")
    while state["step"] < steps:
        for batch in loader:
            state["step"] += 1
            x = torch.as_tensor(batch).float()
            loss = (model(x / 200) - 1).pow(2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad  # type: ignore[operator]
            log.write(f"{state['step']} {int(x[0, 0])}\n")
            log.flush()
            if state["step"] % 4 == 0:
                manager.save(state["step"], state, rng=True)
            if state["step"] == kill_at:
                manager.wait()  # the save of this step's checkpoint, if any, is committed
                os.kill(os.getpid(), signal.SIGKILL)
            if state["step"] >= steps:
                break
    manager.close()
    torch.save(model.state_dict(), workdir / "params.pt")


def main() -> None:
    data, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    runs = [("full", None)] + [("killed", int(k)) for k in sys.argv[4:]] + [("killed", None)]
    for name, kill_at in runs:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                train(data, out / name, steps, kill_at)
            except BaseException as exc:
                print(f"{name} (kill at {kill_at}): {exc!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        want = -signal.SIGKILL if kill_at else 0
        if os.waitstatus_to_exitcode(status) != want:
            sys.exit(f"{name} (kill at {kill_at}) exited with {status}, not {want}")


if __name__ == "__main__":
    main()

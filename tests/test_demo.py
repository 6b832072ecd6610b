"""``make demo``: examples/demo.py runs as a subprocess (no arguments) and prints what it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_checkpoints_restores_and_reports() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "dataset: 16384 records in 4 shards" in out
    # it learns: the last epoch's train accuracy is far above chance (10%)
    accuracy = [
        float(a) for a in re.findall(r"^epoch \d+: loss \S+, train accuracy (\S+)%$", out, re.M)
    ]
    assert len(accuracy) == 3 and accuracy[-1] > 60, out
    saves = re.search(r"^checkpoints: (\d+) async saves .* blocked the loop (\S+) ms", out, re.M)
    assert saves is not None and int(saves.group(1)) == 6, out
    assert re.search(r"^restored step 384: \d+ bytes read and checksums verified", out, re.M), out
    assert "weights identical to the trained model" in out
    m = re.search(
        r"^384 steps, 49152 samples in \S+ s: [\d,]+ samples/s; the loop waited (\S+) s", out, re.M
    )
    assert m is not None and float(m.group(1)) >= 0, out
    # the stall report closes the run: totals, the per-stage table and a hint
    assert re.search(r"^feedpipe stall report: 384 batches, 49152 samples", out, re.M), out
    assert re.search(r"^  fetch\s+\d", out, re.M) and re.search(r"^  hint: ", out, re.M), out
    # the demo sets persistent_workers=True: its hint never suggests it (issue 28)
    assert "persistent_workers=True" not in out.split("  hint: ")[1].splitlines()[0], out

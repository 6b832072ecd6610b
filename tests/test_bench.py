"""``feedpipe bench``: runs a sweep, prints the table, writes a valid PNG and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feedpipe.cli import main
from feedpipe.loader.bench import SyntheticDataset

pytest.importorskip("feedpipe.loader", reason="feedpipe.DataLoader has not landed yet")


def test_bench_synthetic_table_png_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    png, js = tmp_path / "out.png", tmp_path / "out.json"
    argv = ["bench", "--synthetic", "--sample-delay-ms", "0.05", "--batch-size", "16"]
    argv += ["--batches", "12", "--warmup", "2", "--workers", "0,2", "--prefetch", "2"]
    argv += ["--worker-type", "thread", "--step-ms", "2", "--plot", str(png), "--json", str(js)]
    assert main(argv) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith("feedpipe bench: synthetic, batch 16, thread workers")
    assert "alone samples/s" in lines[1] and "step 2 ms: samples/s" in lines[1]
    rows = [line for line in lines if line.startswith(("w=0 ", "w=2 p=2"))]
    assert len(rows) == 2
    assert any(word in rows[0] for word in ("input-bound", "compute-bound"))
    assert out.err == ""  # stderr is not a terminal here: no progress bar (issue 16, point 14)
    with Image.open(png) as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] > 800
    runs = json.loads(js.read_text())
    assert [(r["workers"], r["prefetch"], r["step_ms"]) for r in runs] == [
        (0, None, 0.0),
        (0, None, 2.0),
        (2, 2, 0.0),
        (2, 2, 2.0),
    ]
    for r in runs:
        assert r["stats"]["batches"] == 12 and r["stats"]["samples"] == 12 * 16
        assert len(r["waits"]) == 12 and len(r["steps"]) == 11
        # an epoch turn (the next() that raised StopIteration, the next iter()) falls inside one
        # of the bench's steps; the meter counts it as stall (and the instant between the two
        # as outside), so the totals agree and each list is bounded by the meter's figure
        s = r["stats"]
        total = s["stall_s"] + s["step_s"] + s["outside_s"]
        assert sum(r["waits"]) + sum(r["steps"]) == pytest.approx(total)
        assert sum(r["waits"]) <= s["stall_s"] * (1 + 1e-9)
        assert sum(r["steps"]) >= s["step_s"] * (1 - 1e-9)
        assert "fetch" in r["stats"]["stages"]
    # the simulated step (a 2 ms sleep, which never undershoots) is measured as step time
    assert runs[1]["stats"]["step_mean_s"] >= 0.002


def test_bench_needs_a_dataset() -> None:
    with pytest.raises(SystemExit, match="PATH or --synthetic"):
        main(["bench", "--no-progress"])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--workers", "1,x", "comma-separated"), ("--prefetch", "0", "prefetch")],
)
def test_bench_rejects_bad_sweep(flag: str, value: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--synthetic", "--no-progress", flag, value])


def test_bench_missing_path_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["bench", str(missing), "--no-progress", "--workers", "0"]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_on_memmap_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    writer_mod = pytest.importorskip("feedpipe.memmap", reason="MemmapDataset not landed yet")
    data = tmp_path / "ds"
    with writer_mod.MemmapWriter(data, shape=(8,), dtype="float32") as w:
        w.append_batch(np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    argv = ["bench", str(data), "--batch-size", "8", "--batches", "20", "--warmup", "1"]
    assert main([*argv, "--workers", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"feedpipe bench: {data}, batch 8" in out and "w=0 " in out


def test_synthetic_dataset() -> None:
    ds = SyntheticDataset(300, (2, 3))
    assert len(ds) == 300 and ds[257].shape == (2, 3) and int(ds[257][0, 0]) == 257 % 251
    with pytest.raises(IndexError, match="300 samples"):
        ds[300]
    with pytest.raises(ValueError, match="delay_s"):
        SyntheticDataset(3, delay_s=-1)

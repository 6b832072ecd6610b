"""benchmarks/peers.py runs end to end on tiny data (its ``--smoke`` mode): every installed system
delivers one whole epoch whose bytes add up to the dataset's, every timed epoch delivers every
record, a missing peer prints "not installed" and the run goes on. No timing is asserted."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"
PEERS = {  # row label prefix -> the package it needs
    "StatefulDataLoader": "torchdata",
    "torchdata.nodes": "torchdata",
    "SPDL": "spdl",
}
LABELS = [
    "torch DataLoader, 1 processes",
    "StatefulDataLoader, 1 processes",
    "torchdata.nodes, 1 processes",
    "torchdata.nodes, 1 threads",
    "torchdata.nodes, 1 threads, read_batch",
    "SPDL get_pytorch_dataloader, 1 processes",
    "SPDL pipeline MT, 1 threads",
    "SPDL pipeline MT, 1 threads, read_batch",
    "SPDL pipeline MTP, 1 threads",
    "feedpipe, 1 thread workers",
    "feedpipe, 1 process workers",
    "feedpipe, no workers",
]


def _run(
    tmp_path: Path, *args: str, block: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """The script in a fresh interpreter; ``block`` makes those packages fail to import."""
    argv = [str(SCRIPT), "--smoke", "--workers", "1", "--dir", str(tmp_path), *args]
    code = (
        "import runpy, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {block!r}:\n"
        "            raise ImportError(f'No module named {name!r} (blocked by the test)')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )


def _cells(out: str, label: str) -> list[list[str]]:
    """The cells after the label of every table row for ``label`` (one per record size)."""
    rows = [line for line in out.splitlines() if line.startswith(f"| {label} |")]
    return [[c.strip() for c in r.split("|")[2:-1]] for r in rows]


def _installed(label: str) -> bool:
    need = next((pkg for prefix, pkg in PEERS.items() if label.startswith(prefix)), None)
    return need is None or importlib.util.find_spec(need) is not None


def test_every_system_delivers_every_record_once(tmp_path: Path) -> None:
    out = _run(tmp_path, "--records", "512,8192")
    assert out.returncode == 0, out.stdout + out.stderr
    for label in LABELS:
        cells = _cells(out.stdout, label)
        assert len(cells) == 2, (label, out.stdout)  # one row per record size
        for c in cells:
            if _installed(label):  # a number: the content check and every epoch passed
                assert re.fullmatch(r"[\d,]+", c[0]) and int(c[0].replace(",", "")) > 0, c
            else:
                assert c[0].startswith("not installed"), c
    assert "| torch DataLoader | " in out.stdout  # the summary: feedpipe's best / each peer
    assert re.search(r"feedpipe is (ahead of every peer|behind or level with)", out.stdout)
    assert list(tmp_path.iterdir()) == []  # its records are removed


def test_a_missing_peer_prints_not_installed_and_the_run_goes_on(tmp_path: Path) -> None:
    only = "stateful,nodes-thread,spdl-mt,feedpipe-none"
    out = _run(tmp_path, "--records", "512", "--only", only, block=("torchdata", "spdl"))
    assert out.returncode == 0, out.stdout + out.stderr
    for label in ("StatefulDataLoader, 1 processes", "torchdata.nodes, 1 threads",
                  "SPDL pipeline MT, 1 threads"):  # fmt: skip
        (cells,) = _cells(out.stdout, label)
        assert cells[0].startswith("not installed") and "blocked by the test" in cells[0]
    for label in ("torch DataLoader, 1 processes", "feedpipe, no workers"):
        (cells,) = _cells(out.stdout, label)
        assert re.fullmatch(r"[\d,]+", cells[0]), cells
    assert "| SPDL | n/a |" in out.stdout  # no ratio is made up for a peer that did not run


@pytest.mark.gpu
def test_every_system_delivers_every_record_to_the_gpu(tmp_path: Path) -> None:
    out = _run(tmp_path, "--records", "512,262144", "--device", "cuda")
    assert out.returncode == 0, out.stdout + out.stderr
    for label in LABELS:
        for c in _cells(out.stdout, label):
            assert re.fullmatch(r"[\d,]+", c[0]) if _installed(label) else "not installed" in c[0]

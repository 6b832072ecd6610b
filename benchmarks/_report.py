"""Benchmark helpers: a machine description, and rewriting a section of docs/benchmarks.md."""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

__all__ = ["machine", "write_section"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    """One line naming the machine, cores, memory, Python/torch/numpy versions and the date."""
    import numpy
    import torch

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):  # pragma: no cover
        mem = float("nan")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node() or 'host'}: {os.cpu_count()} cores, {mem:.0f} GiB, {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"numpy {numpy.__version__}; "
        f"{datetime.date.today().isoformat()}"
    )


def write_section(name: str, markdown: str, doc: Path = DOC) -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in the doc."""
    text = doc.read_text()
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block + "\n"
    )
    doc.write_text(text)

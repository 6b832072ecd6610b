"""Moved to :mod:`feedpipe.loader.bench`; this public path re-exports it."""

from feedpipe.loader.bench import BenchResult, SyntheticDataset, add_arguments, run, run_one

__all__ = ["BenchResult", "SyntheticDataset", "add_arguments", "run", "run_one"]

"""Moved to :mod:`feedpipe.remote.stage`; this public path re-exports it."""

from feedpipe.remote.stage import StageResult, add_arguments, run, stage

__all__ = ["StageResult", "add_arguments", "run", "stage"]

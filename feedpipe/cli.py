"""The ``feedpipe`` command: ``convert``, ``inspect``, ``stage`` and ``bench`` subcommands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

_COMMANDS: dict[str, tuple[str, str]] = {
    "convert": (
        "feedpipe.convert",
        "build a dataset from images, .npy/.npz, Zarr or a torch dataset",
    ),
    "inspect": ("feedpipe.inspect_cmd", "print a dataset's index; --verify checks every checksum"),
    "stage": ("feedpipe.stage", "copy a dataset from any fsspec URL to a local dir, verified"),
    "bench": ("feedpipe.bench", "measure a loader alone and against a simulated step"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="feedpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in _COMMANDS else None
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module we will run
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    mod = importlib.import_module(_COMMANDS[args.command][0])
    return int(mod.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

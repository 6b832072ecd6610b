"""The ``feedpipe`` command: ``convert``, ``inspect``, ``stage`` and ``bench`` subcommands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs. No command prints a traceback: an error is
one line on stderr naming the file or URL (credentials redacted) and exit status 1; Ctrl-C exits
with 130; a closed stdout (``feedpipe inspect ... | head``) ends the command quietly.
``FEEDPIPE_DEBUG=1`` re-raises, for a bug report.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["main"]

_COMMANDS: dict[str, tuple[str, str]] = {
    "convert": (
        "feedpipe.datasets.convert",
        "build a dataset from images, .npy/.npz, Zarr or a torch dataset",
    ),
    "inspect": (
        "feedpipe.commands.inspect",
        "print a dataset's index; --verify checks every checksum",
    ),
    "stage": (
        "feedpipe.remote.stage",
        "copy a dataset from any fsspec URL to a local dir, verified",
    ),
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
    try:
        rc = int(mod.run(args) or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        print(f"feedpipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("FEEDPIPE_DEBUG"):
            raise
        print(f"feedpipe {args.command}: error: {_describe(exc, args)}", file=sys.stderr)
        return 1


def _describe(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for an error: the message (redacted), with the type for unexpected errors."""
    from feedpipe.errors import DatasetError, MissingExtraError
    from feedpipe.remote import transfer as _remote

    text = str(exc)
    if isinstance(exc, ValueError) and text.startswith("Protocol not known: "):
        url = getattr(args, "path", None) or getattr(args, "url", None)
        where = f"{url}: " if isinstance(url, str) else ""
        text = f"{where}unknown URL scheme {text.split(': ', 1)[1]!r} (no fsspec filesystem for it)"
    elif not isinstance(exc, (DatasetError, MissingExtraError, OSError)):
        text = f"{type(exc).__name__}: {text}"
    elif isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return " ".join(_remote.redact(text).split())


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the exit flush does not raise."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

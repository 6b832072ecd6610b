"""The ``feedpipe`` command: ``convert``, ``inspect``, ``stage`` and ``bench`` subcommands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs. No command prints a traceback: an error is
one line on stderr naming the file or URL and exit status 1; Ctrl-C exits with 130; a closed
stdout (``feedpipe inspect ... | head``) ends the command quietly.
``FEEDPIPE_DEBUG=1`` re-raises, for a bug report.

Credentials never reach the terminal. Every error of every subcommand reaches the user through
one place, :func:`main`'s handler (subcommands raise, they do not print errors), and argparse's
own errors through :class:`_Parser`; both pass the text through
:func:`feedpipe.io.remote.redact` and also remove the user and password of every URL on the
command line, whatever library quoted them and however (botocore quotes ``KEY:SECRET@bucket``
with no scheme).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn
from urllib.parse import unquote

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
    "bench": ("feedpipe.loader.bench", "measure a loader alone and against a simulated step"),
}


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error line is redacted (it may quote a URL argument)."""

    secrets: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {_redact(message, self.secrets)}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    secrets = _url_secrets(argv)
    parser = _Parser(prog="feedpipe", description=__doc__.splitlines()[0])
    parser.secrets = secrets
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in _COMMANDS else None
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.secrets = secrets
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
        from feedpipe.io.env import env_flag

        if env_flag("FEEDPIPE_DEBUG"):
            raise
        text = _redact(_describe(exc, args), secrets)
        print(f"feedpipe {args.command}: error: {text}", file=sys.stderr)
        return 1


def _url_secrets(argv: Sequence[str]) -> list[str]:
    """The user and password of every ``scheme://user:password@host`` on the command line, as
    written and percent-decoded, longest first (a password may hold a raw ``@`` or ``/``)."""
    found: set[str] = set()
    for arg in argv:
        _scheme, sep, rest = arg.partition("://")
        if not sep or "@" not in rest:
            continue
        userinfo = rest.rpartition("@")[0]
        user, _colon, password = userinfo.partition(":")
        # a user name is a secret when it is an access key id; a short one is left alone
        for value, least in ((userinfo, 3), (user, 8), (password, 3)):
            for form in (value, unquote(value)):
                if len(form) >= least:
                    found.add(form)
    return sorted(found, key=len, reverse=True)


def _redact(text: str, secrets: Sequence[str]) -> str:
    """:func:`feedpipe.io.remote.redact`, then every command-line secret replaced by ``***``."""
    from feedpipe.io.remote import redact

    text = redact(text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _describe(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for an error: the message (redacted), with the type for unexpected errors."""
    from feedpipe.errors import DatasetError, DatasetExistsError, MissingExtraError
    from feedpipe.remote import transfer as _remote

    text = str(exc)
    if isinstance(exc, DatasetExistsError):
        text = exc.with_hint("--overwrite")  # the flag, not the Python argument
    elif isinstance(exc, ValueError) and text.startswith("Protocol not known: "):
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

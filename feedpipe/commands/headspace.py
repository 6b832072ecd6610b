"""``feedpipe bench --headspace SCRIPT:FN``: the headspace measurement of a user's own step.

The contract of ``SCRIPT:FN``: ``SCRIPT`` is the path of a Python file and ``FN`` the name of a
function defined in it that takes no arguments and returns ``(step_fn, loader)``: the training
step (called with one batch) and the loader it trains from (a ``feedpipe.DataLoader`` for the
stall counters). The command runs the user's code: it imports ``SCRIPT`` as a module named after
the file (its folder first on ``sys.path``, so its own imports work; the module is registered under
that name, so its classes pickle; ``if __name__ == "__main__":`` blocks do not run; ``sys.argv`` is
``[SCRIPT]`` meanwhile, so a module-level ``parse_args()`` gets its defaults; a ``sys.exit`` is
an error naming the file), calls ``FN()``, then
:func:`feedpipe.stall.headspace.headspace` with ``--batches`` steps after ``--warmup`` warm-up
steps in each run, and prints the one-line answer and its table.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from feedpipe.stall.headspace import HeadspaceError, headspace

__all__ = ["add_arguments", "load_step", "run"]

#: the module name a script gets when its file name is not a free identifier
_FALLBACK_MODULE = "feedpipe_headspace_script"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--headspace`` options of ``feedpipe bench``."""
    parser.add_argument(
        "--headspace",
        metavar="SCRIPT:FN",
        help="run FN() from the Python file SCRIPT (your code), which returns (step_fn, loader), "
        "and report the share of step time the input costs (cached batches vs the live loader); "
        "--batches steps per run after --warmup",
    )
    parser.add_argument(
        "--headspace-device",
        default=None,
        metavar="DEVICE",
        help="keep the cached batches on DEVICE (e.g. cuda; default: where the loader puts them)",
    )
    parser.add_argument(
        "--headspace-cache",
        type=int,
        default=10,
        metavar="N",
        help="batches cached for the instant-input run (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    """Load ``SCRIPT:FN``, measure, print the answer and the table; returns the exit status."""
    if args.path or args.synthetic:
        raise SystemExit(
            "feedpipe bench: --headspace measures the loader SCRIPT:FN returns; "
            "give no PATH or --synthetic with it"
        )
    if args.batches < 1 or args.warmup < 0 or args.headspace_cache < 1:
        raise SystemExit(
            "feedpipe bench: --headspace needs --batches >= 1, --warmup >= 0 "
            "and --headspace-cache >= 1"
        )
    step_fn, loader = load_step(args.headspace)
    result = headspace(
        step_fn,
        loader,
        steps=args.batches,
        warmup=args.warmup,
        cache=args.headspace_cache,
        device=args.headspace_device,
    )
    print(
        f"feedpipe bench --headspace {args.headspace}: {args.batches} steps per run "
        f"after {args.warmup} warm-up"
    )
    print(result)
    return 0


def load_step(spec: str) -> tuple[Callable[[Any], Any], Any]:
    """Import ``SCRIPT``, call ``FN()`` and check it returned ``(step_fn, loader)``.

    Every failure is a :class:`~feedpipe.stall.headspace.HeadspaceError` naming the file and
    the function: a spec without ``:``, a missing file, a script that raises on import, a
    missing or non-callable ``FN``, an ``FN`` that raises or returns something else."""
    script, sep, name = spec.rpartition(":")
    if not sep or not script or not name:
        raise HeadspaceError(f"--headspace wants SCRIPT:FN (a .py file, a function): {spec!r}")
    path = Path(script)
    if not path.is_file():
        raise HeadspaceError(f"{script}: no such file (the SCRIPT of --headspace {spec})")
    with _script_argv(path):
        module = _import(path)
        fn = getattr(module, name, None)
        if fn is None:
            raise HeadspaceError(f"{script}: no function {name!r} in it (--headspace {spec})")
        if not callable(fn):
            raise HeadspaceError(f"{script}: {name} is a {type(fn).__name__}, not a function")
        try:
            made = fn()
        except SystemExit as exc:
            raise HeadspaceError(f"{script}: {name}() exited ({_exit(exc)})") from exc
        except Exception as exc:
            raise HeadspaceError(f"{script}: {name}() raised {type(exc).__name__}: {exc}") from exc
    return _checked(made, script, name)


@contextmanager
def _script_argv(path: Path) -> Iterator[None]:
    """``sys.argv`` is ``[SCRIPT]`` while the script is imported and ``FN`` runs, as for
    ``python SCRIPT`` with no arguments: a module-level ``parse_args()`` gets its defaults,
    not the ``feedpipe bench`` arguments."""
    saved = sys.argv
    sys.argv = [str(path)]
    try:
        yield
    finally:
        sys.argv = saved


def _exit(exc: SystemExit) -> str:
    return f"sys.exit({exc.code!r}); the command measures nothing after it"


def _import(path: Path) -> ModuleType:
    """Run the script as a module named after its file (the user's code runs here)."""
    folder, stem = str(path.resolve().parent), path.stem
    free = stem.isidentifier() and stem not in sys.modules
    mod_name = stem if free else _FALLBACK_MODULE
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise HeadspaceError(f"{path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[mod_name] = module  # pickling its classes (process workers) finds them
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() or an argparse error at module level
        del sys.modules[mod_name]
        raise HeadspaceError(f"{path}: running the script exited ({_exit(exc)})") from exc
    except Exception as exc:
        del sys.modules[mod_name]
        why = f"{type(exc).__name__}: {exc}"
        raise HeadspaceError(f"{path}: running the script raised {why}") from exc
    return module


def _checked(made: Any, script: str, name: str) -> tuple[Callable[[Any], Any], Any]:
    """``made`` as ``(step_fn, loader)``, or an error naming what ``FN`` returned instead."""
    want = f"{script}: {name}() must return (step_fn, loader)"
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise HeadspaceError(f"{want}; it returned {_kind(made)}")
    step_fn, loader = made
    if not callable(step_fn):
        raise HeadspaceError(f"{want}; its step_fn is {_kind(step_fn)}, not callable")
    if isinstance(loader, (str, bytes)) or not callable(getattr(loader, "__iter__", None)):
        raise HeadspaceError(f"{want}; its loader is {_kind(loader)}, not an iterable of batches")
    return step_fn, loader


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"

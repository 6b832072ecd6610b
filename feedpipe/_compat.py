"""The old flat import paths (``feedpipe.memmap``, ``feedpipe.convert``, ...), each still
importable and warning once.

The code moved into the layered packages; the old module paths stay working so that existing
programs run unchanged. They are served by one finder instead of a shim file each:
``import feedpipe`` puts :class:`MovedFinder` first on ``sys.meta_path`` (``install`` is idempotent;
the finder answers only for the names in :data:`MOVED`, so every other import is untouched, and
being first it wins over any stale file of an old installation).

An old path imports as an alias module that behaves as the old shim file
``from home import *`` did: loading it copies the home's public names (its ``__all__``) into the
alias, so ``vars()`` lists them and ``mock.patch("feedpipe.convert.convert")`` patches the
alias's own name; any other attribute (a private one) is read from the home on access.
``__file__`` is the home's file (``inspect`` finds the source). ``feedpipe.convert`` and
``feedpipe.stage`` stay callable: the call runs the alias's own ``convert``/``stage`` (a patch
of it is honoured). ``python -m OLD`` runs ``python -m HOME`` (:meth:`MovedFinder.get_code`).
The first import of each old path warns with a :class:`FeedpipeMovedWarning` naming the home.

The old paths are aliases, not submodules: ``pkgutil.iter_modules(feedpipe.__path__)`` lists
files, and they have none (intended: they are deprecated).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["MOVED", "FeedpipeMovedWarning", "MovedFinder"]

# old path -> (new home, the function an old callable module calls, or "")
MOVED: dict[str, tuple[str, str]] = {
    "feedpipe.memmap": ("feedpipe.datasets.memmap", ""),
    "feedpipe.zarr_dataset": ("feedpipe.datasets.zarr", ""),
    "feedpipe.convert": ("feedpipe.datasets.convert", "convert"),
    "feedpipe.cache": ("feedpipe.remote.cache", ""),
    "feedpipe.stage": ("feedpipe.remote.stage", "stage"),
    "feedpipe.gpu": ("feedpipe.device.feed", ""),
    "feedpipe.bench": ("feedpipe.loader.bench", ""),
    "feedpipe._crc": ("feedpipe.io.crc", ""),
    "feedpipe.datasets.format": ("feedpipe.format", ""),
}


class FeedpipeMovedWarning(FutureWarning):
    """An old import path of feedpipe was used; the message names the new one."""


class MovedModule(types.ModuleType):
    """An old path: holds the home's public names; callable where the old one was."""

    def __init__(self, name: str, home: str, call: str) -> None:
        super().__init__(name, f"Moved to {home}; this old path forwards to it.")
        self.__dict__["_home"] = home
        self.__dict__["_call"] = call

    def _target(self) -> types.ModuleType:
        return importlib.import_module(self.__dict__["_home"])

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr != "__all__":
            raise AttributeError(attr)
        return getattr(self._target(), attr)

    def __dir__(self) -> list[str]:
        return sorted(set(self.__dict__) | set(dir(self._target())))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.__dict__["_call"]
        if not call:
            raise TypeError(f"module {self.__name__!r} is not callable")
        return getattr(self, call)(*args, **kwargs)  # the alias's own name: a patch is honoured

    def load_names(self) -> None:
        """Copy the home's public names (its ``__all__``) and its ``__file__`` into the alias."""
        target = self._target()
        names = getattr(target, "__all__", None)
        if names is None:
            names = [n for n in vars(target) if not n.startswith("_")]
        for name in names:
            self.__dict__[name] = getattr(target, name)
        self.__dict__["__file__"] = getattr(target, "__file__", None)


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the old paths of :data:`MOVED`, and nothing else."""

    warned: set[str] = set()

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        home, call = MOVED[spec.name]
        self._warn_once(spec.name)
        return MovedModule(spec.name, home, call)

    def exec_module(self, module: types.ModuleType) -> None:
        """Fill the alias as the old ``from home import *`` shim did."""
        if isinstance(module, MovedModule):
            module.load_names()

    def get_code(self, fullname: str) -> types.CodeType:
        """For ``python -m OLD``: code that runs the home as ``python -m HOME`` would."""
        home = MOVED[fullname][0]
        self._warn_once(fullname)
        source = f"import runpy\nrunpy.run_module({home!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<{fullname}: runs {home}>", "exec")

    def _warn_once(self, name: str) -> None:
        if name in self.warned:
            return
        self.warned.add(name)
        warnings.warn(
            f"{name} moved to {MOVED[name][0]}; import it from there (or from feedpipe) "
            "(the old path keeps working)",
            FeedpipeMovedWarning,
            stacklevel=3,
        )

"""The old flat import paths (``feedpipe.memmap``, ``feedpipe.convert``, ...), each still
importable and warning once.

The code moved into the layered packages; the old module paths stay working so that existing
programs run unchanged. They are served by one finder instead of a shim file each:
``import feedpipe`` puts :class:`MovedFinder` first on ``sys.meta_path`` (``install`` is idempotent;
the finder answers only for the names in :data:`MOVED`, so every other import is untouched, and
being first it wins over any stale file of an old installation).

An old path imports as an alias module: its attributes are those of the new home (read on
access, so the alias never goes stale), ``feedpipe.convert`` and ``feedpipe.stage`` stay callable
(they are also the public functions of those names), and the first import of each old path
warns with a :class:`FeedpipeMovedWarning` naming the new home.
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
}


class FeedpipeMovedWarning(FutureWarning):
    """An old import path of feedpipe was used; the message names the new one."""


class MovedModule(types.ModuleType):
    """An old path: reads every attribute from the new home; callable where the old one was."""

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
        return sorted(set(dir(self._target())))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.__dict__["_call"]
        if not call:
            raise TypeError(f"module {self.__name__!r} is not callable")
        return getattr(self._target(), call)(*args, **kwargs)


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
        if spec.name not in self.warned:
            self.warned.add(spec.name)
            warnings.warn(
                f"{spec.name} moved to {home}; import it from there (or from feedpipe) "
                "(the old path keeps working)",
                FeedpipeMovedWarning,
                stacklevel=2,
            )
        return MovedModule(spec.name, home, call)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the alias reads its home on access."""

"""A leak detector for tests: fails if a secret appears in anything a user could see.

leaks = LeakCheck(password, signature)
exc = leaks.raises(DatasetError, lambda: MemmapDataset(url))   # message, repr, traceback
leaks.obj(dataset)                                             # repr and str
leaks.captured(capfd)                                          # stdout and stderr
leaks.logs(caplog)                                             # every record, with tracebacks
leaks.files(tmp_path)                                          # every file written there
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["LeakCheck"]


class LeakCheck:
    """Holds the secrets of one test; each method fails the test if one of them shows."""

    def __init__(self, *secrets: str) -> None:
        self.secrets = [s for s in secrets if s]
        assert self.secrets, "nothing to look for"

    def text(self, where: str, text: str) -> None:
        for s in self.secrets:
            if s in text:
                pytest.fail(f"secret {s!r} leaked into {where}:\n{text}")

    def exception(self, exc: BaseException) -> None:
        """The message, the repr and the traceback as Python would print it (chained ones too)."""
        self.text("exception str", str(exc))
        self.text("exception repr", repr(exc))
        self.text("traceback", "".join(traceback.format_exception(exc)))

    def raises(self, kind: type[BaseException], fn: Callable[[], Any]) -> BaseException:
        """Run ``fn``, expect ``kind``, check the exception; return it."""
        with pytest.raises(kind) as info:
            fn()
        self.exception(info.value)
        return info.value

    def obj(self, obj: object) -> None:
        self.text(f"repr of {type(obj).__name__}", repr(obj))
        self.text(f"str of {type(obj).__name__}", str(obj))

    def captured(self, capfd: pytest.CaptureFixture[str]) -> None:
        out, err = capfd.readouterr()
        self.text("stdout", out)
        self.text("stderr", err)

    def logs(self, caplog: pytest.LogCaptureFixture) -> None:
        fmt = logging.Formatter("%(name)s %(levelname)s %(message)s")
        for record in caplog.records:
            self.text(f"log record of {record.name}", fmt.format(record))

    def files(self, *roots: str | os.PathLike[str]) -> None:
        """Every file below ``roots`` (status files, indexes, caches): no secret in its bytes."""
        for path in _walk(roots):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            for s in self.secrets:
                if s.encode() in data:
                    pytest.fail(f"secret {s!r} leaked into the file {path}")


def _walk(roots: Iterable[str | os.PathLike[str]]) -> Iterable[Path]:
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                p = Path(dirpath) / name
                if not p.is_symlink():
                    yield p

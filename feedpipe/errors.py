"""Exceptions shared across feedpipe; each message names the file, record, worker or URL."""

from __future__ import annotations

from feedpipe.io.remote import RemoteIOError, redact

__all__ = ["DatasetError", "DatasetExistsError", "MissingExtraError", "RemoteError", "WorkerError"]


class DatasetError(Exception):
    """A dataset is malformed, truncated, corrupt, or was indexed out of range.

    The message passes through :func:`feedpipe.io.remote.redact` here, once for every raise
    site: a URL's password or signed query string never reaches the text.
    """

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (redact(args[0]), *args[1:])
        super().__init__(*args)


class DatasetExistsError(DatasetError):
    """A dataset is already at the destination and replacing it was not asked for.

    The message names the place and how to ask: ``overwrite=True`` (the Python API), or the
    ``hint`` given to :meth:`with_hint` (the CLI names its ``--overwrite`` flag).
    """

    def __init__(self, where: str, hint: str = "overwrite=True") -> None:
        super().__init__(where, hint)  # (where, hint): pickles back to the same error

    def with_hint(self, hint: str) -> str:
        """The message, naming ``hint`` as the way to replace the dataset."""
        return f"{self.args[0]}: a dataset already exists here (pass {hint})"

    def __str__(self) -> str:
        return self.with_hint(str(self.args[1]))


class RemoteError(DatasetError, RemoteIOError):
    """A remote read failed; the message names the URL and says whether retries were exhausted.

    A ``DatasetError`` for feedpipe's callers and a :class:`feedpipe.io.RemoteIOError` (the
    class ckpt raises) for code that handles both.
    """

    def __init__(self, message: str, url: str, *, permanent: bool = False) -> None:
        RemoteIOError.__init__(self, message, url, permanent=permanent)


class WorkerError(RuntimeError):
    """A loader worker died, timed out or raised; the message names the worker and sample index."""


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message names the extra to install."""


def require(module: str, extra: str) -> object:
    """Import an optional dependency or raise :class:`MissingExtraError` naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingExtraError(
            f"{module!r} is required for this feature: pip install 'feedpipe[{extra}]'"
        ) from exc

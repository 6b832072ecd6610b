"""Local destinations of ``feedpipe convert`` and ``feedpipe stage``: which entries are a dataset's
own, and the claim both commands make before they write.

Both follow :mod:`feedpipe.io.ownership` (the one ownership rule): a destination holding anything
the tool did not write is refused, naming the entries, and nothing is written. ``stage`` writes
into its folder, so it claims it (:func:`claim_dataset_folder`, a ``.stage-owner.json`` marker);
``convert`` builds elsewhere and replaces its destination whole, so it runs the same check
without a marker (:func:`check_convert_destination`), keeping a dataset's bytes a function of
its source alone.
What a dataset folder may hold as its own is the rule of :mod:`feedpipe.io.destination`
(:func:`dataset_entries` gives it this package's index parser; ``stage`` uses the rule there).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from feedpipe.errors import DatasetError, DatasetExistsError
from feedpipe.format import INDEX_NAME, parse_index
from feedpipe.io.destination import DestinationError, claim_folder, folder_entries, is_writer_file

__all__ = [
    "CONVERT",
    "check_convert_destination",
    "claim_dataset_folder",
    "dataset_entries",
    "replace_dataset",
]

CONVERT = "convert"  # the tool named in convert's refusals (it writes no marker, see above)


def dataset_entries(
    root: str | os.PathLike[str],
    listed: Iterable[str] = (),
    also: Callable[[str], bool] = lambda name: False,
) -> Callable[[Path], bool]:
    """The ``is_ours`` predicate of a dataset folder (:func:`feedpipe.io.destination.folder_entries`
    with this package's index parser)."""
    return folder_entries(root, INDEX_NAME, _index_files, listed, also)


def _index_files(raw: bytes, source: str) -> list[str] | None:
    """The files the index ``raw`` lists, or None when it is no feedpipe index."""
    try:
        return [rel for _sid, rel, _n, _c in parse_index(raw, source).files()]
    except DatasetError:
        return None


def claim_dataset_folder(
    path: str, tool: str, is_ours: Callable[[Path], bool], *, adopt: bool = True
) -> bool:
    """Claim ``path`` for ``tool`` by the one ownership rule
    (:func:`feedpipe.io.destination.claim_folder`); a refusal is a ``DatasetError`` naming the
    path and the foreign entries. Returns whether ``path`` holds a dataset (``index.json``)."""
    try:
        return claim_folder(path, tool, is_ours, INDEX_NAME, adopt=adopt)
    except DestinationError as exc:
        raise DatasetError(str(exc)) from None


def check_convert_destination(
    dest: str, *, overwrite: bool, also: Callable[[str], bool] = is_writer_file
) -> bool:
    """Refuse ``dest`` unless ``feedpipe convert`` may put a new dataset there: absent, empty,
    or (with ``overwrite``) a dataset holding only its own files. Writes nothing (a conversion
    builds elsewhere and replaces ``dest`` whole, :func:`replace_dataset`). True when a
    dataset is there."""
    entries = dataset_entries(dest, also=also)
    has = claim_dataset_folder(dest, CONVERT, entries, adopt=False)
    if has and not overwrite:
        raise DatasetExistsError(dest)
    return has


def replace_dataset(
    work: str, dest: str, *, overwrite: bool, also: Callable[[str], bool] = is_writer_file
) -> None:
    """Put the finished dataset ``work`` at ``dest``: ``dest`` is checked again (only a dataset
    of ours is replaced), then ``work`` is renamed into place and the old ``dest`` removed.

    No marker goes into the dataset: its bytes depend on the source alone (the same for any
    worker count, local or uploaded), and ``convert`` never writes into ``dest``, it replaces
    it whole, so the check half of the rule is all it needs."""
    check_convert_destination(dest, overwrite=overwrite, also=also)
    if os.path.lexists(dest):
        old = f"{dest}.old-{os.getpid()}"
        os.replace(dest, old)
        os.replace(work, dest)
        shutil.rmtree(old)
    else:
        os.replace(work, dest)

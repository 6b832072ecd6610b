"""Every name ckpt gives to something on disk (or under a remote root), in one place.

A checkpoint directory ``DIR`` holds:

- ``step-N/``: a committed step (``N`` in ASCII digits, no leading zero) holding ``manifest.json``
  and its data files (``data.bin``; ``rank-RRRRR.bin`` per rank for a DCP save);
- ``step-N.tmp-[KIND-]PID-RAND/``: a save (``KIND`` empty), a DCP save (``dcp``) or a download
  (``remote``) in progress; ``step-N.del-RAND/``: a copy being retired (``ckpt.saving.commit``);
- ``latest``: a regular file holding ``step-N`` and a newline, replaced by rename from
  ``latest.tmp-PID-RAND``;
- ``.lock``: the writer lock; ``upload-status.json``: the remote tier's status mirror, replaced
  from ``.upload-status.json.tmp-PID-THREAD``;
- ``.ckpt-owner.json``: ckpt's ownership marker (``feedpipe.io.ownership``; ``ckpt._owner``
  decides which entries are ckpt's); ``retention.json``: the retention policy of the manager
  that last wrote the directory (what ``ckpt gc`` applies); ``runs.json``: the run log of a
  manager with an automatic save interval (``ckpt.runlog``: runs, failures, measured costs).

A remote root holds ``step-N/`` prefixes with the same files. ``ckpt.save(PATH)`` uses the same
``.tmp-``/``.del-`` suffixes on ``PATH``'s own name. This module only spells and parses names; it
touches no file.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from pathlib import Path

__all__ = [
    "DATA_FILE",
    "LATEST",
    "LEFTOVER",
    "LOCK",
    "MANIFEST",
    "RETENTION_FILE",
    "RETIRED",
    "RUNS_FILE",
    "STATUS_FILE",
    "del_name",
    "is_data_name",
    "is_latest_tmp",
    "is_retired",
    "is_status_tmp",
    "is_step_name",
    "is_step_scratch",
    "latest_step",
    "latest_text",
    "rank_file",
    "status_tmp_name",
    "step_dir",
    "step_id",
    "step_name",
    "step_number",
    "tmp_name",
    "tmp_pid",
]

MANIFEST = "manifest.json"
DATA_FILE = "data.bin"
LATEST = "latest"
LOCK = ".lock"
STATUS_FILE = "upload-status.json"
RETENTION_FILE = "retention.json"
RUNS_FILE = "runs.json"

STEP = re.compile(r"^step-(0|[1-9][0-9]*)\Z")  # ASCII, canonical: "step-05" is not step 5
STEP_ID = re.compile(r"^step-(\d+)$")  # a DCP checkpoint_id's last component (step_id)
LEFTOVER = re.compile(r"^(step-\d+\.(tmp|del)-.+|latest\.tmp-.+)$")
RETIRED = re.compile(r"^(step-\d+)\.del-.+$")  # group 1: the step directory it belongs to
RANK_FILE = re.compile(r"^rank-[0-9]{5,}\.bin\Z")


def step_name(step: int) -> str:
    """The name of ``step``'s directory (or remote prefix): ``step-N``."""
    return f"step-{step}"


def step_dir(root: Path, step: int) -> Path:
    """The committed directory of ``step``."""
    return root / step_name(step)


def step_number(name: str) -> int | None:
    """The step a ``step-N`` name stands for (``N`` in ASCII digits, no leading zero), else
    ``None``: the only names that ``step_name`` gives back."""
    m = STEP.match(name)
    return int(m.group(1)) if m else None


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a canonical ``step-N`` name."""
    return STEP.match(name) is not None


def step_id(name: str) -> int | None:
    """The step a DCP ``checkpoint_id`` names by its last component (``step-N``; unlike
    ``step_number``, leading zeros are accepted), else ``None``."""
    m = STEP_ID.match(name)
    return int(m.group(1)) if m else None


def is_step_scratch(name: str) -> bool:
    """Whether ``name`` is a step's temporary (``.tmp-``) or retired (``.del-``) directory."""
    return LEFTOVER.match(name) is not None and not name.startswith(LATEST)


def is_latest_tmp(name: str) -> bool:
    """Whether ``name`` is a temporary ``latest`` (``latest.tmp-PID-RAND``)."""
    return name.startswith(f"{LATEST}.tmp-")


def is_status_tmp(name: str) -> bool:
    """Whether ``name`` is a temporary status mirror (``status_tmp_name``)."""
    return name.startswith(f".{STATUS_FILE}.tmp-")


def is_data_name(name: str) -> bool:
    """Whether ``name`` is a data file ckpt writes into a step (``data.bin``, ``rank_file``)."""
    return name == DATA_FILE or RANK_FILE.match(name) is not None


def rank_file(rank: int) -> str:
    """The data file of ``rank`` in a DCP save."""
    return f"rank-{rank:05d}.bin"


def tmp_name(base: str, kind: str = "") -> str:
    """A fresh temporary sibling name of ``base``: ``BASE.tmp-[KIND-]PID-RAND``."""
    tag = f"{kind}-" if kind else ""
    return f"{base}.tmp-{tag}{os.getpid()}-{secrets.token_hex(4)}"


def tmp_pid(name: str, base: str) -> int | None:
    """The writer's pid if ``name`` is a plain ``tmp_name(base)``, else ``None``."""
    m = re.match(rf"^{re.escape(base)}\.tmp-(\d+)-[0-9a-f]+$", name)
    return int(m.group(1)) if m else None


def del_name(base: str) -> str:
    """A fresh name for a retired copy of ``base``: ``BASE.del-RAND``."""
    return f"{base}.del-{secrets.token_hex(4)}"


def is_retired(name: str, base: str) -> bool:
    """Whether ``name`` is a retired copy (``del_name``) of ``base``."""
    return name.startswith(f"{base}.del-")


def latest_text(step: int) -> bytes:
    """The contents of ``latest`` pointing at ``step``."""
    return f"{step_name(step)}\n".encode()


def latest_step(raw: bytes) -> int | None:
    """The step that ``latest``'s contents name, else ``None`` (``UnicodeDecodeError`` if not
    UTF-8)."""
    return step_number(raw.decode().strip())


def status_tmp_name() -> str:
    """The temporary name the status mirror is written under (one per process and thread)."""
    return f".{STATUS_FILE}.tmp-{os.getpid()}-{threading.get_ident()}"

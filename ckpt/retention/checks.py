"""What retention asks about one local step: whether it restores (``restorable``) and the
metrics it was saved with (``metrics``). Both read the step on disk, so they live apart from the
rule itself (``ckpt.retention.rules``), which the remote tier applies without a local step.

``restorable(path)`` is the check both local callers use (the manager's ``Retainer`` and
``ckpt gc``): ``ckpt.restoring.reader.verify_step``, which runs the validator a restore runs
(tree, entries, types, sizes) and checks every file size and chunk checksum, without building a
tensor. A step written through DCP is checked the same way (DCP's planner, not ckpt, rebuilds
its tree). ``metrics(path)`` reads the metrics a step was saved with from its validated manifest.
"""

from __future__ import annotations

from pathlib import Path

from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.restoring import reader
from ckpt.saving import commit

__all__ = ["metrics", "restorable"]


def metrics(path: Path) -> dict[str, float]:
    """The metrics ``step`` was saved with (validated manifest); ``{}`` if it has none."""
    with commit.reading(path):
        found = fmt.read_manifest(path).get("metrics")
    return dict(found) if isinstance(found, dict) else {}


def restorable(path: Path) -> str | None:
    """``None`` if the step in ``path`` restores with every checksum verified, else why not.

    Data files are read once for their checksums; no tensor is built and nothing touches a device.
    """
    try:
        with commit.reading(path):
            reader.verify_step(path)
    except CheckpointError as exc:  # corrupt, incomplete or hostile: cannot be restored
        return str(exc)
    except (FileNotFoundError, NotADirectoryError) as exc:  # gone
        return f"{type(exc).__name__}: {exc}"
    except OSError:
        # EIO, EMFILE, EACCES...: not a verdict on the step. The pass stops and deletes nothing
        # (a step is never deleted because it could not be read once)
        raise
    except Exception as exc:  # any other failure means "cannot be restored"
        return f"{type(exc).__name__}: {exc}"
    return None

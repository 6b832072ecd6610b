"""ckpt raises only ckpt errors: a remote-tier failure is a ``CheckpointError``
(``RemoteCheckpointError``), never feedpipe's ``DatasetError``."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointError, RemoteCheckpointError
from ckpt.remote import RemoteOptions, RemoteTier
from feedpipe.errors import DatasetError

CKPT = Path(__file__).resolve().parent.parent / "ckpt"


def _broken_remote(tmp_path: Path) -> tuple[Path, str]:
    """A ``file://`` remote whose ``step-1`` lists as committed but whose manifest cannot be
    read (a symlink loop stands where the file belongs: ``ELOOP``)."""
    remote = tmp_path / "remote"
    (remote / "step-1").mkdir(parents=True)
    (remote / "step-1" / "manifest.json").symlink_to("manifest.json")
    local = tmp_path / "local"
    local.mkdir()
    return local, f"file://{remote}"


def test_remote_read_failure_is_a_checkpoint_error(tmp_path: Path) -> None:
    local, url = _broken_remote(tmp_path)
    tier = RemoteTier(local, RemoteOptions(url, deadline_s=2.0))
    try:
        assert tier.committed_steps() == [1]
        with pytest.raises(CheckpointError) as info:
            tier.read_manifest(1)
    finally:
        tier.close()
    exc = info.value
    assert isinstance(exc, RemoteCheckpointError) and not isinstance(exc, DatasetError)
    assert "step-1/manifest.json" in str(exc) and "step-1/manifest.json" in exc.url
    again = pickle.loads(pickle.dumps(exc))
    assert (type(again), str(again), again.url, again.permanent) == (
        RemoteCheckpointError,
        str(exc),
        exc.url,
        exc.permanent,
    )


def test_manager_metadata_of_an_unreadable_remote_step(tmp_path: Path) -> None:
    """``CheckpointManager.metadata`` documents ``CheckpointError``; a remote failure is one."""
    local, url = _broken_remote(tmp_path)
    opts = RemoteOptions(url, deadline_s=2.0)
    with ckpt.CheckpointManager(local, remote=opts) as m:
        with pytest.raises(CheckpointError) as info:
            m.metadata(1)
        assert not isinstance(info.value, DatasetError)
        m.save(2, {"w": torch.ones(2)}).result()


def test_ckpt_never_names_dataset_error() -> None:
    """No ckpt module imports or raises feedpipe's ``DatasetError`` (or its ``RemoteError``)
    except to convert it, in ``ckpt.remote._transfer``."""
    found = []
    for path in sorted(CKPT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        allowed: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "_transfer":
                allowed |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
        for node in ast.walk(tree):
            names = [node.id] if isinstance(node, ast.Name) else []
            if isinstance(node, ast.ImportFrom) and "feedpipe" in (node.module or ""):
                names = [a.name for a in node.names]
            bad = [n for n in names if n in ("DatasetError", "RemoteError")]
            if bad and not (path.name == "remote.py" and node.lineno in allowed):
                found.append(f"{path.name}:{node.lineno}: {bad}")
    assert found == []

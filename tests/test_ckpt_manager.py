"""The CheckpointManager and its remote tier: URLs as directories, ``file://`` URLs, remotes that
cannot be listed or reached, ``on_error``, and the README resume idiom on a fresh node.

Remotes are real: a ``file://`` directory, fsspec's ``memory://`` and S3 through the moto server."""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import state_with_empties as _state_with_empties

import ckpt
from ckpt import format as fmt
from ckpt.errors import CheckpointError
from ckpt.manager import CheckpointManager
from ckpt.remote import RemoteOptions
from ckpt.saving import commit


@pytest.mark.usefixtures("_keep_handlers")
def test_close_after_a_failed_save_still_stops_the_remote_tier(tmp_path, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    """``close()`` re-raises a background save's error; it skipped ``remote.close()`` then,
    leaving the upload thread running (and applying remote retention) after the writer lock
    was released to the next manager."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.errors import CheckpointError
    from ckpt.remote import RemoteOptions

    bucket, options = s3_bucket
    remote = RemoteOptions(f"s3://{bucket}/close", storage_options=options)
    before = signal.getsignal(signal.SIGTERM)
    m = CheckpointManager(tmp_path, remote=remote, save_on_preemption=True)

    def boom(step, path):  # type: ignore[no-untyped-def]
        raise RuntimeError("listener failed")

    m.on_commit.append(boom)
    m.save(0, {"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="listener failed"):
        m.close()
    assert m.remote is not None and m.remote.closed
    assert signal.getsignal(signal.SIGTERM) == before
    assert not m._takeover.held


def test_file_url_with_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file://localhost/abs`` is ``/abs`` (RFC 8089); another host is refused. Both used to
    create a relative local directory named after the host."""
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "run"
    with CheckpointManager(f"file://localhost{target}") as m:
        assert m.directory == target
    with pytest.raises(ValueError, match="file://"):
        CheckpointManager(f"file://otherhost{target}")
    with pytest.raises(ValueError, match="file://"):
        ckpt.save(f"file://otherhost{tmp_path}/x", {"a": 1})
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_remote_garbage_manifest_newer_than_local(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A remote step-N whose manifest is garbage: listed (listing only), but restore falls back
    to the newest good step with a logged reason; verify=True semantics hold."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "a", keep_last=None, remote=f"file://{remote}") as m:
        m.save(1, _state_with_empties(1)).result()
        m.wait(uploads=True)
    (remote / "step-9").mkdir()
    (remote / "step-9" / fmt.MANIFEST).write_bytes(b'{"crc32c":"00000000","body":{}}\n')
    with CheckpointManager(tmp_path / "b", keep_last=None, remote=f"file://{remote}") as m2:
        assert m2.latest_step() == 9
        with caplog.at_level(logging.WARNING, logger="ckpt"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = m2.restore()
        assert state["step"] == 1
        assert "skipping step 9" in caplog.text
        assert not (tmp_path / "b" / "step-9").exists()


def test_unreachable_remote_never_makes_restore_return_an_older_local_step(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """Local step 50, remote step 100. A remote that cannot be listed (or whose newer copy cannot
    be downloaded, retries exhausted) made ``restore()`` return step 50 with only a log line;
    only corruption may cause a fallback, so it is a ``CheckpointError`` naming the remote."""
    pytest.importorskip("s3fs")
    import shutil

    from _faultproxy import FaultProxy

    from ckpt.remote import RemoteOptions

    bucket, opts = s3_bucket
    with CheckpointManager(tmp_path / "a", remote=RemoteOptions(f"s3://{bucket}/run",
                           storage_options=opts)) as m:  # fmt: skip
        m.save(50, _state_with_empties(50)).result()
        m.save(100, _state_with_empties(100)).result()
        m.wait(uploads=True)
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-50", tmp_path / "b" / "step-50")
    with FaultProxy(s3_server) as proxy:
        proxied = {
            **opts,
            "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url},
            "config_kwargs": {"retries": {"max_attempts": 1}},  # ckpt's deadline decides
        }
        options = RemoteOptions(
            f"s3://{bucket}/run", storage_options=proxied, deadline_s=1, on_error="warn"
        )
        with CheckpointManager(tmp_path / "b", remote=options) as m2:
            m2.wait(uploads=True)  # the start-up reconciliation with the remote is over
            proxy.inject("403", times=10_000, method="GET")
            with pytest.raises(CheckpointError, match="cannot list the remote tier"):
                m2.restore()
            proxy.clear()
            proxy.inject("drop", times=10_000, match="step-100/data.bin")
            with pytest.raises(CheckpointError, match="cannot download the remote copy"):
                m2.restore()
            proxy.clear()
            assert m2.restore()["step"] == 100
            assert m2.restore(step=50)["step"] == 50


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1000, generator=g), "step": seed}


@pytest.fixture(params=["file", "memory", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RemoteOptions]:
    """A fresh, empty remote root of each kind."""
    if request.param == "file":
        yield RemoteOptions(f"file://{tmp_path}/remote/run", deadline_s=10)
    elif request.param == "memory":
        url = f"memory://ckpt-test-{uuid.uuid4().hex[:8]}/run"
        yield RemoteOptions(url, deadline_s=10)
        import fsspec

        fsspec.filesystem("memory").rm(
            url[len("memory://") :].split("/", maxsplit=1)[0], recursive=True
        )
    else:
        pytest.importorskip("s3fs")
        bucket, opts = request.getfixturevalue("s3_bucket")
        yield RemoteOptions(f"s3://{bucket}/run", storage_options=opts, deadline_s=10)


# ---- 9: any fsspec URL works as a remote ---------------------------------------------------------
def test_remote_end_to_end(tmp_path: Path, remote: RemoteOptions) -> None:
    with CheckpointManager(tmp_path / "a", keep_last=1, remote=remote) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step), metadata={"lr": 0.1 * step})
        m.wait(uploads=True)  # raises if any upload failed
        assert {s: u.state for s, u in m.stats.remote.uploads.items()} == {  # type: ignore[union-attr]
            1: "done",
            2: "done",
            3: "done",
        }
        assert commit.steps(tmp_path / "a") == [3]  # uploaded local steps were freed
    fresh = CheckpointManager(tmp_path / "b", remote=remote)
    try:
        state = fresh.restore()
        assert state["step"] == 3 and torch.equal(state["w"], _state(3)["w"])
        assert torch.equal(fresh.restore(1)["w"], _state(1)["w"])
        assert fresh.metadata(2) == {"lr": 0.2}
    finally:
        fresh.close()


# ---- 8: latest_step() and steps() see the remote tier --------------------------------------
def test_readme_resume_idiom_on_a_fresh_node(tmp_path: Path, remote: RemoteOptions) -> None:
    with CheckpointManager(tmp_path / "old-node", remote=remote) as m:
        m.save(100, _state(100))
        m.wait(uploads=True)
    state = {"w": torch.zeros(1000), "step": 0}
    manager = CheckpointManager(tmp_path / "new-node", remote=remote)  # empty local directory
    try:
        assert manager.steps() == [100]
        if manager.latest_step() is not None:  # the README idiom
            manager.restore(into=state)
        assert torch.equal(state["w"], _state(100)["w"])
        assert commit.steps(tmp_path / "new-node") == [100]  # the download is kept locally
    finally:
        manager.close()


def test_steps_raise_when_the_remote_cannot_be_listed(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str
) -> None:
    """A failed listing never reads as "no checkpoint": the idiom would restart from scratch."""
    pytest.importorskip("s3fs")
    from _faultproxy import FaultProxy

    bucket, opts = s3_bucket
    with FaultProxy(s3_server) as proxy:
        proxy.inject("403", times=1000, method="GET")
        proxied = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url}}
        bad = RemoteOptions(f"s3://{bucket}/run", storage_options=proxied, deadline_s=2)
        with CheckpointManager(tmp_path, remote=bad) as m:
            with pytest.raises(CheckpointError, match=f"cannot list the remote tier s3://{bucket}"):
                m.latest_step()
            proxy.clear()


# ---- 10: a remote URL given as the local directory is a clear error -----------------------------
@pytest.mark.parametrize("url", ["s3://b/run", "gs://bucket/x/ckpt", "memory://run", "s3:/b/run"])
def test_url_as_directory_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"CheckpointManager takes a local directory.*remote="):
        CheckpointManager(url)
    with pytest.raises(ValueError, match=r"ckpt\.save takes a local directory.*remote=URL"):
        ckpt.save(url, {"w": torch.ones(2)})
    with pytest.raises(ValueError, match=r"ckpt\.load takes a local directory.*remote=URL"):
        ckpt.load(url)
    with pytest.raises(ValueError, match=r"CheckpointManager takes a local directory"):
        CheckpointManager(Path(url))  # Path("s3://b/run") collapses to s3:/b/run
    assert os.listdir(tmp_path) == []  # no local "s3:" (or any) directory was created


def test_file_url_is_a_local_directory(tmp_path: Path) -> None:
    ckpt.save(f"file://{tmp_path}/one", {"w": torch.ones(2)})
    assert torch.equal(ckpt.load(f"file://{tmp_path}/one")["w"], torch.ones(2))
    with CheckpointManager(f"file://{tmp_path}/run") as m:
        m.save(1, {"w": torch.ones(2)}).result()
    assert commit.steps(tmp_path / "run") == [1]


# ---- 14: RemoteOptions(on_error="warn"): an upload failure does not stop training ----------------
def test_on_error_warn_keeps_training_and_retries(
    tmp_path: Path, s3_bucket: tuple[str, dict], s3_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("s3fs")
    from _faultproxy import FaultProxy

    from ckpt.remote import list_remote

    bucket, opts = s3_bucket
    caplog.set_level(logging.WARNING, logger="ckpt")
    with FaultProxy(s3_server) as proxy:
        proxied = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy.url}}
        options = RemoteOptions(
            f"s3://{bucket}/run", storage_options=proxied, deadline_s=5, on_error="warn"
        )
        m = CheckpointManager(tmp_path, keep_last=1, remote=options)
        ups = m.stats.remote.uploads  # type: ignore[union-attr]
        m.save(1, _state(1))
        m.wait(uploads=True)
        proxy.inject("403", times=10_000, match="/step-2/", method="PUT")  # step 2 cannot upload
        m.save(2, _state(2))
        m.wait(uploads=True)  # no error: "warn"
        assert ups[2].state == "failed" and "upload of step 2" in caplog.text
        assert commit.steps(tmp_path) == [2]  # step 1 was uploaded, so keep_last freed it
        m.save(3, _state(3))  # training goes on; step 2 is tried again and fails again
        m.wait(uploads=True)
        assert (ups[2].state, ups[3].state) == ("failed", "done")
        assert commit.steps(tmp_path) == [2, 3]  # 2 kept until uploaded, 3 is the newest
        proxy.clear()
        m.save(4, _state(4))  # the remote is back: step 2 goes up with step 4
        m.wait(uploads=True)
        m.close()
        assert {s: u.state for s, u in ups.items()} == {s: "done" for s in (1, 2, 3, 4)}
        assert commit.steps(tmp_path) == [4]  # every uploaded local step was freed
        assert m.stats.remote.failed >= 2  # type: ignore[union-attr]
    import s3fs

    listing = list_remote(s3fs.S3FileSystem(**opts), f"{bucket}/run")
    assert sorted(s for s, e in listing.items() if e.committed) == [1, 2, 3, 4]
    direct = RemoteOptions(f"s3://{bucket}/run", storage_options=opts)
    with CheckpointManager(tmp_path / "fresh", remote=direct) as fresh:
        assert torch.equal(fresh.restore(2)["w"], _state(2)["w"])


def test_on_error_is_validated() -> None:
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'warn'"):
        RemoteOptions("s3://b/x", on_error="ignore")


def _ckpt_state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _racing_writer(tmp_path: Path) -> Any:
    from ckpt.manager import CheckpointManager

    writer = CheckpointManager(tmp_path, keep_last=1)
    writer.save(0, _ckpt_state(0)).result()
    writer.wait(30)
    return writer


def _commit_next(writer: Any, evicted: Path) -> None:
    """The other manager publishes its next step; its retention evicts ``evicted``."""
    step = max(writer.steps()) + 1
    writer.save(step, _ckpt_state(step)).result()
    writer.wait(30)
    assert not evicted.exists()


def test_restore_when_the_listed_step_is_evicted_during_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flake of test_save_while_another_manager_restores, made deterministic: the reader
    lists ``step-0``; before it checks that step's manifest, the writer publishes ``step-1``
    and evicts ``step-0``. The listing held no complete step, and restore raised "no committed
    steps" although the directory always held one."""
    from ckpt.manager import CheckpointManager
    from ckpt.saving import commit

    writer = _racing_writer(tmp_path)
    reader = CheckpointManager(tmp_path)
    real, me, fired = commit.is_complete, threading.get_ident(), []

    def racing(path: Path) -> bool:
        if threading.get_ident() == me and not fired and path.name == "step-0":
            fired.append(path)
            _commit_next(writer, path)
        return real(path)

    monkeypatch.setattr(commit, "is_complete", racing)
    state = reader.restore()
    assert fired and state["step"] == 1 and torch.equal(state["w"], _ckpt_state(1)["w"])
    writer.close()


def test_restore_when_listed_steps_keep_vanishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each listed step is evicted before the reader opens it, 5 times in a row: the reader
    re-lists and gets the newest complete, verified step (it gave up after 3)."""
    from ckpt.manager import CheckpointManager
    from ckpt.saving import commit

    writer = _racing_writer(tmp_path)
    reader = CheckpointManager(tmp_path)
    real, me, fired = commit.reading, threading.get_ident(), []

    def racing(path: Path) -> Any:
        if threading.get_ident() == me and len(fired) < 5:
            fired.append(path.name)
            _commit_next(writer, path)
        return real(path)

    monkeypatch.setattr(commit, "reading", racing)
    state = reader.restore()
    assert fired == [f"step-{i}" for i in range(5)]
    assert state["step"] == 5 and torch.equal(state["w"], _ckpt_state(5)["w"])
    writer.close()


def test_restore_gives_up_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that evicts every listed step before the reader opens it: a clear error, never
    "no committed steps" and never another kind of failure."""
    from ckpt.errors import CheckpointError
    from ckpt.manager import CheckpointManager
    from ckpt.saving import commit

    writer = _racing_writer(tmp_path)
    reader = CheckpointManager(tmp_path)
    real, me = commit.reading, threading.get_ident()

    def racing(path: Path) -> Any:
        if threading.get_ident() == me:
            _commit_next(writer, path)
        return real(path)

    monkeypatch.setattr(commit, "reading", racing)
    with pytest.raises(CheckpointError, match="deleted before it could be opened"):
        reader.restore()
    writer.close()


def test_a_stable_incomplete_step_costs_one_more_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash's leftover ``step-N`` without a manifest, newer than every committed step, costs
    one more listing (unchanged: nothing is checked again), and is never listed as committed."""
    from ckpt.saving import commit

    writer = _racing_writer(tmp_path)
    writer.close()
    (tmp_path / "step-9").mkdir()
    real, checks = commit.is_complete, []

    def counting(path: Path) -> bool:
        checks.append(path.name)
        return real(path)

    monkeypatch.setattr(commit, "is_complete", counting)
    assert commit.steps(tmp_path) == [0]
    assert sorted(checks) == ["step-0", "step-9"]  # the second listing was the same: no checks
    assert commit.steps(tmp_path / "missing") == []

"""Adversarial review of issue 15 (points 4-10, 12-14): hostile manifests that pass the old
validator but still broke a restore, ``into=`` mismatches, URL handling and the CLI with
credentials. Each test failed before its fix."""

from __future__ import annotations

import collections
import enum
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt
from ckpt import cli
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.manager import CheckpointManager
from ckpt.restoring.reader import verify_step
from tests.test_ckpt_adversarial_manifest import write_raw


def _state(step: int) -> dict[str, Any]:
    return {
        "w": torch.full((4, 3), float(step)),
        "z": torch.empty(0, 3),
        "a": np.full(3, step, dtype="<f4"),
        "za": np.empty((0, 2), dtype="<f4"),
        "size": torch.Size([2, 3]),
        "step": step,
    }


def _item(body: dict, key: str) -> dict:
    return next(node for k, node in body["tree"]["items"] if k == key)


def _entry(body: dict, key: str) -> dict:
    return body["entries"][_item(body, key)["i"]]


def _two_steps(tmp_path: Path) -> CheckpointManager:
    m = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        m.save(step, _state(step)).result()
    return m


def _falls_back(m: CheckpointManager, path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(CorruptCheckpointError):
        verify_step(path)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        state = m.restore()
    assert state["step"] == 1
    assert "skipping step 2" in caplog.text


@pytest.mark.parametrize(
    ("key", "shape"),
    [
        ("z", [0, 1 << 62, 1 << 62]),  # torch: "Stride calculation overflowed"
        ("za", [0, 1 << 62, 1 << 62]),  # numpy: "array is too big"
        ("za", [1 << 62, 0]),
    ],
)
def test_zero_size_entry_with_huge_dims_is_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, shape: list[int]
) -> None:
    """nbytes == prod(shape) * itemsize == 0 held, yet building the empty array overflowed: the
    step verified, and restore raised a non-corrupt error (no fallback)."""
    m = _two_steps(tmp_path)
    path = tmp_path / "step-2"
    body = fmt.read_manifest(path)
    _entry(body, key)["shape"] = shape
    write_raw(path, body)
    _falls_back(m, path, caplog)
    m.close()


def test_size_node_beyond_int64_is_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``torch.Size([2**63])`` raises ValueError at unflatten, after the whole step was read."""
    m = _two_steps(tmp_path)
    path = tmp_path / "step-2"
    body = fmt.read_manifest(path)
    _item(body, "size")["items"] = [1 << 63]
    write_raw(path, body)
    _falls_back(m, path, caplog)
    m.close()


def test_zero_size_view_with_huge_dims_is_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        base = torch.arange(8, dtype=torch.float32) + step
        m.save(step, {"a": base, "b": base[2:], "step": step}).result()
    path = tmp_path / "step-2"
    body = fmt.read_manifest(path)
    _item(body, "b")["view"].update(shape=[0, 1 << 62, 1 << 62], stride=[1, 1, 1])
    write_raw(path, body)
    _falls_back(m, path, caplog)
    m.close()


@pytest.mark.parametrize("mmap", [False, True])
def test_into_shape_mismatch_writes_nothing(tmp_path: Path, mmap: bool) -> None:
    """A shape mismatch anywhere in ``into`` is a CheckpointError naming it, raised before any
    tensor of ``into`` is written (it used to stream ``a`` in, then fail at ``b`` with a raw
    RuntimeError; a shape that broadcasts was silently broadcast)."""
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"a": torch.ones(4), "b": torch.ones(3), "c": torch.full((1,), 7.0)}).result()
        for bad in ({"b": torch.zeros(5)}, {"c": torch.zeros(3)}):
            into = {"a": torch.zeros(4), "b": torch.zeros(3), "c": torch.zeros(1), **bad}
            before = {k: v.clone() for k, v in into.items()}
            with pytest.raises(CheckpointError, match=r"shape"):
                m.restore(into=into, mmap=mmap)
            for k, v in into.items():
                assert torch.equal(v, before[k]), k


def test_into_module_shape_mismatch_writes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        m.save(1, {"model": src}).result()
        dst = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
        before = [p.detach().clone() for p in dst.parameters()]
        with pytest.raises(CheckpointError, match=r"shape"):
            m.restore(into={"model": dst})
        for p, b in zip(dst.parameters(), before, strict=True):
            assert torch.equal(p.detach(), b)


def test_into_list_length_mismatch_writes_nothing(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"a": torch.ones(2), "l": [torch.ones(1), torch.ones(1)]}).result()
        into = {"a": torch.zeros(2), "l": [torch.zeros(1)]}
        with pytest.raises(CheckpointError, match=r"list"):
            m.restore(into=into)
        assert torch.equal(into["a"], torch.zeros(2))


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


def test_cli_url_with_credentials_prints_one_redacted_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A URL whose credentials make the client raise a non-OSError (botocore's
    ParamValidationError) printed a traceback holding the secret."""
    for argv in (
        ["ls", "s3://AKIAEXAMPLE:TOPSECRET@bucket/run", "--endpoint-url", "http://127.0.0.1:9"],
        ["verify", "memory://user:TOPSECRET@host/none"],
        ["gc", "s3://user:TOPSECRET@bucket/run"],
        ["ls", "file://user:TOPSECRET@localhost/nonexistent"],
    ):
        rc = cli.main(argv)
        out = capsys.readouterr()
        text = out.out + out.err
        assert rc != 0, argv
        assert "TOPSECRET" not in text, (argv, text)
        assert "Traceback" not in text


def test_remote_garbage_manifest_newer_than_local(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A remote step-N whose manifest is garbage: listed (listing only), but restore falls back
    to the newest good step with a logged reason; verify=True semantics hold."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "a", keep_last=None, remote=f"file://{remote}") as m:
        m.save(1, _state(1)).result()
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


class _Checked(collections.namedtuple("_Checked", ["x"])):
    """A registered namedtuple whose constructor validates (raises on a hostile value)."""

    __slots__ = ()

    def __new__(cls, x: int) -> _Checked:
        if not isinstance(x, int):
            raise TypeError(f"x must be an int, got {x!r}")
        return super().__new__(cls, x)


class _Picky(enum.IntEnum):
    A = 1

    @classmethod
    def _missing_(cls, value: object) -> Any:
        raise TypeError(f"no {value!r}")


def test_registered_class_refusing_saved_values_is_not_a_raw_error(tmp_path: Path) -> None:
    """A hostile value for a registered class whose constructor (or ``_missing_``) raises came out
    of ``restore`` as that raw exception; it falls back like an unregistered class, warning."""
    ckpt.register_type(_Checked)
    ckpt.register_type(_Picky)
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"t": _Checked(3), "e": _Picky.A}).result()
        path = tmp_path / "step-1"
        body = fmt.read_manifest(path)
        _item(body, "t")["items"][0]["v"] = "rm -rf /"
        _item(body, "e")["v"] = 7
        write_raw(path, body)
        with pytest.warns(UserWarning, match="refused the saved values"):
            state = m.restore()
        assert state["t"].x == "rm -rf /" and not isinstance(state["t"], _Checked)
        assert state["e"] == 7


@pytest.mark.parametrize("name", ["step-²", "step-٣", "step-03", "step-3\n"])
def test_step_names_are_ascii_and_canonical(tmp_path: Path, name: str) -> None:
    """``str.isdigit``/``\\d`` took ``step-²`` (then ``int()`` raised: ``ckpt ls`` tracebacked and
    a remote with such an object made ``latest_step()`` fail) and ``step-٣``/``step-03`` as step
    3, whose directory ``step-3`` does not exist. Only the names ckpt writes are steps."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "a", keep_last=None, remote=f"file://{remote}") as m:
        m.save(1, _state(1)).result()
        m.wait(uploads=True)
    for root in (tmp_path / "a", remote):
        (root / name).mkdir()
        (root / name / fmt.MANIFEST).write_bytes((root / "step-1" / fmt.MANIFEST).read_bytes())
    assert cli.main(["ls", str(tmp_path / "a")]) == 0
    assert cli.main(["ls", f"file://{remote}"]) == 0
    with CheckpointManager(tmp_path / "a", keep_last=None, remote=f"file://{remote}") as m2:
        assert m2.steps() == [1]
        assert m2.restore()["step"] == 1


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
        m.save(50, _state(50)).result()
        m.save(100, _state(100)).result()
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


@pytest.mark.parametrize(
    "into",
    [
        lambda: ({"a": torch.zeros(4)}, {"a": torch.zeros(4), "n": {}}),  # 5 into a dict
        lambda: (None, (torch.zeros(4),)),  # a tuple: apply_into refuses it
        lambda: ({"a": torch.zeros(4)}, {"a": torch.zeros(4), "l": [torch.zeros(1), {}]}),
    ],
)
def test_into_that_apply_into_refuses_writes_nothing(tmp_path: Path, into: Any) -> None:
    """``apply_into`` raised "cannot load ..." after the matching tensors had been streamed in."""
    _, target = into()
    with CheckpointManager(tmp_path, keep_last=None) as m:
        if isinstance(target, tuple):
            m.save(1, (torch.ones(4),)).result()
        else:
            m.save(1, {"a": torch.ones(4), "n": 5, "l": [torch.ones(1), 3]}).result()
        with pytest.raises(CheckpointError, match="cannot load"):
            m.restore(into=target)
        first = target["a"] if isinstance(target, dict) else target[0]
        assert torch.equal(first, torch.zeros(4))


def test_lightning_url_error_is_redacted(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from ckpt.integrations.lightning import CkptCheckpointIO

    with pytest.raises(ValueError, match="CkptCheckpointIO") as info:
        CkptCheckpointIO().save_checkpoint({"w": torch.ones(1)}, "s3://AKIA:TOPSECRET@b/x.ckpt")
    assert "TOPSECRET" not in str(info.value)


def test_into_module_with_missing_keys_writes_nothing(tmp_path: Path) -> None:
    """Broke: torch's strict load_state_dict refused the module only after ckpt had streamed
    the matching parameters into it."""
    with CheckpointManager(tmp_path, keep_last=None) as m:
        m.save(1, {"model": torch.nn.Linear(3, 4)}).result()
        dst = torch.nn.Linear(3, 4, bias=False)  # the saved "bias" has nowhere to go
        before = dst.weight.detach().clone()
        with pytest.raises(CheckpointError):
            m.restore(into={"model": dst})
        assert torch.equal(dst.weight.detach(), before)

"""ckpt.format's manifest validator: hostile manifests with valid checksums that once passed it
(huge dimensions of empty tensors, sizes beyond int64, registered classes refusing saved values,
step names) are ``CorruptCheckpointError``."""

from __future__ import annotations

import collections
import enum
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import state_with_empties as _state
from _helpers import write_raw

import ckpt
from ckpt import cli
from ckpt import format as fmt
from ckpt.errors import CorruptCheckpointError
from ckpt.manager import CheckpointManager
from ckpt.restoring.reader import verify_step


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

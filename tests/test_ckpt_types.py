"""What users save comes back: namedtuples, ``torch.Size``, ``OrderedDict``, ``bytearray``,
``IntEnum``, ``requires_grad``, ``nn.Parameter`` and tensors sharing storage (one entry, views
restored as views), all without pickle: classes come back only through ``ckpt.register_type``."""

from __future__ import annotations

import enum
import warnings
from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import ckpt
from ckpt import format as fmt
from ckpt.manager import CheckpointManager


class Point(NamedTuple):
    x: int
    y: torch.Tensor


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Mode(str, enum.Enum):
    TRAIN = "train"


Loose = namedtuple("Loose", ["a", "b"])  # never registered


@pytest.fixture(autouse=True)
def _registered() -> None:
    ckpt.register_type(Point)
    ckpt.register_type(Color)
    ckpt.register_type(Mode)


def _roundtrip(tmp_path: Path, state: Any) -> Any:
    return ckpt.load(ckpt.save(tmp_path / "c", state))


def test_containers_and_scalars_keep_their_types(tmp_path: Path) -> None:
    state = {
        "p": Point(3, torch.ones(2)),
        "size": torch.Size([2, 3]),
        "od": OrderedDict([("b", 1), ("a", 2)]),
        "ba": bytearray(b"\x00\xff"),
        "b": b"\x01",
        "color": Color.GREEN,
        "mode": Mode.TRAIN,
        "t": (1, [2]),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _roundtrip(tmp_path, state)
    assert type(out["p"]) is Point and out["p"].x == 3 and torch.equal(out["p"].y, torch.ones(2))
    assert type(out["size"]) is torch.Size and out["size"] == torch.Size([2, 3])
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]
    assert type(out["ba"]) is bytearray and out["ba"] == bytearray(b"\x00\xff")
    assert type(out["b"]) is bytes
    assert out["color"] is Color.GREEN and out["mode"] is Mode.TRAIN
    assert out["t"] == (1, [2]) and type(out["t"]) is tuple


def test_unregistered_classes_fall_back_with_a_warning(tmp_path: Path) -> None:
    class Local(enum.IntEnum):
        A = 7

    state = {"loose": Loose(1, "x"), "local": Local.A}
    with pytest.warns(UserWarning, match="register_type") as record:
        out = _roundtrip(tmp_path, state)
    assert len(record) >= 2
    assert out["loose"] == (1, "x") and out["loose"].a == 1 and out["loose"].b == "x"
    assert type(out["loose"]).__name__ == "Loose" and type(out["loose"]) is not Loose
    assert out["local"] == 7 and type(out["local"]) is int


def test_requires_grad_and_parameters(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    state = {"w": w, "frozen": frozen, "g": torch.ones(2, requires_grad=True), "n": torch.ones(1)}
    out = _roundtrip(tmp_path, state)
    assert isinstance(out["w"], torch.nn.Parameter) and out["w"].requires_grad
    assert isinstance(out["frozen"], torch.nn.Parameter) and not out["frozen"].requires_grad
    assert torch.equal(out["w"].detach(), w.detach())
    assert type(out["g"]) is torch.Tensor and out["g"].requires_grad and out["g"].is_leaf
    assert not out["n"].requires_grad


def test_shared_storage_is_one_entry_and_views_stay_views(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    tied = torch.nn.Linear(4, 4, bias=False)
    state = {
        "base": base,
        "rows": base.view(3, 4),
        "t": base.view(3, 4).t(),
        "tail": base[6:],
        "bytes": base.view(torch.uint8)[4:8],
        "emb": tied.weight,
        "head": tied.weight,
    }
    path = ckpt.save(tmp_path / "c", state)
    body = fmt.read_manifest(path)
    assert len(body["entries"]) == 2  # one per storage
    out = ckpt.load(path)
    assert out["rows"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    assert out["t"].stride() == (1, 4) and torch.equal(out["t"], base.view(3, 4).t())
    assert torch.equal(out["bytes"], base.view(torch.uint8)[4:8])
    out["base"][7] = -1.0  # a write through one is seen by the others, as before saving
    assert out["rows"][1, 3] == -1.0 and out["tail"][1] == -1.0 and out["t"][3, 1] == -1.0
    assert out["emb"] is not out["head"]
    assert out["emb"].data_ptr() == out["head"].data_ptr()
    assert isinstance(out["emb"], torch.nn.Parameter) and out["emb"].requires_grad
    mapped = ckpt.load(path, mmap=True)
    assert all(torch.equal(mapped[k], state[k]) for k in ("rows", "t", "tail", "bytes", "emb"))
    assert mapped["rows"].untyped_storage().data_ptr() == mapped["t"].untyped_storage().data_ptr()


def test_small_views_of_a_big_storage_stay_copies(tmp_path: Path) -> None:
    big = torch.zeros(1 << 20)
    path = ckpt.save(tmp_path / "c", {"a": big[:2], "b": big[-2:]})
    body = fmt.read_manifest(path)
    assert [e["nbytes"] for e in body["entries"]] == [8, 8]  # not the 4 MiB between them
    out = ckpt.load(path)
    assert out["a"].data_ptr() != out["b"].data_ptr()


def test_manager_restore_into_keeps_ties_and_types(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    grads = torch.ones(2, requires_grad=True)
    with CheckpointManager(tmp_path) as m:
        state = {"model": model, "size": torch.Size([3]), "color": Color.RED, "g": grads}
        m.save(1, state).result()
        plain = torch.zeros(2)  # the caller's tensor: filled, its requires_grad left alone
        # every saved key has its place (strict, as torch's load_state_dict): replaced values
        into: dict[str, Any] = {"model": torch.nn.Linear(3, 3), "g": plain, "size": 0, "color": 0}
        out = m.restore(into=into)
    assert torch.equal(into["model"].weight, model.weight)
    assert out["size"] == torch.Size([3]) and into["color"] is Color.RED
    assert into["g"] is plain and not plain.requires_grad and torch.equal(plain, torch.ones(2))


def test_register_type_refuses_other_classes() -> None:
    with pytest.raises(TypeError, match="namedtuple class or an Enum"):
        ckpt.register_type(dict)

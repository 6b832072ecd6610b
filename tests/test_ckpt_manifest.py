"""Hostile manifests with VALID checksums: every defect is a ``CorruptCheckpointError`` naming the
field, never a raw ``IndexError``/``TypeError``/``RecursionError``/..., never wrong data, and
``CheckpointManager.restore()`` falls back to the older good step, logging why."""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import save_two_steps as _run
from _helpers import write_raw
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import cli
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.manager import CheckpointManager
from ckpt.restoring.reader import read_checkpoint, verify_step
from feedpipe.io.crc import crc32c, to_hex


def _state(step: int) -> dict[str, Any]:
    return {
        "w": torch.full((4, 3), float(step)),
        "b": torch.arange(5, dtype=torch.int64) + step,
        "a": np.full(3, step, dtype="<f4"),
        "s": np.float32(step),
        "nest": {"x": [1, (2.5, "s")], "f": float("inf"), "raw": b"\x00\x01"},
        "step": step,
    }


def _body(step_dir: Path) -> dict:
    return fmt.read_manifest(step_dir)


@pytest.fixture
def two_steps(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    m = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        m.save(step, _state(step)).result()
    return m, tmp_path / "step-2"


def _tree_index(body: dict, key: str) -> dict:
    return next(node for k, node in body["tree"]["items"] if k == key)


def _deep(body: dict) -> None:
    node: dict = {"t": "v", "v": 1}
    for _ in range(300):
        node = {"t": "list", "items": [node]}
    body["tree"]["items"].append(["deep", node])


def _set_infinity(body: dict) -> None:
    body["entries"][0]["offset"] = float("inf")


CASES: dict[str, tuple[Callable[[dict], None], str]] = {
    "tree index -1": (lambda b: _tree_index(b, "w").update(i=-1), "tree.items[0][1].i"),
    "tree index too big": (lambda b: _tree_index(b, "w").update(i=99), ".i"),
    "tree index is a string": (lambda b: _tree_index(b, "w").update(i="0"), ".i"),
    "tensor node on ndarray entry": (lambda b: _tree_index(b, "a").update(t="tensor"), ".i"),
    "npscalar on 1-d entry": (lambda b: _tree_index(b, "a").update(t="npscalar"), ".i"),
    "device meta": (lambda b: b["entries"][0].update(device="meta"), "entries[0].device"),
    "device garbage": (lambda b: b["entries"][0].update(device="cuda:x"), "entries[0].device"),
    "device not a string": (lambda b: b["entries"][0].update(device=0), "entries[0].device"),
    "huge file size": (lambda b: b["files"][0].update(size=2**70), "files[0].size"),
    "huge chunk count": (lambda b: b["files"][0].update(chunk_bytes=1), "files[0].crc32c"),
    "huge nbytes": (lambda b: b["entries"][0].update(nbytes=2**200), "entries[0].nbytes"),
    "huge shape": (lambda b: b["entries"][0].update(shape=[2**40, 2**40]), "entries[0].nbytes"),
    "negative shape": (lambda b: b["entries"][0].update(shape=[-4, -3]), "entries[0].shape"),
    "negative offset": (lambda b: b["entries"][0].update(offset=-64), "entries[0].offset"),
    "unaligned offset": (lambda b: b["entries"][1].update(offset=3), "entries[1].offset"),
    "beyond the file": (lambda b: b["entries"][0].update(offset=1 << 30), "entries[0].offset"),
    "float offset": (lambda b: b["entries"][0].update(offset=0.0), "entries[0].offset"),
    "infinite offset": (_set_infinity, "Infinity"),
    "nan value": (lambda b: b["tree"]["items"][-1][1].update(v=float("nan")), "NaN"),
    "bool size": (lambda b: b["files"][0].update(size=True), "files[0].size"),
    "deep nesting": (_deep, "deeper than"),
    "quantized dtype": (lambda b: b["entries"][0].update(dtype="qint8"), "qint8"),
    "dtype attribute name": (lambda b: b["entries"][0].update(dtype="Tensor"), "Tensor"),
    "object numpy dtype": (lambda b: b["entries"][2].update(dtype="|O"), "|O"),
    "structured numpy dtype": (lambda b: b["entries"][2].update(dtype="<i2,<i2"), "<i2,<i2"),
    "unknown kind": (lambda b: b["entries"][0].update(kind="pickle"), "entries[0].kind"),
    "entries not a list": (lambda b: b.update(entries={"0": 1}), "entries"),
    "files not a list": (lambda b: b.update(files="data.bin"), "files"),
    "tree is a list": (lambda b: b.update(tree=[]), "tree"),
    "items not a list": (lambda b: b["tree"].update(items=5), "tree.items"),
    "key is a list": (lambda b: b["tree"]["items"][0].__setitem__(0, [1]), "tree.items[0]"),
    "repeated key": (lambda b: b["tree"]["items"].append(b["tree"]["items"][0]), "repeated"),
    "unknown node type": (lambda b: _tree_index(b, "step").update(t="eval"), ".t"),
    "bytes not base64": (
        lambda b: b["tree"]["items"].append(["r", {"t": "bytes", "v": "!"}]),
        "base64",
    ),
    "dtype node": (lambda b: b["tree"]["items"].append(["d", {"t": "dtype", "v": "x"}]), "'x'"),
    "float node": (lambda b: b["tree"]["items"].append(["f", {"t": "float", "v": "1e999"}]), ".v"),
    "view of a typed entry": (
        lambda b: b["tree"]["items"].append(
            [
                "v",
                {
                    "t": "tensor",
                    "i": 0,
                    "view": {"dtype": "float32", "shape": [9], "stride": [1], "offset": 0},
                },
            ]
        ),
        "needs a uint8",
    ),
    "namedtuple keyword field": (
        lambda b: b["tree"]["items"].append(
            [
                "n",
                {"t": "namedtuple", "cls": "m.P", "fields": ["def"], "items": [{"t": "v", "v": 1}]},
            ]
        ),
        ".fields",
    ),
    "enum bool value": (
        lambda b: b["tree"]["items"].append(["e", {"t": "enum", "cls": "m.E", "v": True}]),
        ".v",
    ),
    "rg on an int tensor": (lambda b: _tree_index(b, "b").update(rg=True), ".rg"),
    "overlapping entries": (lambda b: b["entries"][3].update(offset=0), "overlaps"),
    "device node": (
        lambda b: b["tree"]["items"].append(["d", {"t": "device", "v": "abc:1"}]),
        "not a device name",
    ),
    "version is True": (lambda b: b.update(version=True), "version"),
    "body is a list": (lambda b: b.clear(), "format"),
    "crc list": (lambda b: b["files"][0].update(crc32c=[1]), "files[0].crc32c[0]"),
    "unsafe name": (lambda b: b["files"][0].update(name="../x"), "unsafe file name"),
    "metadata not a dict": (lambda b: b.update(metadata=[1]), "metadata"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_manifest_falls_back(
    two_steps: tuple[CheckpointManager, Path], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    m, step2 = two_steps
    mutate, field = CASES[case]
    body = _body(step2)
    mutate(body)
    write_raw(step2, body)
    with pytest.raises(CorruptCheckpointError, match="manifest") as info:
        read_checkpoint(step2)
    assert field in str(info.value) and str(step2) in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        verify_step(step2)
    assert cli.main(["verify", str(step2.parent), "--step", "2"]) == 1
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        state = m.restore()
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((4, 3), 1.0))
    assert any("skipping step 2" in r.getMessage() for r in caplog.records)
    with pytest.raises(CorruptCheckpointError):
        m.restore(step=2)
    m.close()


def test_unmodified_manifest_restores(two_steps: tuple[CheckpointManager, Path]) -> None:
    m, step2 = two_steps
    write_raw(step2, _body(step2))  # the raw writer itself produces a valid manifest
    state = m.restore()
    assert state["step"] == 2 and state["nest"]["x"] == [1, (2.5, "s")]
    assert state["s"] == np.float32(2) and isinstance(state["s"], np.float32)
    verify_step(step2)
    m.close()


def test_json_nested_beyond_the_parser(two_steps: tuple[CheckpointManager, Path]) -> None:
    m, step2 = two_steps
    body = json.dumps(_body(step2), sort_keys=True, separators=(",", ":"))
    deep = '"deep":' + '{"t":"list","items":[' * 100_000 + "]}" * 100_000 + ","
    canon = body.replace('"entries":', deep + '"entries":', 1).encode()
    text = b'{"crc32c":"' + to_hex(crc32c(canon)).encode() + b'","body":' + canon + b"}\n"
    (step2 / fmt.MANIFEST).write_bytes(text)
    with pytest.raises(CorruptCheckpointError, match="recursion"):
        read_checkpoint(step2)
    assert m.restore()["step"] == 1
    m.close()


def test_saving_a_too_deep_state_is_refused(tmp_path: Path) -> None:
    state: Any = 1
    for _ in range(fmt.MAX_DEPTH + 1):
        state = [state]
    with pytest.raises(CheckpointError, match="deeper than"):
        ckpt.save(tmp_path / "c", {"s": state})
    ok: Any = 1
    for _ in range(fmt.MAX_DEPTH - 1):
        ok = [ok]
    assert ckpt.load(ckpt.save(tmp_path / "d", {"s": ok}))["s"] == ok


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["meta", "cuda:0", "qint8", "|O", "tensor", "ndarray", "dict", "data.bin"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location (a tuple of keys/indices) inside a JSON document."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def _mutations(draw: st.DrawFn, body: dict) -> dict:
    body = copy.deepcopy(body)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(_paths(body)[1:]))
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "wrap", "int"]))
        key = where[-1]
        if action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif action == "wrap":
            parent[key] = [parent[key]]
        elif action == "int":
            parent[key] = draw(st.sampled_from([-1, 0, 1, 63, 64, 2**31, 2**63, -(2**63), 10**30]))
        else:
            parent[key] = draw(_JSON)
    return body


def _check_generated(data: st.DataObject, step2: Path, good: dict) -> None:
    """Only ``CorruptCheckpointError`` escapes, and verify passes exactly when restore does."""
    write_raw(step2, data.draw(_mutations(good)))
    try:
        verify_step(step2)
        verified = True
    except CorruptCheckpointError:
        verified = False
    try:
        state, _, _ = read_checkpoint(step2)
    except CorruptCheckpointError:
        assert not verified, "verify_step passed a step that restore rejects"
        return
    assert verified, "verify_step rejected a step that restores"
    assert state is not None


def _generated(max_examples: int) -> Callable[[], None]:
    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        _check_generated(data, run.step2, run.good)  # type: ignore[attr-defined]

    def test() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            m = CheckpointManager(tmp, keep_last=None)
            m.save(2, _state(2)).result()
            m.close()
            run.step2 = Path(tmp) / "step-2"  # type: ignore[attr-defined]
            run.good = _body(run.step2)  # type: ignore[attr-defined]
            run()

    return test


test_generated_hostile_manifests = _generated(150)


test_generated_hostile_manifests = _generated(150)
test_generated_hostile_manifests_many = pytest.mark.slow(_generated(3000))


def _deflated(obj: Any) -> bytes:
    """``torch.save(obj)`` re-zipped with deflate: a few KiB that expand to the full size."""
    import io
    import zipfile

    plain = io.BytesIO()
    torch.save(obj, plain)
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(plain.getvalue())) as zin,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout,
    ):
        for name in zin.namelist():
            zout.writestr(name, zin.read(name))
    return out.getvalue()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_byte_item_bomb_is_refused() -> None:
    """A DCP byte item is loaded with ``weights_only=True``, which also inflates deflated zip
    entries: a 50 KiB item would allocate 50 MB (GBs for a larger one). Only what torch.save
    writes (stored entries, the zip format) is accepted, so memory is bounded by the item."""
    import io

    from ckpt.dcp import load_bytes_item

    bomb = _deflated(torch.zeros(50_000_000, dtype=torch.uint8))
    assert len(bomb) < 1_000_000
    with pytest.raises(CheckpointError, match=r"item 'x'.*compressed"):
        load_bytes_item(bomb, "item 'x'")
    legacy = io.BytesIO()
    torch.save({"a": 1}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"item 'y'.*not a torch\.save zip"):
        load_bytes_item(legacy.getvalue(), "item 'y'")
    plain = io.BytesIO()
    torch.save({"a": torch.arange(3), "b": "text"}, plain)
    got = load_bytes_item(plain.getvalue(), "item 'z'")
    assert got["b"] == "text" and torch.equal(got["a"], torch.arange(3))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_giant_sparse_manifest_is_refused_unread(tmp_path: Path) -> None:
    """A sparse manifest larger than ``MAX_MANIFEST_BYTES`` is a CorruptCheckpointError before
    any of it is read (it is read whole otherwise), and restore falls back."""
    from ckpt import format as fmt
    from ckpt.errors import CorruptCheckpointError

    root = _run(tmp_path / "run")
    with open(root / "step-2" / "manifest.json", "r+b") as f:
        f.truncate(fmt.MAX_MANIFEST_BYTES + 4096)
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: manifest is .* limit"):
        ckpt.load(root / "step-2")
    with CheckpointManager(root) as m:
        assert m.restore()["step"] == 1

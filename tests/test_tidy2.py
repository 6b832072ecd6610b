"""The tidy2 items: small code-quality and correctness fixes, one section each."""

from __future__ import annotations

import ast
import dataclasses
import gc
import inspect
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import MemmapDataset, MemmapWriter
from feedpipe.loader import threads

# ------------------------------------------------------------------ 1: thread worker options


def test_thread_worker_takes_one_frozen_options_object() -> None:
    """``_worker_loop`` and ``_worker_body`` take (wid, dataset, inbox, options): the shared
    settings travel in one frozen dataclass instead of a 17-parameter signature."""
    for fn in (threads._worker_loop, threads._worker_body):
        params = list(inspect.signature(fn).parameters)
        assert params == ["wid", "dataset", "inbox", "opts"], fn.__name__
    opts_type = threads._WorkerOptions
    assert dataclasses.is_dataclass(opts_type)
    assert opts_type.__dataclass_params__.frozen  # type: ignore[attr-defined]


class _Squares(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i * i


def _seen_seed(_: int) -> None:
    info = feedpipe.get_worker_info()
    assert info is not None
    _SEEDS.append((info.id, info.num_workers, info.seed))


_SEEDS: list[tuple[int, int, int]] = []


def test_thread_workers_behave_as_before() -> None:
    """Same batches, order, worker info and init hook as torch's process workers would give."""
    _SEEDS.clear()
    loader = feedpipe.DataLoader(
        _Squares(), batch_size=4, num_workers=3, worker_type="thread", worker_init_fn=_seen_seed,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    out = torch.cat(list(loader))
    assert out.tolist() == [i * i for i in range(40)]
    assert sorted(s[:2] for s in _SEEDS) == [(0, 3), (1, 3), (2, 3)]
    seeds = sorted(s[2] for s in _SEEDS)
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    with pytest.raises(ZeroDivisionError):
        list(feedpipe.DataLoader(_Squares(), num_workers=2, worker_type="thread",
                                 worker_init_fn=lambda w: 1 // 0))  # fmt: skip


# ------------------------------------------------------------------ 2: one column type in format


def test_layout_and_field_share_one_column_type() -> None:
    """``Layout`` and ``FieldSpec`` are one column type (shared sizes and JSON), not two copies."""
    from feedpipe.datasets.format import FieldSpec, Layout

    for name in ("record_bytes", "row_bytes", "to_json"):
        assert getattr(Layout, name) is getattr(FieldSpec, name), name


@pytest.mark.parametrize(
    ("spec", "doc", "record", "row"),
    [
        (
            ("L", "fixed", (2, 3), "int32"),
            {"kind": "fixed", "shape": [2, 3], "dtype": "int32"},
            24,
            24,
        ),
        (("L", "bytes"), {"kind": "bytes"}, 0, 1),
        (("L", "none"), {"kind": "none"}, 0, 1),
        (
            ("L", "ragged", (4,), "float16"),
            {"kind": "ragged", "shape": [None, 4], "dtype": "float16"},
            0,
            8,
        ),
        (("F", "int64"), {"dtype": "int64", "shape": []}, 8, 8),
        (("F", "uint8", (5,)), {"dtype": "uint8", "shape": [5]}, 5, 5),
        (
            ("F", "int32", (2,), "ragged"),
            {"kind": "ragged", "dtype": "int32", "shape": [None, 2]},
            0,
            8,
        ),
        (("F", "uint8", (), "str"), {"kind": "str"}, 0, 1),
        (("F", "uint8", (), "json"), {"kind": "json"}, 0, 1),
    ],
)
def test_column_json_and_sizes_are_unchanged(
    spec: tuple[object, ...], doc: dict[str, object], record: int, row: int
) -> None:
    """The exact JSON (key order included, so index.json bytes do not change) and sizes."""
    from feedpipe.datasets.format import FieldSpec, Layout, _parse_fields, _parse_layout

    cls = Layout if spec[0] == "L" else FieldSpec
    col = cls(*spec[1:])  # type: ignore[arg-type]
    assert list(col.to_json().items()) == list(doc.items())
    assert (col.record_bytes, col.row_bytes) == (record, row)
    back = _parse_layout(doc) if cls is Layout else _parse_fields({"f": doc})["f"]
    assert back == col


# ------------------------------------------------------------------ 3: one file:// rule

FILE_URLS = [
    ("file:///abs/x", "/abs/x"),
    ("file://localhost/abs/x", "/abs/x"),
    ("FILE://LocalHost/abs/x", "/abs/x"),  # the scheme and the host name are case-insensitive
    ("file:///a%20b/c?d#e", "/a%20b/c?d#e"),  # literal, as fsspec's local filesystem
    ("file:///abs/x/", "/abs/x/"),
    ("file:name", "file:name"),  # no slash: a relative path whose name has a colon
    ("/abs/x", "/abs/x"),
    ("rel/x", "rel/x"),
    ("s3://bucket/x", "s3://bucket/x"),
]
BAD_FILE_URLS = [
    ("file://otherhost/abs", "another host"),
    ("file://relative/path", "another host"),  # RFC 8089: what follows file:// is a host
    ("file://user:TOPSECRET@localhost/abs", "another host"),
    ("file://", "no path"),
    ("file:///", "no path"),
    ("file://localhost", "no path"),
    ("file:/abs", "ambiguous"),  # what Path() makes of file:///abs and file://localhost/abs
]


@pytest.mark.parametrize(("url", "path"), FILE_URLS)
def test_local_file_path(url: str, path: str) -> None:
    from feedpipe.io import local_file_path

    assert local_file_path(url) == path
    assert local_file_path(Path("/abs/x")) == "/abs/x"  # a PathLike


@pytest.mark.parametrize(("url", "why"), BAD_FILE_URLS)
def test_local_file_path_refuses(url: str, why: str) -> None:
    from feedpipe.io import local_file_path

    with pytest.raises(ValueError, match=why) as err:
        local_file_path(url)
    assert "TOPSECRET" not in str(err.value)


def test_no_file_url_stripping_outside_feedpipe_io() -> None:
    """Every entry point reaches ``file://`` through the one helper, never by slicing."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted([*root.glob("feedpipe/**/*.py"), *root.glob("ckpt/**/*.py")]):
        text = path.read_text()
        if path.relative_to(root).as_posix() != "feedpipe/io/remote.py" and re.search(
            r"""(startswith\(|len\()\s*["']file:""", text
        ):
            found.append(path.relative_to(root).as_posix())
    assert found == []


def _small_dataset(path: Path) -> np.ndarray:
    x = np.arange(24, dtype=np.int32).reshape(6, 4)
    with MemmapWriter(f"FILE://localhost{path}", shape=(4,), dtype="int32") as w:
        w.append_batch(x)
    return x


def test_every_entry_point_uses_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writer, reader, converter, ``feedpipe inspect``, ckpt and fsspec resolution: one rule."""
    from feedpipe import cli as feedpipe_cli
    from feedpipe.io import resolve

    monkeypatch.chdir(tmp_path)
    x = _small_dataset(tmp_path / "ds")
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # not a folder named FILE: or localhost
    ds = MemmapDataset(f"file://localhost{tmp_path}/ds")
    assert np.array_equal(np.stack([ds[i].numpy() for i in range(len(ds))]), x)
    assert resolve(f"FILE://localhost{tmp_path}/ds")[1] == f"{tmp_path}/ds"
    for bad in (f"file://otherhost{tmp_path}/ds", f"file:{tmp_path}/ds"):
        with pytest.raises(ValueError, match="file:"):
            MemmapDataset(bad)
        with pytest.raises(ValueError, match="file:"):
            MemmapWriter(bad, shape=(4,), dtype="int32")
        with pytest.raises(ValueError, match="file:"):
            resolve(bad)
        assert feedpipe_cli.main(["inspect", bad]) == 1  # the CLI's one error handler
        assert re.search("another host|ambiguous", capsys.readouterr().err)
    from ckpt import CheckpointManager

    with CheckpointManager(f"FILE://{tmp_path}/run") as m:
        assert m.directory == tmp_path / "run"
    assert sorted(os.listdir(tmp_path)) == ["ds", "run"]


# ------------------------------------------------------------------ 4: no private manager calls


def test_no_ckpt_module_reaches_into_a_manager() -> None:
    """Outside ``ckpt/manager.py`` no module touches a manager's private attributes
    (``manager._ensure_writer()`` in ``ckpt.dcp`` did): tests/test_layers.py rule 3 in spirit."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted(root.glob("ckpt/**/*.py")):
        if path.name == "manager.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and "manager" in ast.unparse(node.value)
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_dcp_coordinator_becomes_the_writer(tmp_path: Path) -> None:
    """The DCP coordinator takes the writer lock and clears leftovers before any rank writes."""
    from ckpt import _layout
    from ckpt.dcp import CkptStorageWriter
    from ckpt.errors import CheckpointError
    from ckpt.manager import CheckpointManager, WriteOptions

    leftover = tmp_path / _layout.tmp_name(_layout.step_name(9), "dcp")
    leftover.mkdir()
    with CheckpointManager(tmp_path) as m:
        assert leftover.exists()  # nothing removed until a writer is needed
        CkptStorageWriter(tmp_path, 1, manager=m).set_up_storage_writer(True, rank=0)
        assert not leftover.exists()
        other = CheckpointManager(tmp_path, write=WriteOptions(lock_timeout_s=0.2))
        with pytest.raises((CheckpointError, TimeoutError)):
            other.ensure_writer()
        other.close()


# ------------------------------------------------------------------ 5: ckpt gc --keep-last none


def _gc_steps(root: Path, *flags: str) -> tuple[int, list[int]]:
    from ckpt import cli
    from ckpt.saving import commit

    rc = cli.main(["gc", str(root), *flags])
    return rc, sorted(commit.steps(root))


@pytest.fixture
def ten_steps(tmp_path: Path) -> Path:
    from ckpt import CheckpointManager

    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=None) as m:
        for step in range(0, 10):
            m.save(step, {"w": torch.full((2,), float(step))})
    return root


def test_gc_keep_last_none_turns_the_count_limit_off(
    ten_steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpt import _layout

    leftover = ten_steps / _layout.tmp_name(_layout.step_name(10), "x")
    leftover.mkdir()
    for flag in ("none", "NONE", " None "):
        assert _gc_steps(ten_steps, "--keep-last", flag) == (0, list(range(10)))
    assert not leftover.exists()  # leftovers still go
    out = capsys.readouterr().out
    assert "deleted" not in out and "removed leftover" in out
    # with another flag, that flag alone decides (plus the newest restorable step)
    assert _gc_steps(ten_steps, "--keep-last", "none", "--keep-every", "4") == (0, [0, 4, 8, 9])
    # without flags: the manager's recorded policy (keep_last=None keeps every step), never a
    # default of gc's own (issue 25 item 2; this asserted "the default is still 3")
    assert _gc_steps(ten_steps) == (0, [0, 4, 8, 9])
    assert _gc_steps(ten_steps, "--keep-last", "2") == (0, [8, 9])


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", "", "nan"])
def test_gc_keep_last_refuses_garbage(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpt import cli

    with pytest.raises(SystemExit) as err:
        cli.main(["gc", str(tmp_path), "--keep-last", bad])
    assert err.value.code == 2
    assert "--keep-last" in capsys.readouterr().err


# ------------------------------------------------------------------ 6: FEEDPIPE_WORKER_SLOTS words


def _slot_loader() -> feedpipe.DataLoader:
    return feedpipe.DataLoader(_Squares(), batch_size=4, num_workers=2)


@pytest.mark.parametrize("word", ["0", "false", "No", "OFF", " off "])
def test_worker_slots_off_words(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", word)
    assert _slot_loader().worker_slots is None


@pytest.mark.parametrize("word", ["1", "true", "Yes", "ON"])
def test_worker_slots_on_words(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", word)
    info = _slot_loader().worker_slots
    assert info is not None and info["slots_per_worker"] > 0


@pytest.mark.parametrize("word", ["", "2", "disable", "of", "nope"])
def test_worker_slots_refuses_other_values(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("FEEDPIPE_WORKER_SLOTS", word)
    loader = _slot_loader()
    with pytest.raises(ValueError, match=f"FEEDPIPE_WORKER_SLOTS={word!r}"):
        iter(loader)


# ------------------------------------------------------------------ 7: worker slots grow


@pytest.fixture
def _fresh_worker_slots() -> Any:
    from feedpipe.loader import slots as slots_mod

    slots_mod._WORKER.clear()
    yield slots_mod
    slots_mod._WORKER.clear()


def _rows(n: int, start: int = 0) -> list[torch.Tensor]:
    return [torch.full((64,), float(start + i)) for i in range(n)]


def _received(ref: Any) -> Any:
    assert ref is not None
    ref.received = True  # as if it had come through the queue
    return ref


def test_slots_grow_at_the_next_safe_point(_fresh_worker_slots: Any) -> None:
    """A batch larger than the slots goes torch's way while the old buffer has a slot taken;
    the next batch after every slot is free gets a larger buffer, and the main process drops
    the old one."""
    mod = _fresh_worker_slots
    main = mod.Slots(pin=False)
    first, _ = main.resolve(_received(mod.collate_into(_rows(1), k=3, rows=None)))
    old = mod.worker_slots()
    assert mod.collate_into(_rows(8), k=3, rows=None) is None  # slot 0 still viewed: no growth
    assert mod.worker_slots() is old and old.wanted > old.slot_bytes
    del first  # the last view goes: the old buffer is idle
    gc.collect()
    # a small batch at the safe point: the buffer grows anyway, for the big batches to come
    small, _ = main.resolve(_received(mod.collate_into(_rows(1, 5), k=3, rows=None)))
    new = mod.worker_slots()
    assert new is not old and new.slot_bytes >= 8 * 64 * 4 and new.grown == 1
    assert list(main.buffers) == [new.token]  # the old buffer was dropped
    big, _ = main.resolve(_received(mod.collate_into(_rows(8, 10), k=3, rows=None)))
    assert torch.equal(big, torch.stack(_rows(8, 10))) and torch.equal(small[0], _rows(1, 5)[0])
    assert mod.worker_slots() is new


def test_slots_growth_is_bounded(_fresh_worker_slots: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _fresh_worker_slots
    assert mod.MAX_GROWTHS == 8  # docs/concepts/workers.md says so
    monkeypatch.setattr(mod, "MAX_GROWTHS", 1)
    main = mod.Slots(pin=False)
    for n in (1, 4, 16, 16):
        ref = mod.collate_into(_rows(n), k=2, rows=None)
        if n < 16:
            batch, _ = main.resolve(_received(ref))
            del batch
            gc.collect()
        else:  # one growth (to 4 rows) was allowed: 16 rows go torch's way, every time
            assert ref is None
    assert mod.worker_slots().grown == 1


class _Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256,), float(i))


def test_custom_batch_sampler_with_a_small_first_batch_uses_slots(
    _fresh_worker_slots: Any,
) -> None:
    """The first batch has 1 row, every later one 8: later batches use slots after growing."""
    batches = [[0], *[list(range(1 + 8 * b, 9 + 8 * b)) for b in range(30)]]
    loader = feedpipe.DataLoader(_Rows(), batch_sampler=batches, num_workers=1)
    for want, got in zip(batches, loader, strict=True):
        assert got[:, 0].tolist() == [float(i) for i in want]
        del got
    info = loader.worker_slots
    assert info is not None
    # torch's prefetch lets a few large batches start before the first one's view is gone
    assert info["batches_fallback"] <= 4, info
    assert info["batches_in_slots"] == len(batches) - info["batches_fallback"]


# ------------------------------------------------------------------ 8: restore under retention


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

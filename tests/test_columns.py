"""Typed columns (issue 19, point 2): str/json/ragged fields and the ragged and fieldless
layouts, hostile offsets, the transform hooks, `feedpipe convert` of dicts, strings and token
lists, and shards that do not depend on the worker count."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import feedpipe
from feedpipe import DataLoader, DistributedSampler, MemmapDataset, MemmapWriter, convert
from feedpipe.errors import DatasetError
from feedpipe.io.crc import crc32c, to_hex
from feedpipe.testing import DatasetContractTests, assert_batches_equal

N = 29


def _docs(n: int = N, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(0, 9))
        out.append(
            {
                "tokens": rng.integers(-5, 1000, k).astype(np.int32),
                "boxes": rng.standard_normal((k % 4, 2)).astype(np.float32),
                "text": "é" * k + f"-{i}",
                "meta": {"i": i, "tags": ["x"] * (k % 3), "w": None if k % 2 else 0.5},
                "label": i * 3,
            }
        )
    return out


SPEC = {
    "tokens": ("int32", (None,)),
    "boxes": ("float32", (None, 2)),
    "text": "str",
    "meta": "json",
    "label": "int64",
}


def _write(path: Path, docs: list[dict[str, Any]], shard_bytes: int = 120) -> Path:
    with MemmapWriter(
        path, shape=(None,), dtype="int16", fields=SPEC, shard_bytes=shard_bytes
    ) as w:
        for i, d in enumerate(docs):
            w.append(np.arange(i % 5, dtype=np.int16), **d)
    return path


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    docs = _docs()
    return _write(tmp_path_factory.mktemp("typed") / "ds", docs), docs


def test_samples_read_back_as_written(typed: tuple[Path, list[dict[str, Any]]]) -> None:
    path, docs = typed
    ds = MemmapDataset(path)
    assert len(ds.index.shards) > 3
    assert json.loads((path / "index.json").read_text())["version"] == 2
    for i, d in enumerate(docs):
        s = ds[i]
        assert torch.equal(s["data"], torch.arange(i % 5, dtype=torch.int16))
        assert torch.equal(s["tokens"], torch.from_numpy(d["tokens"]))
        assert torch.equal(s["boxes"], torch.from_numpy(d["boxes"]))
        assert s["text"] == d["text"] and s["meta"] == d["meta"] and int(s["label"]) == i * 3


def test_batches_are_padded_with_lengths(typed: tuple[Path, list[dict[str, Any]]]) -> None:
    path, docs = typed
    ds = MemmapDataset(path, pad_value=-7)
    idx = [28, 3, 3, 0, 17, 9]
    b = ds.read_batch(np.array(idx))
    assert list(b) == [
        "data", "data_lengths", "tokens", "tokens_lengths", "boxes", "boxes_lengths",
        "text", "meta", "label",
    ]  # fmt: skip
    width = max(len(docs[i]["tokens"]) for i in idx)
    assert b["tokens"].shape == (len(idx), width) and b["boxes"].shape[2] == 2
    for j, i in enumerate(idx):
        k = len(docs[i]["tokens"])
        assert int(b["tokens_lengths"][j]) == k
        assert torch.equal(b["tokens"][j, :k], torch.from_numpy(docs[i]["tokens"]))
        assert (b["tokens"][j, k:] == -7).all()
        nb = len(docs[i]["boxes"])
        assert torch.equal(b["boxes"][j, :nb], torch.from_numpy(docs[i]["boxes"]))
        assert (b["boxes"][j, nb:] == -7).all() and int(b["boxes_lengths"][j]) == nb
        assert b["text"][j] == docs[i]["text"] and b["meta"][j] == docs[i]["meta"]
        assert int(b["data_lengths"][j]) == i % 5
    assert torch.equal(b["label"], torch.tensor(idx) * 3)


def test_nested_mode_gives_jagged_tensors(typed: tuple[Path, list[dict[str, Any]]]) -> None:
    path, docs = typed
    ds = MemmapDataset(path, ragged="nested")
    idx = [4, 1, 20]
    b = ds.read_batch(idx)
    assert "tokens_lengths" not in b and b["tokens"].is_nested
    assert b["tokens"].layout == torch.jagged
    for j, t in enumerate(b["tokens"].unbind()):
        assert torch.equal(t, torch.from_numpy(docs[idx[j]]["tokens"]))
    for j, t in enumerate(b["boxes"].unbind()):
        assert torch.equal(t, torch.from_numpy(docs[idx[j]]["boxes"]))
    assert ds.read_batch([])["tokens"].shape[0] == 0  # an empty batch is a 0-row nested tensor
    with pytest.raises(ValueError, match="ragged"):
        MemmapDataset(path, ragged="list-please")
    with pytest.raises(ValueError, match="pad_value"):
        MemmapDataset(path, pad_value=1.5)


def test_one_gather_per_column_per_shard(
    typed: tuple[Path, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of one shard costs one gather per variable-length column, never one per sample."""
    from feedpipe.datasets import columns

    path, _ = typed
    ds = MemmapDataset(path)
    calls: list[int] = []
    real = columns.gather
    monkeypatch.setattr(columns, "gather", lambda *a: (calls.append(len(a[1])), real(*a))[1])
    shard0 = ds.index.shards[0].records
    ds.read_batch(list(range(shard0))[::-1] * 2)
    assert calls == [2 * shard0] * 5  # data, tokens, boxes, text, meta


class TestTypedContract(DatasetContractTests):
    """The shipped contract suite, with the documented batch of ragged columns: padded with
    lengths, strings and JSON values as lists; `out` is not used for ragged columns."""

    def make_dataset(self, tmp_path: Path) -> Any:
        return MemmapDataset(_write(tmp_path / "ds", _docs(12, seed=3), shard_bytes=90))

    def expected_batch(self, samples: list[Any]) -> Any:
        out: dict[str, Any] = {}
        for key in samples[0]:
            values = [s[key] for s in samples]
            if isinstance(values[0], (str, dict)):
                out[key] = values
            elif key == "label":
                out[key] = torch.stack(values)
            else:
                out[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
                out[f"{key}_lengths"] = torch.tensor([len(v) for v in values])
        return out

    def make_out(self, dataset: Any, indices: list[int], batch: Any) -> Any:
        return None  # padded widths vary per batch: the ring passes no out

    def test_empty_indices(self, dataset: Any) -> None:
        b = dataset.read_batch([])
        assert b["tokens"].shape == (0, 0) and b["boxes"].shape == (0, 0, 2)
        assert b["text"] == [] and b["label"].shape == (0,)


def test_fieldless_layout_records_false(tmp_path: Path) -> None:
    with MemmapWriter(tmp_path / "d", records=False, fields={"text": "str", "n": "int32"}) as w:
        w.append(text="a", n=1)
        w.append_batch(text=["bb", "ccc"], n=[2, 3])
    ds = MemmapDataset(tmp_path / "d")
    assert ds[1] == {"text": "bb", "n": torch.tensor(2, dtype=torch.int32)}
    assert ds.read_batch([2, 0])["text"] == ["ccc", "a"]
    assert "data" not in ds.read_batch([0]) and ds.dma_blocker() is not None
    with pytest.raises(DatasetError, match="takes no record"):
        MemmapWriter(tmp_path / "e", records=False, fields={"t": "str"}).append(b"x", t="y")


# ---------------------------------------------------------------------- writer refusals
@pytest.mark.parametrize(
    ("spec", "value", "match"),
    [
        ("str", b"bytes", r"record 1: field 'f'.*expected str"),
        ("str", "\ud800", r"record 1: field 'f'.*UTF-8"),
        ("json", (1, 2), r"record 1: field 'f'.*tuple.*pass a list"),
        ("json", {1: "a"}, r"record 1: field 'f'.*keys must be str"),
        ("json", [float("nan")], r"record 1: field 'f'.*nan"),
        ("json", {"s": {1, 2}}, r"record 1: field 'f'.*set"),
        ("json", np.int64(3), r"record 1: field 'f'.*int64.*item"),
        (("int8", (None,)), [1, 300], r"record 1: field 'f'.*do not fit"),
        (("int32", (None,)), np.ones(3, np.float32), r"record 1: field 'f'.*dtype int32"),
        (
            ("int32", (None,)),
            np.ones((2, 2), np.int32),
            r"record 1: field 'f'.*shape \(n,\) with any n, got \(2, 2\)",
        ),
        (("int32", (None, 3)), np.ones((2, 2), np.int32), r"record 1: field 'f'.*\(n, 3\)"),
        (("int32", (None,)), "text", r"record 1: field 'f'.*expected an array"),
    ],
)
def test_writer_refuses_values_by_record_and_field(
    tmp_path: Path, spec: Any, value: Any, match: str
) -> None:
    good: Any = {"str": "ok", "json": {"a": 1}}.get(spec) if isinstance(spec, str) else None
    if good is None:
        good = np.zeros((1, *spec[1][1:]), spec[0])
    w = MemmapWriter(tmp_path / "w", records=False, fields={"f": spec})
    w.append(f=good)
    with pytest.raises(DatasetError, match=match):
        w.append(f=value)
    w.abort()
    assert not (tmp_path / "w" / "index.json").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": None, "fields": {"offsets": "int64"}}, "offsets"),  # overwrote the offsets
        ({"shape": (None,), "fields": {"data_lengths": "int64"}}, "data_lengths"),
        ({"shape": (2,), "fields": {"t": ("int32", (None,)), "t_lengths": "int8"}}, "t_lengths"),
        ({"records": False}, "at least one field"),
        ({"shape": (None,), "dtype": "U3"}, "U3"),
        ({"shape": None, "fields": {"t": ("int32", (None, -1))}}, "negative"),
        # issue 25 item 15: zero-byte rows or records could never be read back
        ({"records": False, "fields": {"e": ("float32", (None, 0))}}, r"field 'e'.*\(None, 0\)"),
        ({"shape": (2,), "fields": {"e": ("int8", (None, 3, 0))}}, r"field 'e'.*zero bytes"),
        ({"shape": (None, 0), "dtype": "float32"}, r"records: shape \(None, 0\).*zero bytes"),
        ({"shape": (0,), "dtype": "float32"}, r"records: shape \(0,\).*zero bytes"),
        ({"records": False, "fields": {"e": ("int64", (0,))}}, r"field 'e'.*zero bytes"),
    ],
)
def test_writer_refuses_clashing_or_bad_columns(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(DatasetError, match=match):
        MemmapWriter(tmp_path / "w", **kwargs)
    assert not (tmp_path / "w").exists()


def test_zero_width_columns_are_refused_by_convert_and_on_open(tmp_path: Path) -> None:
    """Every path into the format refuses a zero-width ragged column by name: convert of
    dicts, and an index that lists one (written by hand or by an older feedpipe)."""

    class Rows(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"e": np.zeros((i % 3, 0), np.float32), "y": i}

    with pytest.raises(DatasetError, match=r"part-00000: field 'e': shape .*zero bytes"):
        convert(Rows(), tmp_path / "o", workers=1)
    assert not (tmp_path / "o").exists()
    path = _write(tmp_path / "ds", _docs(4))
    doc = json.loads((path / "index.json").read_text())
    doc["fields"]["boxes"]["shape"] = [None, 0]
    (path / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match=r"index\.json.*field 'boxes'.*zero bytes"):
        MemmapDataset(path)


# ---------------------------------------------------------------------- hostile files
def _small(tmp_path: Path) -> Path:
    with MemmapWriter(tmp_path / "h", records=False, fields={"t": ("int32", (None,))}) as w:
        for k in (3, 0, 2, 4):
            w.append(t=np.arange(k, dtype=np.int32))
    return tmp_path / "h"


def _rewrite(root: Path, rel: str, data: bytes, fix_size: bool = True) -> None:
    """Replace a shard file and list it in index.json with a valid CRC (a hostile writer)."""
    (root / rel).write_bytes(data)
    doc = json.loads((root / "index.json").read_text())
    for info in doc["shards"][0]["files"].values():
        if info["path"] == rel:
            info["crc32c"] = to_hex(crc32c(data))
            if fix_size:
                info["bytes"] = len(data)
    (root / "index.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([0, 12, 8, 20, 36], r"shard-00000\.t\.offsets: record 1 has a negative length"),
        (
            [0, 12, 12, 20, 40],
            r"shard-00000\.t\.offsets: record 3 ends beyond the data file \(40 > 36",
        ),
        ([4, 12, 12, 20, 36], r"shard-00000\.t\.offsets: record 0 starts at byte 4"),
        (
            [0, 12, 12, 22, 36],
            r"shard-00000\.t\.offsets: record 3 .*byte 22, not a multiple of its 4",
        ),
        ([0, 12, 12, 20, 32], r"shard-00000\.t\.offsets: the last record ends at byte 32"),
        ([0, 2**64 - 8, 12, 20, 36], r"record 0 ends beyond the data file"),
    ],
)
def test_hostile_offsets_name_file_and_record(
    tmp_path: Path, offsets: list[int], match: str
) -> None:
    root = _small(tmp_path)
    _rewrite(root, "shard-00000.t.offsets", np.array(offsets, "<u8").tobytes())
    ds = MemmapDataset(root, verify=True)  # valid CRCs: only the offsets check can catch it
    with pytest.raises(DatasetError, match=match):
        ds.read_batch([3])


def test_hostile_index_lists_offsets_of_the_wrong_length(tmp_path: Path) -> None:
    root = _small(tmp_path)
    _rewrite(root, "shard-00000.t.offsets", np.zeros(4, "<u8").tobytes())
    with pytest.raises(DatasetError, match=r"index\.json: shard 0 file 'shard-00000\.t\.offsets'"):
        MemmapDataset(root)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(version=1), "version 1 index uses typed columns"),
        (lambda d: d.update(version=3), "unsupported index version 3"),
        (lambda d: d["fields"]["t"].update(shape=[3]), "ragged shape must start with null"),
        (lambda d: d["fields"]["t"].update(kind="blob"), "unknown kind 'blob'"),
        (lambda d: d["fields"].update(t_lengths={"dtype": "int8", "shape": []}), "t_lengths"),
        (lambda d: d["shards"][0]["files"].pop("field.t.offsets"), "field.t.offsets"),
        (lambda d: d["shards"][0]["files"]["field.t"].update(bytes=37), "4-byte rows"),
    ],
)
def test_hostile_index_json_is_refused(tmp_path: Path, change: Any, match: str) -> None:
    root = _small(tmp_path)
    doc = json.loads((root / "index.json").read_text())
    change(doc)
    (root / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match=match):
        MemmapDataset(root)


@pytest.mark.parametrize(
    ("kind", "data", "match"),
    [
        ("str", b"ab\xff\xfe", r"shard-00000\.f: record 1 \(shard 0\): str column 'f'"),
        ("json", b"[1]{2:", r"shard-00000\.f: record 1 \(shard 0\): json column 'f'"),
    ],
)
def test_undecodable_str_and_json_name_file_and_record(
    tmp_path: Path, kind: str, data: bytes, match: str
) -> None:
    with MemmapWriter(tmp_path / "s", records=False, fields={"f": kind}) as w:
        w.append_batch(f=["ab", "cd"] if kind == "str" else [[1], [2]])
    _rewrite(tmp_path / "s", "shard-00000.f", data)
    ds = MemmapDataset(tmp_path / "s", verify=True)
    ds[0]
    with pytest.raises(DatasetError, match=match):
        ds.read_batch([0, 1])


# ---------------------------------------------------------------------- transforms
def _image_folder(root: Path) -> dict[str, np.ndarray]:
    from PIL import Image

    rng = np.random.default_rng(5)
    pixels = {}
    for c, fmt in enumerate(("png", "jpeg")):
        (root / f"class{c}").mkdir(parents=True)
        for k in range(5):
            arr = rng.integers(0, 256, (8 + k, 6, 3), dtype=np.uint8)
            name = root / f"class{c}" / f"{k}.{'png' if fmt == 'png' else 'jpg'}"
            Image.fromarray(arr).save(name, format=fmt.upper())
            pixels[str(name)] = np.asarray(Image.open(name).convert("RGB"))
    return pixels


def _decode(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from PIL import Image

    img = Image.open(io.BytesIO(sample["data"].numpy().tobytes())).convert("RGB")
    arr = np.asarray(img)[:8]  # crop to one size so a batch stacks
    return {"image": torch.from_numpy(arr.copy()).permute(2, 0, 1), "label": sample["label"]}


def _flip(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**batch, "image": batch["image"].flip(-1), "flipped": torch.ones(len(batch["label"]))}


def test_imagefolder_conversion_decodes_with_a_transform(tmp_path: Path) -> None:
    pixels = _image_folder(tmp_path / "imgs")
    convert(tmp_path / "imgs", tmp_path / "ds", workers=1, shard_bytes=600)
    files = sorted(pixels)
    want = {i: torch.from_numpy(pixels[f][:8].copy()).permute(2, 0, 1) for i, f in enumerate(files)}
    ds = MemmapDataset(tmp_path / "ds", transform=_decode)
    assert torch.equal(ds[7]["image"], want[7]) and int(ds[7]["label"]) == 1
    for worker_type, workers in (("thread", 2), ("process", 2)):
        loader = DataLoader(ds, batch_size=4, num_workers=workers, worker_type=worker_type)
        batches = list(loader)
        images = torch.cat([b["image"] for b in batches])
        assert torch.equal(images, torch.stack([want[i] for i in range(10)])), worker_type
        assert torch.cat([b["label"] for b in batches]).tolist() == [0] * 5 + [1] * 5
    both = MemmapDataset(tmp_path / "ds", transform=_decode, batch_transform=_flip)
    b = both.read_batch([2, 7])
    assert torch.equal(b["image"], torch.stack([want[2], want[7]]).flip(-1))
    assert b["flipped"].tolist() == [1.0, 1.0]
    assert "flipped" not in both[2]  # batch_transform is for batches only
    assert both.read_batch([])["image"].shape == (0, 3, 8, 6)


def test_transform_keeps_one_gather_per_batch(tmp_path: Path) -> None:
    class Counting(MemmapDataset):
        reads = 0

        def _read(self, idx: np.ndarray, out: Any, mode: str) -> Any:
            type(self).reads += 1
            return super()._read(idx, out, mode)

    _write(tmp_path / "ds", _docs(10))
    seen: list[int] = []
    ds = Counting(tmp_path / "ds", transform=lambda s: len(s["text"]), batch_transform=seen.append)
    ds.read_batch(list(range(10)))
    assert Counting.reads == 1 and seen and seen[0].tolist() == [len(d["text"]) for d in _docs(10)]
    with pytest.raises(TypeError, match="transform must be callable"):
        MemmapDataset(tmp_path / "ds", transform="decode")


def _unnested(batch: Any) -> Any:
    """``batch`` with each jagged nested tensor as the list of its rows (to compare)."""
    if isinstance(batch, torch.Tensor) and batch.is_nested:
        return list(batch.unbind())
    if isinstance(batch, dict):
        return {k: _unnested(v) for k, v in batch.items()}
    return batch


def _shape(v: Any) -> Any:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else type(v)


def _cut(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "tokens": sample["tokens"][:3], "boxes": sample["boxes"] * 2}


@pytest.mark.parametrize("mode", ["pad", "nested"])
def test_ragged_columns_batch_through_a_transform(
    typed: tuple[Path, list[dict[str, Any]]], mode: str
) -> None:
    """Issue 25 item 13: with ``transform=``, ragged columns are batched as ``ragged=`` batches
    them without one (padded with ``NAME_lengths``, or nested), on every worker type, where
    torch's default_collate refuses records of different lengths."""
    path, _ = typed
    plain = MemmapDataset(path, ragged=mode, pad_value=-7)
    same = MemmapDataset(path, ragged=mode, pad_value=-7, transform=lambda s: s)
    idx = [28, 3, 3, 0, 17, 9, 21]
    assert_batches_equal(_unnested(same.read_batch(idx)), _unnested(plain.read_batch(idx)))
    none, want_none = same.read_batch([]), plain.read_batch([])
    assert list(none) == list(want_none)
    for k, v in want_none.items():
        assert len(none[k]) == len(v) == 0 and (mode == "nested" or _shape(none[k]) == _shape(v))
    cut = MemmapDataset(path, ragged=mode, pad_value=-7, transform=_cut)
    sampler = feedpipe.DistributedSampler(cut, num_replicas=1, rank=0, shuffle=True, seed=3)
    order = list(sampler)
    for worker_type in ("thread", "process"):
        loader = DataLoader(
            cut, batch_size=6, sampler=sampler, num_workers=2, worker_type=worker_type
        )
        for b, batch in enumerate(loader):
            rows = order[6 * b : 6 * b + 6]
            want = [_cut(plain[i]) for i in rows]
            got = _unnested(batch)
            for j, s in enumerate(want):
                k = len(s["tokens"])
                tokens = got["tokens"][j]
                assert torch.equal(tokens[:k], s["tokens"]), (worker_type, b, j)
                assert torch.equal(got["boxes"][j][: len(s["boxes"])], s["boxes"])
                if mode == "pad":
                    assert int(got["tokens_lengths"][j]) == k and (tokens[k:] == -7).all()
                assert got["text"][j] == s["text"] and int(got["label"][j]) == int(s["label"])
            if mode == "pad":
                width = max(len(s["tokens"]) for s in want)
                assert got["tokens"].shape == (len(rows), width)
        assert b == (len(order) - 1) // 6, worker_type


def test_ragged_records_without_fields_batch_through_a_transform(tmp_path: Path) -> None:
    """A ragged-layout dataset's samples are tensors: its batch is ``data`` + ``data_lengths``
    (``pad``) or one nested tensor, with a transform as without one."""
    with MemmapWriter(tmp_path / "r", shape=(None, 2), dtype="float32") as w:
        for i in range(9):
            w.append(np.full((i % 4, 2), i, np.float32))
    for mode in ("pad", "nested"):
        plain = MemmapDataset(tmp_path / "r", ragged=mode)
        doubled = MemmapDataset(tmp_path / "r", ragged=mode, transform=lambda t: t * 2)
        idx = [3, 0, 8, 6]
        want = plain.read_batch(idx)
        got = doubled.read_batch(idx)
        if mode == "pad":
            assert_batches_equal(
                got, {"data": want["data"] * 2, "data_lengths": want["data_lengths"]}
            )
        else:
            assert all(
                torch.equal(g, 2 * w) for g, w in zip(got.unbind(), want.unbind(), strict=True)
            )


# ---------------------------------------------------------------------- resume
def test_exact_and_elastic_resume_over_typed_columns(
    typed: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Loader + DistributedSampler state over a typed dataset (as tests/test_sampler_loader.py):
    the same world resumes batch for batch; 3 ranks stopped and 2 ranks finish the epoch
    with every record delivered exactly once."""
    path, _ = typed
    ds = MemmapDataset(path)

    def loader(world: int, rank: int) -> DataLoader:
        s = DistributedSampler(ds, world, rank, seed=3, batch_size=2, pad=False)
        lo = DataLoader(ds, batch_size=2, sampler=s, num_workers=2, worker_type="thread")
        lo.sampler.set_epoch(1)
        return lo

    taken: list[int] = []
    states = []
    for rank in range(3):
        lo = loader(3, rank)
        full = list(loader(3, rank))
        it = iter(lo)
        first = [next(it) for _ in range(2)]
        taken += [i for b in first for i in b["label"].tolist()]
        states.append(json.loads(json.dumps(lo.state_dict())))
        del it
        again = loader(3, rank)
        again.load_state_dict(states[-1])
        again.sampler.set_epoch(1)
        rest_batches = list(again)
        assert len(first) + len(rest_batches) == len(full)
        for k, (g, w) in enumerate(zip(first + rest_batches, full, strict=True)):
            assert_batches_equal(g, w, f"rank {rank} batch {k}")
    rest: list[int] = []
    for rank in range(2):
        lo = loader(2, rank)
        lo.load_state_dict(states[-1])  # the last rank's state resumes everyone
        lo.sampler.set_epoch(1)
        rest += [i for b in lo for i in b["label"].tolist()]
    assert sorted(taken + rest) == [3 * i for i in range(N)]


# ---------------------------------------------------------------------- convert
class _Dicts(torch.utils.data.Dataset[Any]):
    def __init__(self, bad: int = -1, value: Any = None) -> None:
        self.bad, self.value = bad, value

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = {
            "tokens": list(range(i % 6)),
            "text": f"doc {i} ü",
            "meta": {"i": i, "tags": ["a"] * (i % 3)},
            "score": float(i),
            "raw": bytes([i]) * (i % 4),
        }
        if i == self.bad:
            sample["text"] = self.value
        return sample


def test_convert_stores_dicts_strings_and_token_lists(tmp_path: Path) -> None:
    res = feedpipe.convert(_Dicts(), tmp_path / "o", workers=2, shard_bytes=256)
    ds = MemmapDataset(tmp_path / "o", verify=True)
    assert res.records == 40 and ds.kind == "none"
    for i in (0, 5, 39):
        s, want = ds[i], _Dicts()[i]
        assert s["tokens"].tolist() == want["tokens"] and s["tokens"].dtype == torch.int64
        assert s["text"] == want["text"] and s["meta"] == want["meta"]
        assert float(s["score"]) == want["score"] and s["raw"].numpy().tobytes() == want["raw"]
    assert feedpipe.TokenWindows(ds, block_size=4).read_batch([0]).tolist() == [[0, 0, 1, 0]]


@pytest.mark.parametrize(
    ("bad", "value", "match"),
    [
        (0, {1, 2}, r"record 0: field 'text': cannot store a set"),
        (0, None, r"record 0: field 'text': cannot store a NoneType"),
        (13, 5, r"record 13: field 'text'.*expected str, got ndarray"),
        (13, "\udcff", r"record 13: field 'text'.*UTF-8"),
    ],
)
def test_convert_refuses_what_it_cannot_store(
    tmp_path: Path, bad: int, value: Any, match: str
) -> None:
    with pytest.raises(DatasetError, match=match):
        convert(_Dicts(bad, value), tmp_path / "o", workers=1, shard_bytes=256)
    assert not (tmp_path / "o").exists()
    if bad == 0:  # refused up front: nothing was written at all
        assert not (tmp_path / "o.partial").exists()


def test_convert_refuses_bad_keys_and_missing_fields(tmp_path: Path) -> None:
    class Keys(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict[Any, Any]:
            return {"a": 1, "b": 2} if i != 2 else {"a": 1}

    with pytest.raises(DatasetError, match=r"record 2: fields \['a'\], record 0 had \['a', 'b'\]"):
        convert(Keys(), tmp_path / "o", workers=1)

    class BadKey(Keys):
        def __getitem__(self, i: int) -> dict[Any, Any]:
            return {"a b": 1}

    with pytest.raises(DatasetError, match=r"record 0: key 'a b' cannot name a field"):
        convert(BadKey(), tmp_path / "p", workers=1)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("source", ["npy", "dicts"])
def test_workers_change_speed_never_the_output(tmp_path: Path, source: str) -> None:
    """Before: the part count was max(shards, 2 * workers), so the shard layout followed the
    machine's CPU count. Now workers=1 and workers=3 give byte-identical datasets."""
    if source == "npy":
        np.save(tmp_path / "x.npy", np.arange(4000, dtype=np.int32).reshape(1000, 4))
        src: Any = tmp_path / "x.npy"
        shard = 4096
    else:
        src, shard = _Dicts(), 300
    convert(src, tmp_path / "w1", workers=1, shard_bytes=shard)
    convert(src, tmp_path / "w3", workers=3, shard_bytes=shard)
    one, three = _tree(tmp_path / "w1"), _tree(tmp_path / "w3")
    assert one == three and "index.json" in one
    assert len(json.loads(one["index.json"])["shards"]) > 1
    if source == "npy":  # fixed records: every shard but the last holds exactly shard_bytes
        sizes = [s["files"]["data"]["bytes"] for s in json.loads(one["index.json"])["shards"]]
        assert sizes[:-1] == [shard] * (len(sizes) - 1)


def test_readback_through_the_loader_matches(typed: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _ = typed
    ds = MemmapDataset(path)
    got = list(DataLoader(ds, batch_size=5, num_workers=2, worker_type="thread"))
    for b, batch in enumerate(got):
        assert_batches_equal(batch, ds.read_batch(list(range(5 * b, min(N, 5 * b + 5)))))


def run_guide(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run a guide's ``python`` blocks in order, in one module namespace, inside ``tmp_path``."""
    import re
    import sys
    import types

    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, page
    monkeypatch.chdir(tmp_path)
    name = "guide_" + re.sub(r"\W", "_", page)
    module = types.ModuleType(name)  # classes defined by the guide pickle by reference
    monkeypatch.setitem(sys.modules, name, module)
    for block in blocks:
        exec(compile(block, page, "exec"), module.__dict__)
    return module.__dict__


def test_guide_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = run_guide("typed-columns.md", tmp_path, monkeypatch)
    padded = ns["padded"]
    assert padded["tokens"].tolist() == [[4, 4, 8, 1, 3], [5, 17, 2, 0, 0], [9, 0, 0, 0, 0]]
    assert padded["tokens_lengths"].tolist() == [5, 3, 1]
    assert padded["text"] == ["un chat", "a cat", "ein Hund"]
    assert [t.tolist() for t in ns["nested"].unbind()] == [[4, 4, 8, 1, 3], [5, 17, 2], [9]]
    assert ns["ds"][0]["image"].shape == (3, 32, 32)
    assert ns["MemmapDataset"]("tokenized")[7]["url"] == "https://example.com/7"


def test_a_json_number_out_of_float_range_is_refused_on_read_as_on_write(tmp_path: Path) -> None:
    """Issue 25 item 10: ``1e999`` read back as ``inf``, which the writer refuses to store."""
    with MemmapWriter(tmp_path / "j", records=False, fields={"m": "json"}) as w:
        w.append(m={"x": 1.0})
        w.append(m={"x": 1e300})
    with pytest.raises(DatasetError, match=r"record 0: field 'm': inf cannot be stored"):
        MemmapWriter(tmp_path / "w", records=False, fields={"m": "json"}).append(m=float("inf"))
    root = tmp_path / "j"
    (rel,) = [p.name for p in root.iterdir() if b"1e+300" in p.read_bytes()]
    _rewrite(root, rel, (root / rel).read_bytes().replace(b"1e+300", b"1e+999"))
    ds = MemmapDataset(root)
    assert ds[0]["m"] == {"x": 1.0}
    with pytest.raises(DatasetError, match=rf"{rel}.*record 1.*'m'.*1e\+999 is out of a float"):
        ds[1]


def test_layout_and_field_share_one_column_type() -> None:
    """``Layout`` and ``FieldSpec`` are one column type (shared sizes and JSON), not two copies."""
    from feedpipe.format import FieldSpec, Layout

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
    from feedpipe.format import FieldSpec, Layout, _parse_fields, _parse_layout

    cls = Layout if spec[0] == "L" else FieldSpec
    col = cls(*spec[1:])  # type: ignore[arg-type]
    assert list(col.to_json().items()) == list(doc.items())
    assert (col.record_bytes, col.row_bytes) == (record, row)
    back = _parse_layout(doc) if cls is Layout else _parse_fields({"f": doc})["f"]
    assert back == col

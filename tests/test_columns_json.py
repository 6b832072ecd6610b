"""JSON typed columns: values that cannot be encoded name the record and the field, and what the
writer never stores (``NaN``, ``Infinity``, nesting too deep) is refused on read as well."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feedpipe import DatasetError, MemmapDataset, MemmapWriter
from feedpipe.io.crc import crc32c, to_hex


# ------------------------------------------------------------------------------ typed columns
@pytest.mark.parametrize(
    ("value", "match"),
    [
        (10**5000, "cannot be stored as JSON.*digits"),
        ({"k": ["a\ud800"]}, "cannot be stored as JSON.*surrogates"),
    ],
    ids=["huge-int", "lone-surrogate"],
)
def test_json_values_that_cannot_be_encoded_name_record_and_field(
    tmp_path: Path, value: Any, match: str
) -> None:
    """Found: a huge int and a lone surrogate inside a JSON value escaped the writer as a bare
    ValueError / UnicodeEncodeError naming neither record nor field."""
    with MemmapWriter(tmp_path / "j", records=False, fields={"j": "json"}) as w:
        w.append(j={"ok": 1})
        with pytest.raises(DatasetError, match=rf"record 1: field 'j': {match}"):
            w.append(j=value)
        w.append(j=[2])
    assert MemmapDataset(tmp_path / "j").read_batch([0, 1])["j"] == [{"ok": 1}, [2]]


@pytest.mark.parametrize(
    "text",
    [b"NaN", b"[1,-Infinity]", b'{"a":Infinity}', b"[" * 100_000 + b"]" * 100_000],
    ids=["nan", "-inf", "inf", "deep"],
)
def test_json_constants_the_writer_refuses_are_refused_on_read(tmp_path: Path, text: bytes) -> None:
    """Found: a hostile data file (valid CRC) holding ``NaN``/``Infinity`` read back as floats,
    values the writer never stores (JSON has no such constants). Guard: JSON nested 100,000
    deep (the writer stops at 100) is an error naming the record, not a crash."""
    root = tmp_path / "j"
    with MemmapWriter(root, records=False, fields={"j": "json"}) as w:
        w.append(j=[1])
        w.append(j=2)
    data = b"[1]" + text
    (root / "shard-00000.j").write_bytes(data)
    (root / "shard-00000.j.offsets").write_bytes(np.array([0, 3, len(data)], "<u8").tobytes())
    doc = json.loads((root / "index.json").read_text())
    for info in doc["shards"][0]["files"].values():
        raw = (root / info["path"]).read_bytes()
        info["bytes"], info["crc32c"] = len(raw), to_hex(crc32c(raw))
    (root / "index.json").write_text(json.dumps(doc))
    ds = MemmapDataset(root, verify=True)
    assert ds[0]["j"] == [1]
    with pytest.raises(DatasetError, match=r"shard-00000\.j: record 1 \(shard 0\): json"):
        ds.read_batch([0, 1])

"""``ZarrDataset(preadv=)`` is the name of the byte-range read path; ``direct=`` is its
deprecated alias (issue 17, rule 7: "direct" names only the GPU feed's direct path)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

zarr = pytest.importorskip("zarr")

from feedpipe import ZarrDataset  # noqa: E402


@pytest.fixture
def array(tmp_path: Path) -> tuple[Path, np.ndarray]:
    x = np.arange(60, dtype=np.int32).reshape(20, 3)
    arr = zarr.create_array(tmp_path / "a", shape=x.shape, chunks=(4, 3), dtype="int32",
                            compressors=None)  # fmt: skip
    arr[:] = x
    return tmp_path / "a", x


def test_preadv_keyword_picks_the_path_without_a_warning(array: tuple[Path, np.ndarray]) -> None:
    path, x = array
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on, off = ZarrDataset(path), ZarrDataset(path, preadv=False)
    assert "" in on._preadv and not off._preadv
    idx = [19, 0, 7, 7]
    for ds in (on, off):
        assert torch.equal(ds.read_batch(idx), torch.from_numpy(x[idx]))
    # a worker gets the same path
    assert "" in pickle.loads(pickle.dumps(on))._preadv
    assert not pickle.loads(pickle.dumps(off))._preadv


@pytest.mark.parametrize("value", [True, False])
def test_direct_is_a_deprecated_alias(array: tuple[Path, np.ndarray], value: bool) -> None:
    path, x = array
    with pytest.warns(DeprecationWarning, match=r"direct=.*preadv=") as rec:
        old = ZarrDataset(path, direct=value)
    assert rec[0].filename == __file__  # points at the caller's line
    new = ZarrDataset(path, preadv=value)
    assert bool(old._preadv) is bool(new._preadv) is value
    assert torch.equal(old.read_batch([3, 1]), torch.from_numpy(x[[3, 1]]))


def test_both_names_at_once_is_an_error(array: tuple[Path, np.ndarray]) -> None:
    with pytest.raises(TypeError, match="preadv"):
        ZarrDataset(array[0], preadv=False, direct=True)

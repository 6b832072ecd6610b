"""The public surface: tidy ``__all__``, every exported name resolves, no eager heavy imports."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("pkg", ["feedpipe", "ckpt"])
def test_all_is_sorted_and_resolves(pkg: str) -> None:
    mod = importlib.import_module(pkg)
    assert sorted(mod.__all__) == mod.__all__
    assert set(mod.__all__) == {*mod._EXPORTS, "__version__"}
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_import_has_no_heavy_side_effects() -> None:
    code = (
        "import sys, feedpipe, ckpt; "
        "mods = ('torch', 'zarr', 'tensorstore', 's3fs', 'nvidia.dali'); "
        "heavy = [m for m in mods if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_mixed_dataset_is_public() -> None:
    import feedpipe

    assert "MixedDataset" in feedpipe.__all__
    assert feedpipe.MixedDataset.__module__ == "feedpipe.datasets.mixed"


def test_token_windows_is_public() -> None:
    import feedpipe

    assert "TokenWindows" in feedpipe.__all__
    assert feedpipe.TokenWindows.__module__ == "feedpipe.datasets.tokens"

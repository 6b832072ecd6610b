"""The old flat import paths (feedpipe._compat): each imports, warns once naming its new home,
and forwards every attribute; nothing else is answered by the finder."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.utils.data import default_collate

from feedpipe._compat import MOVED

NAMES = {
    "feedpipe.memmap": "MemmapDataset",
    "feedpipe.zarr_dataset": "ZarrDataset",
    "feedpipe.convert": "ConvertResult",
    "feedpipe.cache": "ShardCache",
    "feedpipe.stage": "StageResult",
    "feedpipe.gpu": "GPUFeed",
    "feedpipe.bench": "BenchResult",
    "feedpipe._crc": "crc32c",
    "feedpipe.datasets.format": "Index",
}


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_old_path_is_listed() -> None:
    assert set(NAMES) == set(MOVED)


@pytest.mark.parametrize("old", sorted(NAMES))
def test_an_old_path_imports_forwards_and_warns_once(old: str) -> None:
    home = MOVED[old][0]
    name = NAMES[old]
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    from {old} import {name} as a\n"
        f"    import {old}\n"
        f"    from {old} import {name} as b\n"
        f"from {home} import {name} as c\n"
        "assert a is b is c, (a, b, c)\n"
        "moved = [x for x in w if x.category.__name__ == 'FeedpipeMovedWarning']\n"
        "assert len(moved) == 1, [str(x.message) for x in w]\n"
        f"assert '{home}' in str(moved[0].message), moved[0].message\n"
        "assert moved[0].filename == '<string>', moved[0].filename  # points at the user's line\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("old", ["feedpipe.convert", "feedpipe.stage"])
def test_convert_and_stage_stay_callable_after_the_module_import(old: str) -> None:
    fn = MOVED[old][1]
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        f"import {old}\n"
        "import feedpipe\n"
        f"from {MOVED[old][0]} import {fn}\n"
        f"assert callable(feedpipe.{fn}), feedpipe.{fn}\n"
        "try:\n"
        f"    feedpipe.{fn}()\n"
        "except TypeError as e:\n"
        "    print('TypeError', e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "TypeError" in out.stdout and "missing" in out.stdout  # reached the real function


def test_the_finder_answers_only_for_the_old_paths() -> None:
    out = _run("import feedpipe.memmap_typo")
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr
    out = _run(
        "import feedpipe, sys; import json.decoder; print(type(sys.modules['json']).__name__)"
    )
    assert out.returncode == 0 and out.stdout.strip() == "module"


def test_no_shim_file_is_left_on_the_top_floor() -> None:
    from pathlib import Path

    import feedpipe

    top = Path(feedpipe.__file__).parent
    for old in MOVED:
        leaf = old.split(".", 1)[1]
        assert not (top / f"{leaf}.py").exists(), f"{leaf}.py: the old path is served by _compat"


# ------------------------------------------------------------------------------ layout move
def test_public_paths_after_the_layout_move() -> None:
    import pickle

    from feedpipe.gpu import GPUFeed, GPUFeedWarning, Prefetcher, map_tensors, resolve_device

    import feedpipe
    import feedpipe.loader
    from feedpipe.device.feed import GPUFeed as Moved
    from feedpipe.loader.fetch import TimedCollate

    assert GPUFeed is Moved and callable(map_tensors) and callable(resolve_device)
    assert issubclass(GPUFeedWarning, Warning) and Prefetcher is not None
    assert feedpipe.loader.DataLoader is feedpipe.DataLoader
    back = pickle.loads(pickle.dumps(TimedCollate(default_collate, None)))  # type: ignore[arg-type]
    assert type(back) is TimedCollate and back.collate_fn is default_collate


def test_old_paths_import_though_pkgutil_does_not_list_them() -> None:
    # decided: the old paths are deprecated aliases with no file, not submodules, so
    # pkgutil.iter_modules (which lists files) does not list them; each still imports
    import pkgutil

    import feedpipe

    listed = {m.name for m in pkgutil.iter_modules(feedpipe.__path__)}
    leaves = {old.split(".", 1)[1] for old in MOVED}
    assert not leaves & listed
    code = "import warnings; warnings.simplefilter('ignore')\n" + "".join(
        f"import {old}\n" for old in sorted(MOVED)
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr

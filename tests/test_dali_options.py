"""ImageLoader's two ways of saying the same thing: ``transform=``/``options=`` dataclasses, or
the flat keywords that alias their fields (issue 17)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("nvidia.dali")
pytest.importorskip("PIL.Image")

from test_dali import CROP, RESIZE, _jpeg
from test_dali_datasets import BytesDataset

from feedpipe.dali import ImageLoader, ImageLoaderOptions, Transform

pytestmark = pytest.mark.timeout(120)

FLAT = dict(
    train=False,
    crop=CROP,
    resize=RESIZE,
    mean=[0.5, 0.5, 0.5],  # a list: stored as a tuple either way
    std=(0.25, 0.25, 0.25),
    output_layout="NHWC",
    dtype="float16",
    device="cpu",
    num_threads=2,
    py_num_workers=1,
    py_start_method="fork",
    prefetch=3,
    hw_decoder_load=0.5,
    on_error="skip",
    timeout=60.0,
)


def _split(flat: dict[str, object]) -> tuple[Transform, ImageLoaderOptions]:
    t_names = {f.name for f in dataclasses.fields(Transform)}
    t = Transform(**{k: v for k, v in flat.items() if k in t_names})  # type: ignore[arg-type]
    o = ImageLoaderOptions(**{k: v for k, v in flat.items() if k not in t_names})  # type: ignore[arg-type]
    return t, o


def test_flat_keywords_and_dataclasses_give_the_same_config() -> None:
    ds = BytesDataset([_jpeg(0)])
    t, o = _split(FLAT)
    with ImageLoader(ds, 1, **FLAT) as flat, ImageLoader(ds, 1, transform=t, options=o) as typed:
        assert flat.transform == typed.transform == t
        assert flat.options == typed.options == o
        assert flat.transform.mean == (0.5, 0.5, 0.5)
        for loader in (flat, typed):  # what the pipeline is built from
            assert loader._prefetch == 3 and loader.timeout == 60.0
            assert loader.on_error == "skip" and loader.device == torch.device("cpu")
    # every field of both dataclasses is a flat keyword (no field differs from its default here
    # by accident: the test set names each one)
    names = {f.name for f in dataclasses.fields(Transform) + dataclasses.fields(ImageLoaderOptions)}
    assert names - set(FLAT) == {"device_id", "random_area", "random_aspect_ratio"}


def test_flat_keyword_overrides_its_field_and_leaves_the_rest() -> None:
    ds = BytesDataset([_jpeg(0)])
    t = Transform(train=False, crop=CROP, resize=RESIZE)
    o = ImageLoaderOptions(device="cpu", num_threads=2, timeout=9.0)
    with ImageLoader(ds, 1, transform=t, options=o, crop=16, timeout=5.0) as loader:
        assert loader.transform == dataclasses.replace(t, crop=16)
        assert loader.options == dataclasses.replace(o, timeout=5.0)
    assert t.crop == CROP and o.timeout == 9.0  # the caller's objects are not changed


def test_unknown_or_bad_keywords_fail_clearly() -> None:
    ds = BytesDataset([_jpeg(0)])
    with pytest.raises(TypeError, match="cropp"):
        ImageLoader(ds, 1, device="cpu", cropp=16)
    with pytest.raises(ValueError, match="on_error"):
        ImageLoader(ds, 1, device="cpu", on_error="ignore")
    with pytest.raises(ValueError, match="on_error"):
        ImageLoaderOptions(on_error="ignore")
    with pytest.raises(ValueError, match="output_layout"):
        Transform(output_layout="CHW")
    with pytest.raises(ValueError, match="dtype"):
        ImageLoader(ds, 1, device="cpu", dtype="int8")
    with pytest.raises(TypeError, match="ImageLoaderOptions"):
        ImageLoader(ds, 1, options={"device": "cpu"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Transform"):
        ImageLoader(ds, 1, device="cpu", transform={"crop": 16})  # type: ignore[arg-type]


def test_options_form_decodes_like_the_flat_form() -> None:
    ds = BytesDataset([_jpeg(i) for i in range(6)])
    flat = dict(FLAT, on_error="raise")
    t, o = _split(flat)
    with ImageLoader(ds, 3, shuffle=False, **flat) as a:
        xa = torch.cat([x for x, _ in a])
    with ImageLoader(ds, 3, shuffle=False, transform=t, options=o) as b:
        xb = torch.cat([x for x, _ in b])
    assert xa.shape == (6, CROP, CROP, 3) and xa.dtype == torch.float16
    assert torch.equal(xa, xb)  # eval transforms are deterministic

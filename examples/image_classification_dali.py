"""Image classification with DALI decoding: JPEGs in a feedpipe dataset, decoded and augmented by
DALI on the GPU (nvJPEG) or, without a GPU, on DALI's CPU backend.

    python examples/image_classification_dali.py                 # tiny synthetic JPEGs, ~20 s
    python examples/image_classification_dali.py --device cuda   # on a GPU machine

Steps: write an ImageFolder-style directory of JPEGs (one sub-directory per class), convert it
with ``feedpipe.convert`` (bytes layout: each JPEG stored as is, plus a ``label`` field and the
class names), then train a small CNN on batches from ``feedpipe.dali.ImageLoader`` (random
resized crop, flip, normalize, NCHW float32). Without DALI installed it falls back to
``feedpipe.DataLoader`` with PIL decoding, so the script runs anywhere.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import feedpipe
from feedpipe.errors import MissingExtraError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HUES = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (200, 40, 200)]


def write_images(root: Path, per_class: int, classes: int, size: int, seed: int) -> None:
    """Noisy images whose mean colour depends on the class (easy to learn in a few steps)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = np.array(HUES[c % len(HUES)], dtype=np.float32)
            img = base + rng.normal(0, 40, (size, size + 8, 3))
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(
                root / f"class{c}" / f"{i:04d}.jpg", quality=90
            )


class PILDataset(torch.utils.data.Dataset):
    """The fallback path: decode + eval transform with PIL, one sample at a time."""

    def __init__(self, ds: Any, crop: int) -> None:
        self.ds, self.crop = ds, crop

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        rec = self.ds[i]
        img = Image.open(io.BytesIO(rec["data"].numpy().tobytes())).convert("RGB")
        img = img.resize((self.crop, self.crop), Image.BILINEAR)
        a = (np.asarray(img, dtype=np.float32) / 255 - MEAN) / STD
        return torch.from_numpy(a.transpose(2, 0, 1).astype(np.float32)), int(rec["label"])


def make_loader(ds: Any, args: argparse.Namespace) -> tuple[Any, str]:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.loader in ("auto", "dali"):
        try:
            from feedpipe.dali import ImageLoader

            loader = ImageLoader(
                ds,
                batch_size=args.batch_size,
                shuffle=True,
                seed=args.seed,
                crop=args.crop,
                resize=args.crop + args.crop // 8,
                device=device,
                num_threads=2,
                py_num_workers=1,
                timeout=120,
            )
            return loader, f"dali-{device}"
        except MissingExtraError as exc:
            if args.loader == "dali":
                raise
            print(f"DALI not available ({exc}); falling back to PIL")
    loader = feedpipe.DataLoader(
        PILDataset(ds, args.crop), batch_size=args.batch_size, shuffle=True, num_workers=2
    )
    return loader, "pil-cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="images + dataset (default: a temporary directory)")
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--per-class", type=int, default=32)
    p.add_argument("--image-size", type=int, default=48)
    p.add_argument("--crop", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--loader", choices=("auto", "dali", "pil"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = Path(tmp.name)
    else:
        workdir = Path(args.workdir)
    images, data = workdir / "images", workdir / "dataset"
    if not (data / "index.json").exists():
        write_images(images, args.per_class, args.classes, args.image_size, args.seed)
        result = feedpipe.convert(images, data, workers=1, progress_bar=False)
        print(f"converted: {result.summary()}")
    ds = feedpipe.MemmapDataset(data)
    print(f"dataset: {len(ds)} JPEGs, classes {ds.classes}")

    loader, backend = make_loader(ds, args)
    print(f"decoder: {backend}")
    dev = torch.device("cuda" if backend == "dali-cuda" else "cpu")
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, args.classes),
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        correct = seen = 0
        for images_b, labels in loader:
            images_b, labels = images_b.to(dev), labels.to(dev).long()
            logits = model(images_b)
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
        print(f"epoch {epoch}: loss {loss.item():.3f} train accuracy {correct / seen:.3f}")
    elapsed = time.perf_counter() - start
    print(f"{args.epochs * len(ds) / elapsed:,.0f} images/s; input: {loader.meter.summary()}")
    if hasattr(loader, "close"):
        loader.close()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

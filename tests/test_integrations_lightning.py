"""Lightning integrations, in real (tiny, CPU) Trainer runs: the ckpt CheckpointIO plugin and the
stall-counter callback. Skipped, naming the package, when Lightning is not installed."""

from __future__ import annotations

import csv
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("lightning") is not None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
elif importlib.util.find_spec("pytorch_lightning") is not None:  # pragma: no cover
    import pytorch_lightning as L
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger
else:  # pragma: no cover
    pytest.skip(
        "needs the 'lightning' (or 'pytorch_lightning') package: pip install 'feedpipe[lightning]'",
        allow_module_level=True,
    )

import feedpipe
from ckpt import CheckpointError
from ckpt.integrations.lightning import CkptCheckpointIO
from feedpipe.integrations.lightning import StallMonitor

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
]


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _Seen(L.Callback):
    """Where a (resumed) fit started and how many batches it ran."""

    def __init__(self) -> None:
        self.start_step = -1
        self.batches = 0
        self.start_weight = torch.empty(0)

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.start_step = trainer.global_step
        self.start_weight = pl_module.net.weight.detach().clone()

    def on_train_batch_end(self, *args):  # type: ignore[no-untyped-def]
        self.batches += 1


def _trainer(tmp_path: Path, **kw) -> L.Trainer:  # type: ignore[no-untyped-def]
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=kw.pop("logger", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kw,
    )


def _loader() -> feedpipe.DataLoader:
    return feedpipe.DataLoader(_Data(), batch_size=8, shuffle=True, num_workers=0)


def test_checkpoint_io_saves_ckpt_directories_and_resumes(tmp_path: Path) -> None:
    io = CkptCheckpointIO()
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    model = _Model()
    _trainer(tmp_path, max_steps=8, plugins=[io], callbacks=[ckpt_cb]).fit(model, _loader())
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert saved == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    last = tmp_path / "ck" / "epoch=0-step=8.ckpt"
    assert (last / "manifest.json").is_file() and (last / "data.bin").is_file()  # ckpt format
    body = json.loads((last / "manifest.json").read_text())["body"]
    assert body["format"] == "ckpt" and body["version"] == 1
    state = io.load_checkpoint(last)
    assert state["global_step"] == 8
    for name, value in model.state_dict().items():
        assert torch.equal(state["state_dict"][name], value), name
    assert state["optimizer_states"][0]["state"]  # momentum buffers were saved

    # resume from it: the loop and the model pick up at step 8 and go on to 12
    seen = _Seen()
    trainer = _trainer(tmp_path, max_steps=12, plugins=[CkptCheckpointIO()], callbacks=[seen])
    trainer.fit(_Model(), _loader(), ckpt_path=str(last))
    assert seen.start_step == 8 and seen.batches == 4 and trainer.global_step == 12
    assert torch.equal(seen.start_weight, state["state_dict"]["net.weight"])


def test_checkpoint_io_remove_and_top_k(tmp_path: Path) -> None:
    cb = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=1,
                         monitor="step", mode="max")  # fmt: skip
    _trainer(tmp_path, max_steps=6, plugins=[CkptCheckpointIO()], callbacks=[cb]).fit(
        _Model(), _loader()
    )
    # older checkpoint directories were removed through remove_checkpoint
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0-step=6.ckpt"]


def test_checkpoint_io_async_error_reaches_next_call(tmp_path: Path) -> None:
    io = CkptCheckpointIO()
    io.save_checkpoint({"bad": object()}, tmp_path / "a.ckpt")  # fails in the background
    with pytest.raises(CheckpointError, match=r"a\.ckpt.*object"):
        io.wait(timeout=30)
    assert not (tmp_path / "a.ckpt").exists()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b.ckpt")
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(3))


def test_checkpoint_io_async_snapshot_is_taken_at_save(tmp_path: Path) -> None:
    io = CkptCheckpointIO()
    w = torch.zeros(1000)
    io.save_checkpoint({"w": w}, tmp_path / "s.ckpt")
    w += 1  # the training loop goes on changing the tensor
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "s.ckpt")["w"], torch.zeros(1000))


def test_checkpoint_io_sync_and_bad_paths(tmp_path: Path) -> None:
    io = CkptCheckpointIO(async_save=False)
    io.save_checkpoint({"w": torch.arange(4)}, tmp_path / "x.ckpt")
    assert (tmp_path / "x.ckpt" / "manifest.json").is_file()
    with pytest.raises(CheckpointError, match="missing"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "x.ckpt" / "data.bin").write_bytes(b"\0" * 32)  # corrupt it
    with pytest.raises(CheckpointError, match=r"data\.bin"):
        io.load_checkpoint(tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "y.ckpt", storage_options={"a": 1})
    with pytest.raises(ValueError, match=r"s3://bucket/run/z\.ckpt"):
        io.save_checkpoint({}, "s3://bucket/run/z.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, f"file://{tmp_path}/f.ckpt")
    assert (tmp_path / "f.ckpt" / "manifest.json").is_file()


class _SlowData(_Data):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        threading.Event().wait(0.002)  # a slow read: the loop must wait for it
        return super().__getitem__(i)


def test_stall_monitor_logs_counters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loader = feedpipe.DataLoader(_SlowData(), batch_size=8, num_workers=0)
    monitor = StallMonitor(every_n_steps=2)
    logger = CSVLogger(tmp_path, name="run")
    caplog.set_level("INFO", logger="feedpipe")
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[monitor], logger=logger)
    trainer.fit(_Model(), loader)
    assert monitor.meters == [loader.meter]
    m = monitor.last_metrics
    # each batch reads 8 samples at >= 2 ms in the loop's own thread: > 16 ms of wait per batch
    assert m["feedpipe/stall_ms_per_batch"] >= 16.0
    assert 0.0 < m["feedpipe/stall_fraction"] <= 1.0
    assert m["feedpipe/samples_per_s"] > 0
    assert "feedpipe/fetch_ms" in m
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("feedpipe/stall_fraction")]
    assert len(logged) == 4  # 8 batches, every 2 steps
    assert "feedpipe stall report" in caplog.text


def test_stall_monitor_explicit_meter_and_bad_args() -> None:
    meter = feedpipe.StallMeter()
    mon = StallMonitor(meter=meter, every_n_steps=1, prefix="in/")
    meter.wait_begin()
    meter.wait_end(samples=4)
    m = mon.metrics()
    assert set(m) >= {"in/stall_fraction", "in/stall_ms_per_batch", "in/wait_p99_ms"}
    with pytest.raises(ValueError, match="every_n_steps"):
        StallMonitor(every_n_steps=0)


def test_lightning_url_error_is_redacted(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from ckpt.integrations.lightning import CkptCheckpointIO

    with pytest.raises(ValueError, match="CkptCheckpointIO") as info:
        CkptCheckpointIO().save_checkpoint({"w": torch.ones(1)}, "s3://AKIA:TOPSECRET@b/x.ckpt")
    assert "TOPSECRET" not in str(info.value)

"""Retention and save policies (docs/guides/checkpoint-policies.md): ``keep_last``,
``keep_every``, ``keep_best`` compose; the same ``ckpt.policy`` objects drive the manager, the
remote tier and ``ckpt gc``; metrics live in the manifest and are validated like every field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import _layout, cli
from ckpt import format as fmt
from ckpt.errors import CorruptCheckpointError
from ckpt.manager import CheckpointManager
from ckpt.policy import AnyOf, KeepBest, KeepEvery, KeepLast, StepView, from_options
from feedpipe.io import crc32c, to_hex


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step": step}


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in directory.glob("step-*") if p.name[5:].isdigit())


def _save_all(m: CheckpointManager, steps: Any, loss: Any = None) -> None:
    for s in steps:
        metrics = None if loss is None else loss(s)
        m.save(s, _state(s), metrics=metrics)
        m.wait()


def _corrupt_data(directory: Path, step: int) -> None:
    data = _layout.step_dir(directory, step) / _layout.DATA_FILE
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))


def _write_raw_manifest(step_dir: Path, edit: Any, raw_value: str | None = None) -> None:
    """Rewrite the manifest of ``step_dir`` with ``edit(body)`` applied, a valid CRC32C and,
    with ``raw_value``, the JSON text ``"@RAW@"`` replaced by that raw text (``1e999``)."""
    body = fmt.read_manifest(step_dir)
    edit(body)
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if raw_value is not None:
        canon = canon.replace(b'"@RAW@"', raw_value.encode())
    text = b'{"crc32c":"' + to_hex(crc32c(canon)).encode() + b'","body":' + canon + b"}\n"
    (step_dir / fmt.MANIFEST).write_bytes(text)


# ---- the policies as the manager applies them ---------------------------------------------------
def test_keep_last_and_keep_every_compose_and_step_zero_is_a_multiple(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, keep_every=5) as m:
        _save_all(m, range(13))
    assert _steps(tmp_path) == [0, 5, 10, 11, 12]


def test_keep_best_min_and_max(tmp_path: Path) -> None:
    loss = {0: 5.0, 1: 1.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 2.0, 6: 9.0}
    with CheckpointManager(tmp_path / "min", keep_last=1, keep_best=("val_loss", 2, "min")) as m:
        _save_all(m, range(7), lambda s: {"val_loss": loss[s]})
    assert _steps(tmp_path / "min") == [1, 3, 6]  # the two lowest, and the newest
    with CheckpointManager(tmp_path / "max", keep_last=1, keep_best=KeepBest("acc", 2, "max")) as m:
        _save_all(m, range(7), lambda s: {"acc": loss[s]})
    assert _steps(tmp_path / "max") == [0, 6]  # 9.0 and 5.0; 6 is also the newest


def test_keep_best_skips_steps_without_the_metric(tmp_path: Path) -> None:
    """The documented rule: a step without the metric is not ranked by keep_best."""
    metrics = {0: {"val_loss": 3.0}, 1: {}, 2: {"other": 0.0}, 3: {"val_loss": 1.0}, 4: None}
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("val_loss", 5, "min")) as m:
        _save_all(m, range(5), lambda s: metrics[s])
        assert m.metrics(4) == {} and m.metrics(3) == {"val_loss": 1.0}
    assert _steps(tmp_path) == [0, 3, 4]


def test_keep_best_ties_keep_the_newer_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("l", 1, "min")) as m:
        _save_all(m, range(4), lambda s: {"l": 1.0})
    assert _steps(tmp_path) == [3]


def test_only_restorable_steps_count_for_every_policy(tmp_path: Path) -> None:
    loss = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.9, 4: 0.8, 5: 0.7, 6: 0.6}
    with CheckpointManager(tmp_path, keep_last=1, keep_every=3, keep_best=("l", 2, "min")) as m:
        _save_all(m, range(5), lambda s: {"l": loss[s]})
        assert _steps(tmp_path) == [0, 1, 3, 4]
        _corrupt_data(tmp_path, 0)  # the best step, and a multiple of 3
        _corrupt_data(tmp_path, 3)  # a multiple of 3
        m._retainer.checked.clear()  # as a new process would: nothing known verified
        _save_all(m, [5, 6], lambda s: {"l": loss[s]})
    # 0 and 3 are not restorable: not kept by keep_every, not ranked by keep_best (2 takes 0's
    # place, but was deleted already, so 1 and 6 are the two best left)
    assert _steps(tmp_path) == [1, 6]


def test_the_newest_restorable_step_is_always_kept(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, keep_best=("l", 1, "min")) as m:
        _save_all(m, range(4))  # no metrics at all: keep_best keeps nothing
    assert _steps(tmp_path) == [3]


def test_no_policy_keeps_everything(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        _save_all(m, range(5))
    assert _steps(tmp_path) == [0, 1, 2, 3, 4]


def test_bad_policy_arguments_are_refused(tmp_path: Path) -> None:
    for kwargs, match in [
        ({"keep_every": 0}, "KeepEvery.n"),
        ({"keep_best": ("l", 0, "min")}, "KeepBest.k"),
        ({"keep_best": ("l", 1, "median")}, "mode"),
        ({"keep_best": ("l", 1)}, "keep_best"),
        ({"keep_last": True}, "keep_last"),
        ({"save_interval_steps": 0}, "save_interval_steps"),
        ({"save_on_steps": [-1]}, "save_on_steps"),
        ({"keep_last_remote": 0}, "keep_last_remote"),
    ]:
        with pytest.raises(ValueError, match=match):
            CheckpointManager(tmp_path, remote="s3://b/r", **kwargs)


def test_policy_objects_are_small_and_compose() -> None:
    both = KeepLast(2) | KeepEvery(10) | KeepBest("l", 1)
    assert isinstance(both, AnyOf) and len(both.policies) == 3
    assert from_options(None, None, None) is None
    assert from_options(3) == KeepLast(3)
    good = {s: s % 4 != 1 for s in range(30)}
    view = StepView(range(30), good.__getitem__, lambda s: {"l": float(30 - s)})
    kept = both.select(view)
    assert sorted(kept) == [0, 10, 20, 27, 28, 29]  # 29 is best by l (lowest) and newest
    assert "multiple of keep_every=10" in kept[20]
    with pytest.raises(TypeError):
        AnyOf(KeepLast(1), 3)  # type: ignore[arg-type]


# ---- should_save ------------------------------------------------------------------------------
def test_should_save_interval_and_listed_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=100, save_on_steps=[7, 150]) as m:
        assert [s for s in range(301) if m.should_save(s)] == [0, 7, 100, 150, 200, 300]
    with CheckpointManager(tmp_path) as m:
        assert not any(m.should_save(s) for s in range(50))


@pytest.mark.parametrize("bad", [-10, 0, 10.0, 10**22, True, "10", None])
def test_should_save_refuses_steps_and_intervals_that_mean_nothing(
    tmp_path: Path, bad: Any
) -> None:
    """Issue 25 item 10: ``should_save`` took -10, 10.0 and 10**22; the interval took 10**22."""
    with CheckpointManager(tmp_path, save_interval_steps=10, save_on_steps=[5]) as m:
        if bad != 0:  # step 0 is a step; an interval of 0 is not
            with pytest.raises(ValueError, match=rf"should_save: step must be an int .*{bad!r}"):
                m.should_save(bad)
    if bad is not None:  # None: no interval
        with pytest.raises(ValueError, match=rf"save_interval_steps must be an int .*{bad!r}"):
            CheckpointManager(tmp_path, save_interval_steps=bad)
        if bad != 0:
            with pytest.raises(ValueError, match=r"save_on_steps"):
                CheckpointManager(tmp_path, save_on_steps=[bad])


def test_save_takes_the_steps_should_save_takes(tmp_path: Path) -> None:
    """``should_save(np.int64(10))`` said yes and ``save(np.int64(10), ...)`` then refused it;
    ``save`` took 10**22, which ``should_save`` refuses (beyond what JSON readers hold)."""
    import numpy as np

    with CheckpointManager(tmp_path, save_interval_steps=10, keep_last=None) as m:
        step = np.int64(10)
        assert m.should_save(step)
        assert m.save(step, {"w": torch.ones(1)}).result(30).name == "step-10"
        for bad in (10**22, -1, 10.0, True):
            with pytest.raises(ValueError, match=rf"save: step must be an int from 0 .*{bad!r}"):
                m.save(bad, {"w": torch.ones(1)})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-10"]


def test_the_retention_record_round_trips_every_policy() -> None:
    from ckpt.policy import Policy, from_record, to_record

    for p in (None, KeepLast(2), KeepLast(2) | KeepEvery(3) | KeepBest("loss", 1, "max")):
        assert from_record(to_record(p)) == p
    assert to_record(KeepLast(1) | type("Custom", (Policy,), {})()) is None


# ---- metrics and metadata in the manifest -------------------------------------------------------
def test_metrics_and_metadata_round_trip(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, _state(1), metrics={"val_loss": 0.25, "top-1": 71, "val/acc": 0.5},
               metadata={"lr": 0.1, "tags": ["a"]})  # fmt: skip
        m.wait()
        assert m.metrics(1) == {"val_loss": 0.25, "top-1": 71, "val/acc": 0.5}
        assert m.metadata(1) == {"lr": 0.1, "tags": ["a"]}


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        ({"l": math.nan}, r"metrics\['l'\]"),
        ({"l": math.inf}, r"metrics\['l'\]"),
        ({"l": "0.5"}, r"metrics\['l'\]"),
        ({"l": True}, r"metrics\['l'\]"),
        ({"l": {"nested": 1}}, r"metrics\['l'\]"),
        ({"l": 10**400}, r"metrics\['l'\]"),
        ({"bad name\x1b[31m": 1.0}, "bad metric name"),
        ({"x" * 200: 1.0}, "bad metric name"),
        ([("l", 1.0)], "metrics: expected a dict"),
        ({f"m{i}": 1.0 for i in range(300)}, "over the limit"),
    ],
)
def test_bad_metrics_are_refused_before_anything_is_staged(
    tmp_path: Path, metrics: Any, match: str
) -> None:
    with CheckpointManager(tmp_path) as m:
        with pytest.raises(ValueError, match=match):
            m.save(1, _state(1), metrics=metrics)
        assert m.stats.saves == 0 and _steps(tmp_path) == []


def test_unjsonable_metadata_is_refused_at_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        with pytest.raises(ValueError, match="metadata"):
            m.save(1, _state(1), metadata={"x": math.nan})
        with pytest.raises(ValueError, match="metadata"):
            m.save(1, _state(1), metadata={"x": object()})
        assert m.stats.saves == 0


_HOSTILE: list[tuple[Any, str | None, str]] = [
    (lambda b: b.update(metrics={"val_loss": "@RAW@"}), "1e999", r"metrics\['val_loss'\]"),
    (lambda b: b.update(metrics={"val_loss": "@RAW@"}), "NaN", "not valid"),
    (lambda b: b.update(metrics={"val_loss": "low"}), None, r"metrics\['val_loss'\]"),
    (lambda b: b.update(metrics={"val_loss": [1.0]}), None, r"metrics\['val_loss'\]"),
    (lambda b: b.update(metrics={"val_loss": {"a": {"b": 1}}}), None, r"metrics\['val_loss'\]"),
    (lambda b: b.update(metrics={"val_loss": 10**30}), None, r"metrics\['val_loss'\]"),
    (lambda b: b.update(metrics={"x" * 100_000: 1.0}), None, "bad metric name"),
    (lambda b: b.update(metrics=[1, 2]), None, "metrics: expected a dict"),
    (lambda b: b.update(metadata="junk"), None, "metadata"),
    (lambda b: b.update(metadata={"a": _deep(150)}), None, "metadata"),
]


def _deep(n: int) -> Any:
    node: Any = 1
    for _ in range(n):
        node = [node]
    return node


@pytest.mark.parametrize(("edit", "raw", "match"), _HOSTILE)
def test_hostile_metrics_with_a_valid_crc_are_corrupt_and_restore_falls_back(
    tmp_path: Path, edit: Any, raw: str | None, match: str
) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for s in (1, 2):
            m.save(s, _state(s), metrics={"val_loss": float(s)})
        m.wait()
    _write_raw_manifest(_layout.step_dir(tmp_path, 2), edit, raw)
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        fmt.read_manifest(_layout.step_dir(tmp_path, 2))
    assert "step-2" in str(info.value)
    with CheckpointManager(tmp_path, keep_last=None) as m:
        with pytest.raises(CorruptCheckpointError, match=match):
            m.metrics(2)
        assert m.restore()["step"] == 1  # falls back past the hostile step
        assert m.stats.last_restore is not None and m.stats.last_restore.skipped[0][0] == 2


def test_gc_keep_best_with_a_hostile_metric_neither_ranks_nor_trusts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for s, loss in enumerate([0.5, 0.1, 0.9, 0.8, 0.7]):
            m.save(s, _state(s), metrics={"val_loss": loss})
        m.wait()
    # step 3 claims the best loss ever, as an out-of-range float, with a valid CRC
    _write_raw_manifest(
        _layout.step_dir(tmp_path, 3), lambda b: b["metrics"].update(val_loss="@RAW@"), "-1e999"
    )
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1", "--keep-best", "val_loss:2:min"]) == 0
    out = capsys.readouterr().out
    assert _steps(tmp_path) == [0, 1, 4]  # best two (0.1, 0.5) and the newest
    assert "deleted step 3" in out and "one of the 2 best by val_loss (min): 0.1" in out


def test_gc_keep_every_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as m:
        _save_all(m, range(7))
    assert (
        cli.main(["gc", str(tmp_path), "--keep-last", "1", "--keep-every", "3", "--dry-run"]) == 0
    )
    assert "would delete step 1" in capsys.readouterr().out and len(_steps(tmp_path)) == 7
    assert cli.main(["gc", str(tmp_path), "--keep-last", "1", "--keep-every", "3"]) == 0
    assert _steps(tmp_path) == [0, 3, 6]


@pytest.mark.parametrize("flags", [["--keep-best", "l:x:min"], ["--keep-best", "l:2:avg"],
                                   ["--keep-every", "0"], ["--keep-last", "0"]])  # fmt: skip
def test_gc_bad_policy_flags_exit_2(tmp_path: Path, flags: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["gc", str(tmp_path), *flags])
    assert info.value.code == 2


def test_ls_metrics(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, _state(1), metrics={"val_loss": 0.25}, metadata={"note": "x" * 1000})
        m.save(2, _state(2))
        m.wait()
    assert cli.main(["ls", str(tmp_path), "--metrics"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert 'metrics={"val_loss": 0.25}' in lines[1] and "x" * 1000 not in lines[1]
    assert lines[1].endswith("...") and "metrics={}" in lines[2]
    assert cli.main(["ls", str(tmp_path)]) == 0
    assert "metrics=" not in capsys.readouterr().out


# ---- the remote tier ---------------------------------------------------------------------------
def test_remote_tier_takes_a_policy_and_reads_metrics(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    from ckpt.remote import RemoteOptions

    bucket, options = s3_bucket
    remote = RemoteOptions(f"s3://{bucket}/run", storage_options=options)
    loss = {0: 0.3, 1: 0.1, 2: 0.5, 3: 0.4, 4: 0.6}
    policy = KeepLast(1) | KeepBest("val_loss", 1, "min")
    with CheckpointManager(
        tmp_path / "a", keep_last=1, remote=remote, keep_last_remote=policy
    ) as m:
        for s in range(5):
            m.save(s, _state(s), metrics={"val_loss": loss[s]})
            m.wait(uploads=True)
        assert m.remote is not None and m.remote.committed_steps() == [1, 4]
        assert m.metrics(1) == {"val_loss": 0.1}  # step 1 is remote only: its remote manifest
        assert _steps(tmp_path / "a") == [4]


# ---- the guide's examples are real -------------------------------------------------------------
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "checkpoint-policies.md"


def _blocks(page: Path, lang: str) -> list[str]:
    text = page.read_text()
    return [b.split("```", 1)[0] for b in text.split(f"```{lang}\n")[1:]]


def test_the_policy_guide_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(_blocks(GUIDE, "python")[0], str(GUIDE), "exec"), {})  # its asserts hold


def test_the_policy_guide_gc_output_is_real(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    with CheckpointManager("checkpoints", keep_last=None) as m:
        for step in range(0, 301, 25):
            m.save(step, {"model": model}, metrics={"val_loss": 1.0 / (1 + step % 130)})
    block = next(b for b in _blocks(GUIDE, "text") if b.startswith("$ ckpt gc"))
    command, *expected = block.strip().splitlines()
    assert cli.main(command.split()[2:]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def test_the_preemption_guide_loop_is_the_tested_worker() -> None:
    page = GUIDE.with_name("preemption.md")
    worker = Path(__file__).with_name("_ckpt_preempt_train.py").read_text()
    worker_lines = [line.strip() for line in worker.splitlines()]
    loop = _blocks(page, "python")[0]
    for line in filter(None, (x.strip() for x in loop.splitlines())):
        assert line in worker_lines, line


def test_a_metrics_read_failure_stops_the_pass_before_any_delete() -> None:
    """The remote tier lets a transient failure to read a step's metrics propagate: the whole
    plan fails, so no step is deleted because its metric could not be read this time."""
    from ckpt.retention import rules

    def flaky(step: int) -> dict:
        if step == 2:
            raise OSError("connection reset")
        return {"l": float(step)}

    with pytest.raises(OSError, match="connection reset"):
        rules.plan(
            range(6),
            KeepLast(1) | KeepBest("l", 1, "min"),
            is_restorable=lambda s: True,
            may_evict=lambda s: True,
            metrics=flaky,
        )


@pytest.mark.usefixtures("_keep_handlers")
def test_metric_name_with_trailing_newline_is_rejected() -> None:
    """``$`` in the name pattern matched before a trailing newline: ``"loss\\n"`` passed."""
    with pytest.raises(ValueError, match="bad metric name"):
        fmt.check_metrics({"loss\n": 1.0})


@pytest.mark.usefixtures("_keep_handlers")
def test_save_on_steps_takes_numpy_integers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``save_on_steps=np.arange(...)`` (a careless but natural spelling) was refused."""
    np = pytest.importorskip("numpy")
    from ckpt import CheckpointManager

    with CheckpointManager(
        tmp_path, save_on_steps=np.array([5, 5, 20]), save_interval_steps=np.int64(7)
    ) as manager:
        assert [s for s in range(25) if manager.should_save(s)] == [0, 5, 7, 14, 20, 21]
    with pytest.raises(ValueError, match="save_on_steps"):
        CheckpointManager(tmp_path, save_on_steps=[np.int64(-1)])
    with pytest.raises(ValueError, match="save_on_steps"):
        CheckpointManager(tmp_path, save_on_steps=[1.5])


@pytest.mark.usefixtures("_keep_handlers")
def test_a_transient_read_error_does_not_unrank_the_best_step(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An ``OSError`` reading the best step's manifest (EIO, EMFILE) made it 'unranked', and
    the same retention pass deleted it: the remote tier stops the pass instead, so must this."""
    import errno

    import torch

    from ckpt import CheckpointManager
    from ckpt.retention import checks as _retention

    state = {"w": torch.zeros(2)}
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 1, "min")) as m:
        for step, loss in [(0, 0.1), (1, 0.5), (2, 0.9), (3, 0.8)]:
            m.save(step, state, metrics={"loss": loss})
            m.wait()
        assert m.steps() == [0, 3]
    real = _retention.metrics

    def flaky(path):  # type: ignore[no-untyped-def]
        if path.name.endswith("0"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(_retention, "metrics", flaky)
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 1, "min")) as m:
        with pytest.raises(OSError):
            m.gc()
        assert m.steps() == [0, 3]
    monkeypatch.setattr(_retention, "metrics", real)
    with CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 1, "min")) as m:
        assert m.gc() == [] and m.steps() == [0, 3]


@pytest.mark.usefixtures("_keep_handlers")
def test_keep_best_ranks_large_int_metrics_exactly() -> None:
    """Int metrics (up to 2**63 are accepted) were ranked as floats: 2**62 and 2**62 + 1 tied,
    so "max" kept the newer, smaller one."""
    from ckpt.policy import KeepBest, StepView

    saved = {0: {"n": 2**62 + 1}, 1: {"n": 2**62}}
    view = StepView(saved, lambda s: True, lambda s: saved[s])
    assert list(KeepBest("n", 1, "max").select(view)) == [0]
    assert list(KeepBest("n", 1, "min").select(view)) == [1]


@pytest.mark.usefixtures("_keep_handlers")
def test_a_transient_error_verifying_a_keep_every_step_does_not_delete_it(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch
) -> None:
    import errno

    import torch

    from ckpt import CheckpointManager
    from ckpt.restoring import reader as _reader

    state = {"w": torch.zeros(2)}
    with CheckpointManager(tmp_path, keep_last=None) as m:
        for step in (0, 5, 10, 11, 12):
            m.save(step, state)
        m.wait()
    real = _reader.verify_step

    def flaky(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path.name == "step-10":
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_reader, "verify_step", flaky)
    with CheckpointManager(tmp_path, keep_last=1, keep_every=10) as m:  # its pass only warns
        with pytest.raises(OSError, match="Too many open files"):
            m.gc()  # an explicit gc says why it stopped
        assert 10 in m.steps()
        m.save(13, state)
        m.wait()  # retention after a save skips the pass too; the save itself is fine
        assert 10 in m.steps() and 13 in m.steps()


def test_rules_keeps_restorable_and_metrics_without_importing_the_restore_path() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ckpt.retention import rules\n"
        "assert 'ckpt.retention.checks' not in sys.modules\n"
        "assert 'ckpt.restoring.reader' not in sys.modules\n"
        "from ckpt.retention import checks\n"
        "assert rules.restorable is checks.restorable and rules.metrics is checks.metrics\n"
        "assert {'restorable', 'metrics'} <= set(rules.__all__)\n"
        "assert not hasattr(rules, 'no_such_name')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr

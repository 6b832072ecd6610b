"""The ``ckpt`` command: ``ckpt ls|verify PATH_OR_URL``, ``ckpt gc DIR``.

``PATH_OR_URL`` is a directory of ``step-N`` checkpoints, a single checkpoint directory (the
output of ``ckpt.save``, a Lightning checkpoint written by ``CkptCheckpointIO``) or a remote URL
(``s3://bucket/run``; ``--endpoint-url``/``--anon`` for S3-compatible servers).
``ls`` lists steps (size, files, creation time, ``latest``, upload status, the ``metadata`` given
to ``save``; with ``--metrics`` the ``metrics`` too) and leftovers without reading data;
``verify`` checks that each step restores: every data file's CRC32C and the tree, entries and
types, as ``restore`` checks them. Both exit with status 1 if any step is bad. ``gc`` removes
leftovers of interrupted saves and applies the manager's retention rule (``ckpt.retention.rules``
with the ``ckpt.policy`` objects of ``--keep-last N``, ``--keep-every N`` and
``--keep-best METRIC:K:min|max``; a step is kept if any keeps it) under the directory's writer
lock: only restorable steps count, and a step whose upload has not finished is never deleted.
Without any of those flags ``gc`` applies the policy that the directory's manager recorded
(``retention.json``), and refuses to run where none is recorded: it has no default of its own.
``--keep-last none`` sets no count limit, so the other flags alone decide, and with none of them
``gc`` keeps every step (the manager's ``keep_last=None``) and only removes leftovers.
``gc`` deletes only what ckpt wrote (``ckpt._owner``): a directory without ckpt's marker that
holds anything else is refused, naming those entries; in a directory that has the marker they
are listed as skipped. ``--dry-run`` prints the same decisions and changes nothing.
``ls DIR`` also lists the snapshots of ``DIR``'s memory tier (``--memory-root``, default
``/dev/shm``: ``ckpt.tiers.memory_options``), and ``gc DIR`` frees that tier when it is stale (no
live writer), persisting its newest verified snapshot first if ``DIR`` has none as new
(``ckpt.tiers.memory_gc``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckpt import _layout, _owner
from ckpt import format as fmt
from ckpt._paths import local_path
from ckpt.errors import CheckpointError
from ckpt.policy import Policy, from_options
from ckpt.retention import checks, rules
from ckpt.saving import commit
from feedpipe.io.cliargs import add_storage_arguments, format_bytes, storage_options
from feedpipe.io.remote import is_url

__all__ = ["main"]


def _verify(path: Path) -> tuple[bool, str, int]:
    """Whether the checkpoint in ``path`` restores (every checksum, the tree, entries, types)."""
    t0 = time.perf_counter()
    why = checks.restorable(path)
    if why is not None:
        return False, why, 0
    try:
        nbytes = sum(rec["size"] for rec in fmt.read_manifest(path)["files"])
    except CheckpointError as exc:  # changed since it was verified
        return False, str(exc), 0
    dt = time.perf_counter() - t0
    rate = nbytes / max(dt, 1e-9) / 1e9
    return True, f"ok ({format_bytes(nbytes, 'GiB')} in {dt:.2f} s, {rate:.2f} GB/s)", nbytes


def _step_names(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` entry of ``root`` (committed or not: one without a manifest is bad)."""
    found = []
    for name in os.listdir(root):
        step = _layout.step_number(name)
        if step is not None:
            found.append((step, root / name))
    return sorted(found)


def _targets(root: Path) -> tuple[list[tuple[str, Path]], bool]:
    """``(label, path)`` of each checkpoint under ``root``, and whether ``root`` is one itself
    (the output of ``ckpt.save``, a Lightning checkpoint directory)."""
    if os.path.lexists(root / fmt.MANIFEST):
        return [(str(root), root)], True
    return [(f"step {n}", path) for n, path in _step_names(root)], False


_HEADER = f"{'step':>10}  {'size':>10}  {'files':>5}  {'created':<19}  {'upload':<9}  status"
_SHOWN_CHARS = 200  # metadata longer than this is cut in ``ls`` (``metadata(step)`` has it all)


def _row(
    label: str, body: dict[str, Any] | None, mark: str, upload: str = "-", metrics: bool = False
) -> str:
    if body is None:
        return f"{label:>10}  {'?':>10}  {'?':>5}  {'?':<19}  {upload:<9}  {mark}"
    size = sum(rec["size"] for rec in body["files"])
    created = body.get("created")
    when = (
        datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
        if isinstance(created, (int, float))
        else "-"
    )
    meta = body.get("metadata")
    shown = {k: v for k, v in meta.items() if k != "dcp"} if isinstance(meta, dict) else {}
    text = json.dumps(shown, sort_keys=True)
    extra = f"  {text[:_SHOWN_CHARS]}{'...' if len(text) > _SHOWN_CHARS else ''}" if shown else ""
    if metrics:
        extra = f"  metrics={json.dumps(body.get('metrics', {}), sort_keys=True)}{extra}"
    files = len(body["files"])
    shown_size = format_bytes(size, "GiB")
    return f"{label:>10}  {shown_size:>10}  {files:>5}  {when:<19}  {upload:<9}  {mark}{extra}"


def _ls_step(
    label: str,
    path: Path,
    *,
    step: int | None,
    latest: int | None,
    uploads: dict[int, dict[str, Any]],
    metrics: bool,
) -> bool:
    """Print the row of one checkpoint of ``ckpt ls DIR``; ``False`` if it is bad."""
    name = "-" if step is None else str(step)
    try:
        body = fmt.read_manifest(path)
    except (CheckpointError, OSError) as exc:
        print(_row(name, None, f"BAD: {_reason(exc, path)}"))
        return False
    if step is None:
        mark = f"checkpoint {label}"
    else:
        mark = "committed" + (", latest" if step == latest else "")
    up = uploads.get(step, {}) if step is not None else {}
    if up.get("reason"):
        mark += f" (upload: {up['reason']})"
    print(_row(name, body, mark, str(up.get("state", "-")), metrics))
    return True


def _ls_leftovers(root: Path) -> None:
    for path in commit.leftovers(root):
        what = "leftover" if _owner.is_ours(path) else "not written by ckpt, kept"
        print(f"{'-':>10}  {'':>10}  {'':>5}  {'':<19}  {'':<9}  {what}: {path.name}")


def _ls_memory(root: Path, memory_root: str, metrics: bool) -> int:
    """The rows of ``root``'s memory tier (``ckpt ls DIR``); the number of bad ones."""
    from ckpt.tier_guard import check_tier
    from ckpt.tiers.memory_options import tier_dir

    where = tier_dir(root, memory_root)
    try:
        safe = check_tier(where)
    except CheckpointError as exc:  # a symlink or another user's: not listed through
        print(f"skipped {exc}")
        return 1
    if safe and _owner.owned(where):
        print(f"memory tier {where}:")
        latest = commit.read_latest(where)
        return sum(
            not _ls_step(str(s), _layout.step_dir(where, s), step=s, latest=latest, uploads={},
                         metrics=metrics)
            for s in commit.steps(where)
        )  # fmt: skip
    return 0


def _ls_lost(root: Path, memory_root: str) -> None:
    """A missing ``DIR`` whose memory tier survives: list the tier, and how to keep it."""
    from ckpt.tiers.memory_options import tier_dir

    if os.path.lexists(tier_dir(root, memory_root)):
        print(_HEADER)
        _ls_memory(root, memory_root, False)
        print("ckpt: the memory tier above holds the only copy of DIR: restore it with "
              "CheckpointManager(DIR, memory=...), or create DIR and run 'ckpt gc DIR' to "
              "persist its newest step there", file=sys.stderr)  # fmt: skip


def _ls(root: Path, metrics: bool = False, memory_root: str = "/dev/shm") -> int:
    """``ckpt ls DIR``: a row per step (or the one checkpoint), then the leftovers."""
    from ckpt.remote import read_status

    targets, single = _targets(root)
    latest = None if single else commit.read_latest(root)
    uploads = {} if single else read_status(root)
    print(_HEADER)
    bad = 0
    for label, path in targets:
        step = None if single else int(path.name[5:])
        bad += not _ls_step(label, path, step=step, latest=latest, uploads=uploads, metrics=metrics)
    if not single:
        _ls_leftovers(root)
        bad += _ls_memory(root, memory_root, metrics)
    return 1 if bad else 0


def _reason(exc: BaseException, path: Path) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{path / fmt.MANIFEST}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)


def _verify_cmd(root: Path, only: int | None) -> int:
    targets, single = _targets(root)
    if only is not None:
        if single:
            print(f"{root}: a single checkpoint, not a directory of steps (drop --step)")
            return 2
        targets = [(f"step {only}", _layout.step_dir(root, only))]
    if not targets:
        print(f"{root}: no committed checkpoints")
        return 1
    bad = 0
    for label, path in targets:
        ok, msg, _ = _verify(path)
        bad += not ok
        print(f"{label}: {'OK' if ok else 'FAILED'}: {msg}")
    return 1 if bad else 0


_NO_FLAGS = object()  # gc without retention flags: apply the policy the manager recorded


class _GcSteps:
    """What ``ckpt gc``'s retention asks about the local steps of ``root``: whether each one
    restores (why not is kept for the report), whether its upload finished (where the directory
    has a remote tier), the metrics it was saved with."""

    def __init__(self, root: Path) -> None:
        from ckpt.remote import STATUS_FILE, read_status

        self.root = root
        self.remote = (root / STATUS_FILE).exists()  # a remote tier: keep what is not uploaded
        self.uploads = read_status(root)
        self.why_bad: dict[int, str] = {}

    def is_restorable(self, step: int) -> bool:
        why = checks.restorable(_layout.step_dir(self.root, step))
        if why is not None:
            self.why_bad[step] = why
        return why is None

    def may_evict(self, step: int) -> bool:
        return not self.remote or self.uploads.get(step, {}).get("state") == "done"

    def metrics(self, step: int) -> dict[str, float]:
        try:
            return checks.metrics(_layout.step_dir(self.root, step))
        except (CheckpointError, FileNotFoundError):  # corrupt or gone: not ranked
            return {}


def _gc_foreign(root: Path, dry_run: bool) -> list[str]:
    """The entries of ``root`` that ckpt did not write (skipped); raises ``ForeignEntriesError``
    when there are any and ``root`` has no ckpt marker."""
    from feedpipe.io.ownership import ForeignEntriesError

    try:
        owned = _owner.owned(root)
    except ValueError as exc:  # a malformed marker (a directory, a FIFO, another tool's JSON)
        raise CheckpointError(str(exc)) from None
    foreign = _owner.foreign(root)
    if foreign and not owned:
        for name in foreign:
            print(f"{'would refuse' if dry_run else 'refused'}: {name} (not written by ckpt)")
        raise ForeignEntriesError(root, _owner.TOOL, foreign)
    for name in foreign:
        print(f"{'would skip' if dry_run else 'skipped'} {name} (not written by ckpt)")
    return foreign


def _gc_leftovers(root: Path, foreign: list[str], dry_run: bool) -> None:
    if dry_run:
        for path in commit.leftovers(root):
            if path.name not in foreign:
                print(f"would remove leftover {path.name}")
    else:
        for path in commit.remove_leftovers(root):
            print(f"removed leftover {path.name}")


def _gc_apply(root: Path, decision: rules.Plan, why_bad: dict[int, str], dry_run: bool) -> None:
    for step, reason in sorted(decision.keep.items()):
        detail = f": {why_bad[step]}" if step in why_bad else ""
        print(f"kept step {step} ({reason}{detail})")
    for step in decision.delete:
        if dry_run:
            print(f"would delete step {step}")
        elif commit.evict(root, step):
            print(f"deleted step {step}")
        else:
            print(f"kept step {step} (being read)")


def _gc(
    root: Path, given: Policy | object | None, dry_run: bool, memory_root: str = "/dev/shm"
) -> int:
    """``ckpt gc DIR``: refuse a foreign directory, remove leftovers, then apply retention
    (``ckpt.retention.rules.plan``) under the writer lock."""
    foreign = _gc_foreign(root, dry_run)
    policy = rules.recorded(root) if given is _NO_FLAGS else given
    assert policy is None or isinstance(policy, Policy)
    if not dry_run:
        _owner.claim_root(root)
    lock = commit.WriterLock(root)
    if not dry_run or os.path.lexists(root / _layout.LOCK):  # a dry run creates no file
        lock.acquire()
    try:
        _gc_leftovers(root, foreign, dry_run)
        from ckpt.tiers.memory_gc import clear_stale

        for line in clear_stale(root, memory_root, dry_run):
            print(line)
        steps = _GcSteps(root)
        decision = rules.plan(
            [s for s in commit.steps(root) if _layout.step_name(s) not in foreign],
            policy,
            is_restorable=steps.is_restorable,
            may_evict=steps.may_evict,
            metrics=steps.metrics,
            latest=commit.read_latest(root),
        )
        _gc_apply(root, decision, steps.why_bad, dry_run)
    finally:
        lock.release()
    return 0


def _fetch(fs: Any, rpath: str, into: Path, *, data: bool) -> None:
    """Copy the remote checkpoint ``rpath`` into the local directory ``into`` (the manifest, and
    with ``data`` every file it names)."""
    (into / fmt.MANIFEST).write_bytes(bytes(fs.cat_file(f"{rpath}/{fmt.MANIFEST}")))
    if data:
        for rec in fmt.read_manifest(into)["files"]:
            dest = into / fmt.safe_relpath(rec["name"])
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{rpath}/{rec['name']}", str(dest))


_RemoteTarget = tuple[str, str, bool]
"""One remote checkpoint of ``ckpt ls|verify URL``: its label, its path, whether committed."""


def _remote_targets(fs: Any, root: str, shown: str, only: int | None) -> list[_RemoteTarget] | None:
    """The checkpoints under the remote ``root`` (itself, if it is one); ``None`` (reported) if
    there is no such remote directory."""
    from ckpt.remote import list_remote

    if fs.exists(f"{root}/{fmt.MANIFEST}"):
        return [(shown, root, True)]
    listing = list_remote(fs, root)
    if not listing:  # nothing listed: an empty root, or one that is missing or unreachable
        try:
            fs.ls(root)  # raises what the listing swallowed (a refused connection, DNS...)
        except FileNotFoundError:
            print(f"ckpt: {shown}: no such remote directory", file=sys.stderr)
            return None
    chosen = sorted(listing) if only is None else [only]
    return [
        (f"step {n}", f"{root}/{_layout.step_name(n)}", n in listing and listing[n].committed)
        for n in chosen
    ]


def _remote_check(
    command: str, fs: Any, rpath: str, where: str
) -> tuple[bool, str, dict[str, Any] | None]:
    """Fetch one committed remote checkpoint into a temporary directory and read (``ls``) or
    verify it: ``(ok, message, manifest body for ls)``, the temporary path replaced by
    ``where`` in the message."""
    with tempfile.TemporaryDirectory(prefix="ckpt-cli-") as tmp:
        try:
            _fetch(fs, rpath, Path(tmp), data=command == "verify")
            if command == "ls":
                return True, "", fmt.read_manifest(tmp)
            ok, msg, _ = _verify(Path(tmp))
        except (CheckpointError, OSError) as exc:
            ok, msg = False, str(exc)
        return ok, msg.replace(tmp, where), None


def _remote_one(command: str, fs: Any, target: _RemoteTarget, shown: str, metrics: bool) -> bool:
    """Print the line of one remote checkpoint; ``False`` if it is bad."""
    label, rpath, committed = target
    where = shown if label == shown else f"{shown}/{label.replace(' ', '-')}"
    name = "-" if label == shown else label[5:]
    if not committed:
        if command == "verify":
            print(f"{label}: FAILED: {where}: no manifest (not a checkpoint)")
            return False
        print(_row(name, None, "partial upload (no manifest, not a checkpoint)"))
        return True
    ok, msg, body = _remote_check(command, fs, rpath, where)
    if body is not None:
        print(_row(name, body, f"committed ({where})", metrics=metrics))
    elif command == "ls":
        print(_row(name, None, f"BAD: {msg}"))
    else:
        print(f"{label}: {'OK' if ok else 'FAILED'}: {msg}")
    return ok


def _remote_cmd(
    command: str, url: str, options: dict[str, Any], only: int | None, metrics: bool = False
) -> int:
    """``ckpt ls|verify URL``: a remote root of ``step-N`` prefixes, or one remote checkpoint."""
    from feedpipe.io import redact, resolve

    fs, root = resolve(url, options or None)
    shown = redact(url, options).rstrip("/")
    targets = _remote_targets(fs, root, shown, only)
    if targets is None:
        return 2
    if command == "ls":
        print(_HEADER)
    elif not targets:
        print(f"{shown}: no committed checkpoints")
        return 1
    bad = sum(not _remote_one(command, fs, target, shown, metrics) for target in targets)
    return 1 if bad else 0


def _parser() -> argparse.ArgumentParser:
    from feedpipe.io.cliargs import non_negative_int

    parser = argparse.ArgumentParser(prog="ckpt", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    where = "a checkpoint directory (DIR of step-N, or one checkpoint) or a URL (s3://...)"
    p_ls = sub.add_parser("ls", help="list steps, sizes, status and metadata")
    p_ls.add_argument("directory", help=where)
    p_ls.add_argument("--metrics", action="store_true", help="also show each step's metrics")
    p_ls.add_argument("--memory-root", default="/dev/shm", help="where the memory tier lives")
    p_verify = sub.add_parser("verify", help="check that every step restores (all checksums)")
    p_verify.add_argument("directory", help=where)
    p_verify.add_argument("--step", type=non_negative_int, default=None, help="only this step")
    for p in (p_ls, p_verify):
        add_storage_arguments(p, endpoint_help="S3-compatible endpoint for a URL", anon=True)
    _gc_arguments(sub.add_parser("gc", help="remove leftovers and old steps"))
    return parser


def _gc_arguments(p_gc: argparse.ArgumentParser) -> None:
    p_gc.add_argument("directory", help="a local checkpoint directory")
    p_gc.add_argument(
        "--keep-last",
        type=_keep_last,
        default=None,
        metavar="N",
        help="keep the newest N; none: no count limit, the other flags decide (with none of "
        "them, gc only removes leftovers and keeps every step). Without any --keep-* flag, gc "
        "applies the policy the directory's manager recorded, and refuses without one",
    )
    p_gc.add_argument("--keep-every", type=int, default=None, help="keep every multiple of N")
    p_gc.add_argument(
        "--keep-best", default=None, metavar="METRIC:K:min|max", help="keep the K best by METRIC"
    )
    p_gc.add_argument("--dry-run", action="store_true")
    p_gc.add_argument("--memory-root", default="/dev/shm", help="where the memory tier lives")


def _gc_policy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Policy | object | None:
    """The policy of ``gc``'s flags; ``_NO_FLAGS`` without any (the recorded one applies)."""
    if args.command != "gc" or (args.keep_last, args.keep_every, args.keep_best) == (None,) * 3:
        return _NO_FLAGS
    keep_last = None if args.keep_last == _NONE else args.keep_last
    try:
        return from_options(keep_last, args.keep_every, _keep_best(args.keep_best))
    except ValueError as exc:
        parser.error(str(exc).replace("KeepLast.n", "--keep-last").replace(
            "KeepEvery.n", "--keep-every"))  # fmt: skip


def _run_remote(args: argparse.Namespace, text: str) -> int:
    """``ls``/``verify`` of a URL; the client's own errors (botocore, aiohttp) as one line."""
    if args.command == "gc":
        print(f"ckpt: gc works on a local directory, not {_scrub(text, text)!r}", file=sys.stderr)
        return 2
    only = args.step if args.command == "verify" else None
    metrics = args.command == "ls" and args.metrics
    try:
        return _remote_cmd(args.command, text, storage_options(args), only, metrics)
    except CheckpointError:
        raise
    except Exception as exc:
        print(f"ckpt: {_scrub(text, text)}: {type(exc).__name__}: {_scrub(str(exc), text)}",
              file=sys.stderr)  # fmt: skip
        return 1


def _run_local(args: argparse.Namespace, text: str, policy: Policy | object | None) -> int:
    """``ls``/``verify``/``gc`` of a local directory."""
    try:
        root = local_path(text, "ckpt", "give the URL of a remote checkpoint as it is")
    except ValueError as exc:
        print(f"ckpt: {exc}", file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"ckpt: {_scrub(text, text)}: no such directory", file=sys.stderr)
        if args.command != "verify":  # the local disk lost: its memory tier may hold the state
            _ls_lost(root, args.memory_root)
        return 2
    if args.command == "ls":
        return _ls(root, args.metrics, args.memory_root)
    if args.command == "verify":
        return _verify_cmd(root, args.step)
    return _gc(root, policy, args.dry_run, args.memory_root)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckpt`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    policy = _gc_policy(args, parser)
    text: str = args.directory
    try:
        if is_url(text) and text[:5].lower() != "file:":
            return _run_remote(args, text)
        return _run_local(args, text, policy)
    except (CheckpointError, OSError) as exc:
        print(f"ckpt: {_scrub(str(exc), text)}", file=sys.stderr)
        return 1


_NONE = "none"


def _keep_last(text: str) -> int | str:
    """``--keep-last``: an int >= 1, or ``none`` for no count limit (``_NONE``). ``0`` is refused:
    it could be read as "keep no step", which retention never does."""
    if text.strip().lower() == _NONE:
        return _NONE
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected N >= 1 (or none: no count limit), got {n}")
    return n


def _keep_best(text: str | None) -> tuple[str, int, str] | None:
    """``METRIC:K:min|max`` as ``keep_best``'s tuple (``ValueError`` if malformed)."""
    if text is None:
        return None
    parts = text.split(":")
    k = parts[-2] if len(parts) >= 3 else ""
    if not (k.isascii() and k.isdigit() and int(k) >= 1) or parts[-1] not in ("min", "max"):
        raise ValueError(f"--keep-best: expected METRIC:K:min|max (K >= 1), got {text!r}")
    return ":".join(parts[:-2]), int(parts[-2]), parts[-1]


def _scrub(message: str, url: str) -> str:
    """``message`` without the credentials of ``url`` (its userinfo and password, also where a
    client quotes them outside a URL, e.g. inside a bucket name) and without any URL's."""
    from urllib.parse import urlsplit

    from feedpipe.io import redact

    try:
        userinfo = urlsplit(url).netloc.rpartition("@")[0]
    except ValueError:
        userinfo = ""
    for secret in (userinfo, userinfo.partition(":")[2]):
        if secret:
            message = message.replace(secret, "***")
    return redact(message)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

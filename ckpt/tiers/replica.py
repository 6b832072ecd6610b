"""``PeerReplica``: each rank also keeps the newest memory snapshot of rank ``(r + 1) mod W``.

With ``MemoryOptions(replica=True)`` and ``torch.distributed`` initialised, every snapshot a rank
commits to its memory tier is sent whole (its manifest and data files, as bytes) to rank
``(r - 1) mod W`` over a process group of its own (gloo, created once, collectively, when the
manager is built), and each rank keeps what it receives from rank ``(r + 1) mod W`` in a ckpt
root beside its own tier (``<tier>-peer``), written by the commit protocol and verified before
it is published: the replica of one rank lives on another node.

The call order (every rank, the same order; ``committed`` runs on the save thread, the rest on
the caller's): 0) ``PeerReplica(tier)`` on every rank; 1) ``committed(step, path)`` after each
memory commit: one send to the left, one receive from the right; 2) ``restore_exchange()`` at
the start of a restore (``CheckpointManager.restore`` calls it, so with ``replica=True`` restore
is collective): each rank sends the replica it holds back to its owner, and a rank whose memory
tier lacks that step (its node was lost) commits the copy, verified, into its memory tier, from
which the restore then reads. A replica is a verified copy: a corrupt one is dropped, never
restored.
"""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ckpt import _layout, _owner
from ckpt import format as fmt
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.saving import commit
from ckpt.tier_guard import check_tier, make_tier
from ckpt.tiers.memory_free import free_root

__all__ = ["PeerReplica", "unpack"]

log = logging.getLogger("ckpt")

_NONE = -1  # the step of an empty message: nothing held


def _pack(path: Path) -> tuple[int, torch.Tensor]:
    """The bytes of the committed step directory ``path``: each file framed by name and size."""
    parts: list[bytes] = []
    with commit.reading(path):
        body = fmt.read_manifest(path)
        names = [fmt.safe_relpath(rec["name"]) for rec in body["files"]] + [fmt.MANIFEST]
        for name in names:
            raw = (path / name).read_bytes()
            head = name.encode()
            parts += [len(head).to_bytes(8, "little"), head, len(raw).to_bytes(8, "little"), raw]
    blob = b"".join(parts)
    return int(body["step"]), torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def unpack(blob: torch.Tensor, into: Path) -> None:
    """Write the files framed in ``blob`` (``_pack``) into the new directory ``into``, each
    fsynced. Every file is written whole: one ``write`` moves at most 2 GiB on Linux (and any
    amount on a short write), so it loops; the blob is read in place, never copied."""
    raw, pos = blob.numpy().data, 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos : pos + 8], "little")
        name = fmt.safe_relpath(bytes(raw[pos + 8 : pos + 8 + n]).decode())
        pos += 8 + n
        size = int.from_bytes(raw[pos : pos + 8], "little")
        data = raw[pos + 8 : pos + 8 + size]
        if len(data) != size:
            raise CorruptCheckpointError(f"{into / name}: the replica's message is cut short")
        fd = commit.open_nofollow(into / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        pos += 8 + size


def _publish(blob: torch.Tensor, root: Path, step: int) -> Path:
    """Commit the snapshot in ``blob`` as ``root/step-N``, every CRC checked first."""
    make_tier(root)  # private, never a symlink or another user's
    _owner.claim_root(root)
    tmp: Path | None = commit.make_tmp(root, step)
    assert tmp is not None
    try:
        unpack(blob, tmp)
        for rec in fmt.read_manifest(tmp)["files"]:
            fmt.verify_file(tmp, rec)
        final = commit.publish(tmp, root, step)
        tmp = None
    finally:
        if tmp is not None:
            commit.remove_path(tmp)
    commit.write_latest(root, step)
    return final


class PeerReplica:
    """The ring of replicas of one rank's memory tier (module docstring).

    ``tier_dir``: this rank's memory tier; ``timeout_s``: how long a transfer may wait for a
    peer (a dead peer fails the save's post-commit action, naming the rank)."""

    def __init__(self, tier_dir: Path, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                "MemoryOptions(replica=True) needs torch.distributed initialised "
                "(init_process_group) before the CheckpointManager is built"
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tier_dir = tier_dir
        self.directory = tier_dir.with_name(tier_dir.name + "-peer")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.group: Any = dist.new_group(backend="gloo", timeout=timeout)  # collective
        self.left = (self.rank - 1) % self.world
        self.right = (self.rank + 1) % self.world
        self.lock = commit.WriterLock(self.directory)

    def _exchange(
        self, step: int, blob: torch.Tensor, to: int, source: int
    ) -> tuple[int, torch.Tensor]:
        """Send (``step``, ``blob``) to rank ``to`` and receive the same from rank ``source``."""
        import torch.distributed as dist

        head = torch.tensor([step, blob.numel()], dtype=torch.int64)
        got = torch.empty(2, dtype=torch.int64)
        try:
            sends = [dist.isend(head, to, group=self.group)]
            dist.recv(got, source, group=self.group)
            data = torch.empty(int(got[1]), dtype=torch.uint8)
            if blob.numel():
                sends.append(dist.isend(blob, to, group=self.group))
            if data.numel():
                dist.recv(data, source, group=self.group)
            for request in sends:
                if request is not None:
                    request.wait()
        except RuntimeError as exc:
            raise CheckpointError(
                f"rank {self.rank}: replica exchange with ranks {to} and {source} failed: {exc}"
            ) from exc
        return int(got[0]), data

    def committed(self, step: int, path: Path) -> None:
        """After this rank committed ``step`` to its memory tier: send it to the left, keep the
        right neighbour's (the older replica is then evicted)."""
        if self.world == 1:
            return
        _, blob = _pack(path)
        peer_step, data = self._exchange(step, blob, self.left, self.right)
        if peer_step == _NONE:
            return
        if not self.lock.held:
            make_tier(self.directory)
            _owner.claim_root(self.directory, {"replica_of_rank": self.right})
            self.lock.acquire(0.0)
            commit.remove_leftovers(self.directory)
        _publish(data, self.directory, peer_step)
        for old in commit.steps(self.directory):
            if old != peer_step:
                commit.evict(self.directory, old)

    def restore_exchange(self) -> int | None:
        """Send the held replica back to its owner; receive this rank's own and commit it into
        the memory tier if that holds no step as new; returns the step so committed, or
        ``None``."""
        if self.world == 1:
            return None
        held = commit.steps(self.directory) if self._safe() else []
        step, blob = _NONE, torch.empty(0, dtype=torch.uint8)
        if held:
            step, blob = _pack(_layout.step_dir(self.directory, held[-1]))
        mine, data = self._exchange(step, blob, self.right, self.left)
        if mine == _NONE or mine <= max(commit.steps(self.tier_dir), default=_NONE):
            return None
        try:
            _publish(data, self.tier_dir, mine)
        except CorruptCheckpointError as exc:
            log.warning(
                "ckpt: rank %d: the replica of step %d is corrupt: %s", self.rank, mine, exc
            )
            return None
        log.warning("ckpt: rank %d: step %d restored into the memory tier from rank %d's replica",
                    self.rank, mine, self.left)  # fmt: skip
        return mine

    def _safe(self) -> bool:
        """Whether the replica directory exists and is this user's own (else, warned: nothing
        of it is sent; the exchange is collective, so this rank takes part all the same)."""
        try:
            return check_tier(self.directory)
        except CheckpointError as exc:
            log.warning("ckpt: rank %d: replica not sent: %s", self.rank, exc)
            return False

    def free(self) -> None:
        """Delete the replica held (at the clean end of the run; lock held)."""
        if self.lock.held:
            free_root(self.directory, self.lock)

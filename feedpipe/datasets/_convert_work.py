"""The work folder of ``feedpipe convert`` (``DEST.partial``): its plan, its parts, the merge.

``plan.json`` says what is being converted (the source's fingerprint, the part boundaries and
``shard_bytes``); each part is a small dataset in ``part-NNNNN``, complete once its own index
exists. A folder holding another plan of ours is started over; one that is not ours is refused.
:meth:`WorkFolder.merge` hard-links the parts' shard files into place with global shard numbers
and writes the index last.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from feedpipe.datasets.shard_names import shard_name
from feedpipe.errors import DatasetError
from feedpipe.format import FileInfo, Index, Shard, read_index, write_index

__all__ = ["PLAN_NAME", "WorkFolder"]

PLAN_NAME = "plan.json"


class WorkFolder:
    """``DEST.partial``: where one conversion's parts are written, resumable after a crash."""

    def __init__(self, path: str, nparts: int) -> None:
        self.path = path
        self.plan_path = os.path.join(path, PLAN_NAME)
        self.parts = [os.path.join(path, f"part-{k:05d}") for k in range(nparts)]

    def open(self, plan: dict[str, Any]) -> list[int]:
        """Resume the conversion of ``plan`` here, or start afresh; the complete parts."""
        plan = json.loads(json.dumps(plan))
        old_plan = self._read_plan()
        if old_plan != plan and os.path.exists(self.path):
            shutil.rmtree(self.path)  # a different conversion of ours was interrupted here
        os.makedirs(self.path, exist_ok=True)
        if old_plan != plan:
            with open(self.plan_path + ".tmp", "w") as f:
                json.dump(plan, f)
            os.replace(self.plan_path + ".tmp", self.plan_path)
        return [k for k, part in enumerate(self.parts) if _complete(part)]

    def _read_plan(self) -> Any:
        """The plan of an interrupted conversion here; refuse a folder that is not ours."""
        if not os.path.lexists(self.path):
            return None
        if os.path.islink(self.path) or not os.path.isdir(self.path):
            raise DatasetError(
                f"{self.path}: exists and is not a feedpipe conversion folder; move it away"
            )
        try:
            with open(self.plan_path) as f:
                return json.load(f)
        except FileNotFoundError:
            if os.listdir(self.path):
                raise DatasetError(
                    f"{self.path}: exists and is not a feedpipe conversion folder (no "
                    f"{PLAN_NAME}); move it away"
                ) from None
            return None
        except (ValueError, RecursionError):
            return {}  # our plan, damaged: start over

    def merge(self, extra: dict[str, Any]) -> Index:
        """Hard-link the parts' shard files here with global shard numbers; write the index;
        remove the parts and the plan (the folder is then a dataset)."""
        shards: list[Shard] = []
        index: Index | None = None
        for part in self.parts:
            index = read_index(part)
            shards.extend(self._link(part, shard, len(shards)) for shard in index.shards)
        assert index is not None
        merged = Index(index.layout, index.fields, shards, extra)
        write_index(self.path, merged)
        for part in self.parts:
            shutil.rmtree(part)
        os.unlink(self.plan_path)
        return merged

    def _link(self, part: str, shard: Shard, sid: int) -> Shard:
        files = {}
        for role, info in shard.files.items():
            rel = shard_name(sid, info.path.split(".", 1)[1])
            dst = os.path.join(self.path, rel)
            if os.path.exists(dst):
                os.unlink(dst)
            os.link(os.path.join(part, info.path), dst)
            files[role] = FileInfo(rel, info.bytes, info.crc32c)
        return Shard(shard.records, files)


def _complete(part_dir: str) -> bool:
    try:
        read_index(part_dir)
    except DatasetError:
        return False
    return True

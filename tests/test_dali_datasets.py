"""Picklable in-memory datasets for tests/test_dali.py (no tests here).

They live in their own light module (numpy only) so DALI's spawned worker processes, which
unpickle them, start without importing torch or the test module.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BytesDataset", "ExplodingDataset", "HangingDataset"]


class BytesDataset:
    """An in-memory dataset of encoded images: ``ds[i] -> (uint8 array, label i)``."""

    def __init__(self, records: list[bytes], path: str = "mem://images") -> None:
        self.records = records
        self.path = path

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.frombuffer(self.records[i], dtype=np.uint8), i

    def locate(self, i: int) -> tuple[int, int]:
        return i // 8, i % 8  # pretend shards of 8 records


class ExplodingDataset(BytesDataset):
    """Record 2 cannot be read (as a dataset with a checksum mismatch would report)."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == 2:
            raise OSError(f"checksum mismatch in shard 0 at record {i}")
        return super().__getitem__(i)


class HangingDataset(BytesDataset):
    """Record 5 never comes back (a stuck network filesystem, say); a worker that reaches it
    first creates the file ``marker`` when one is given."""

    marker: str | None = None

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == 5:
            import time

            if self.marker is not None:
                open(self.marker, "a").close()
            time.sleep(3600)
        return super().__getitem__(i)

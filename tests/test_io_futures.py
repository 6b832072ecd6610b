"""feedpipe.io.futures.results_or_first_error: every result in order, or the first error with
nothing left running (ckpt's chunk reads and multipart uploads go through it)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from feedpipe.io.futures import results_or_first_error


def test_results_come_in_submission_order() -> None:
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(lambda i=i: (time.sleep(0.01 * (5 - i)), i)[1]) for i in range(5)]
        assert results_or_first_error(futures) == [0, 1, 2, 3, 4]


def test_the_first_error_is_raised_after_every_running_job_ended() -> None:
    running = threading.Semaphore(0)
    ended: list[int] = []

    def job(i: int) -> int:
        if i == 0:
            running.acquire(timeout=5)  # fail once job 1 is running
            raise OSError("chunk 0 is bad")
        running.release()
        time.sleep(0.2)
        ended.append(i)
        return i

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(job, i) for i in range(50)]
        with pytest.raises(OSError, match="chunk 0 is bad"):
            results_or_first_error(futures)
        assert all(f.done() for f in futures)  # nothing still running when it raised
        assert 1 in ended and len(ended) < 49  # the queued jobs were cancelled, not run

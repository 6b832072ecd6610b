"""``feedpipe.loader``: the DataLoader and the machinery behind ``iter(loader)``.

The loader is three objects: the frozen ``LoaderPlan`` its arguments resolve to, a ``Pass``
per ``iter()``, and the per-batch pipeline its iterator runs. Modules, in the order a batch
meets them (docs/architecture.md has the map):

- :mod:`~feedpipe.loader.plan`: ``LoaderPlan``, the configuration resolved once (worker kind,
  collation path, device path, sampler chain, failure policy).
- :mod:`~feedpipe.loader.resume`: ``Resume``, a pending state, its RNG replay, the skip ledger.
- :mod:`~feedpipe.loader.index_stream`: index batches from the sampler, vectorised, resumable.
- :mod:`~feedpipe.loader.sources`: ``WorkerSources``, which starts each pass's workers.
- :mod:`~feedpipe.loader.fetch`: one worker's read of one index batch (timed, failures recorded).
- :mod:`~feedpipe.loader.threads`: thread workers and the inline (``num_workers=0``) source;
  process workers are torch's own iterator over the wrappers in ``fetch``.
- :mod:`~feedpipe.loader.loader_pass`: ``Pass``, what one ``iter()`` owns, and its ``Epoch``.
- :mod:`~feedpipe.loader.pipeline`: the per-batch steps (fetch, failure policy, timing, device
  hand-off, finalise); :mod:`~feedpipe.loader.skip_iter`: the ``on_error="skip"`` policy.
- :mod:`~feedpipe.loader.iterator`: what ``iter(loader)`` returns, running the pipeline.
- :mod:`~feedpipe.loader.rng_state`: the RNG states a resume restores.
- :mod:`~feedpipe.loader._torch_compat`: every touch of torch's private API, in one place.
- :mod:`~feedpipe.loader.dataloader`: :class:`DataLoader` itself.
"""

from feedpipe.loader.dataloader import DataLoader
from feedpipe.loader.fetch import get_worker_info

__all__ = ["DataLoader", "get_worker_info"]

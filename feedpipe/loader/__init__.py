"""``feedpipe.loader``: the DataLoader and the machinery behind ``iter(loader)``.

Modules, in the order a batch meets them (docs/architecture.md has the map):

- :mod:`~feedpipe.loader.index_stream`: index batches from the sampler, vectorised, resumable.
- :mod:`~feedpipe.loader.fetch`: one worker's read of one index batch (timed, failures recorded).
- :mod:`~feedpipe.loader.threads`: thread workers and the inline (``num_workers=0``) source;
  process workers are torch's own iterator over the wrappers in ``fetch``.
- :mod:`~feedpipe.loader.iterator`: what ``iter(loader)`` returns.
- :mod:`~feedpipe.loader.rng_state`: the RNG states a resume restores.
- :mod:`~feedpipe.loader._torch_compat`: every touch of torch's private API, in one place.
- :mod:`~feedpipe.loader.dataloader`: :class:`DataLoader` itself.
"""

from feedpipe.loader.dataloader import DataLoader
from feedpipe.loader.fetch import get_worker_info

__all__ = ["DataLoader", "get_worker_info"]

"""``feedpipe.device``: getting batches onto the accelerator.

- :mod:`~feedpipe.device.feed`: :class:`GPUFeed`, the side-stream prefetch behind
  ``DataLoader(device=...)`` (public path ``feedpipe.gpu``).
- :mod:`~feedpipe.device.ring`: the pinned-memory ring of slots the feed copies from.
- :mod:`~feedpipe.device.direct`: the direct path, records read by the GPU out of the page cache.
- :mod:`~feedpipe.device.hostreg`: every host-memory registration with CUDA, exception-safe.
- :mod:`~feedpipe.device.dma`: shard-map registration and batched copies for a memmap dataset
  (a lower layer: datasets import it).

Importing this package imports none of them.
"""

__all__: list[str] = []

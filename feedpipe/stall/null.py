"""The meter that records nothing: what ``StallMeter(enabled=False)`` returns.

It is defined beside :class:`~feedpipe.stall.meter.StallMeter` (whose constructor returns it);
this is its public path.
"""

from __future__ import annotations

from feedpipe.stall.meter import NullMeter

__all__ = ["NullMeter"]

"""``RestorePlan``: what ``restore(into=)`` will write, decided before the first byte is written
(the public path of ``ckpt.restoring.plan``; see there)."""

from ckpt.restoring.plan import IncompatibleKeys, RestorePlan

__all__ = ["IncompatibleKeys", "RestorePlan"]

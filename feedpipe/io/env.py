"""Boolean environment variables: one reading of yes and no for feedpipe and ckpt.

``1``, ``true``, ``yes``, ``on`` are true and ``0``, ``false``, ``no``, ``off`` false, in any
case, surrounding spaces ignored. An empty value is false too, except for a *strict* variable,
which must name one of the words: there anything else (the empty value included) is a
``ValueError`` naming the variable and its value. For a lenient variable, any other value
means the variable's default (what unset means).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "env_flag"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_flag(
    name: str,
    default: bool | None = False,
    *,
    strict: bool = False,
    meaning: tuple[str, str] = ("false", "true"),
    environ: Mapping[str, str] | None = None,
) -> bool | None:
    """The variable ``name`` as a boolean (see the module docstring); ``default`` when unset.

    ``meaning`` names what false and true do, for a strict variable's error message.
    """
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS or (not word and not strict):
        return False
    if strict:
        raise ValueError(
            f"{name}={raw!r}: expected one of {', '.join(FALSE_WORDS)} ({meaning[0]}) or "
            f"{', '.join(TRUE_WORDS)} ({meaning[1]})"
        )
    return default

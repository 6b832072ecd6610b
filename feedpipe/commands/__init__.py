"""The ``feedpipe`` command's subcommands that are not a library function's own CLI.

``feedpipe inspect`` lives here (``inspect``); ``convert``, ``stage`` and ``bench`` keep their
``add_arguments``/``run`` next to the function they call. Nothing is imported at import time.
"""

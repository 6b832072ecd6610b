"""Remote datasets on local disk: the shared node cache (``cache``) and staging (``stage``).

The public names are reached as ``feedpipe.ShardCache`` and ``feedpipe.stage``; this package
imports nothing at import time.
"""

"""Storage tiers beyond the local disk: the remote tier (``remote``: its ``store``,
``upload_queue``, ``uploader``, ``remote_retention`` and ``status`` mirror) and its S3 uploader
(``s3put``)."""

"""Storage tiers beyond the local disk: the remote tier and its S3 uploader."""

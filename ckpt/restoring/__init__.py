"""Restoring a checkpoint: the restore plan, the reader, reading into existing tensors."""

"""Restoring a checkpoint: the restorer (which step, which tier), the restore plan, the reader,
reading into existing tensors, DCP's items read safely."""

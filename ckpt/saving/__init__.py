"""Saving a checkpoint: flatten the state, plan the copy, the pinned pool, the atomic commit."""

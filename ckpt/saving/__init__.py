"""Saving a checkpoint: flatten the state, plan the copy (``SavePlan``), the pinned pool, the
save pipeline (stage, write, commit in the background), the atomic commit."""

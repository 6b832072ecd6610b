"""Which steps are kept: the retention rule and the manager's retention pass."""

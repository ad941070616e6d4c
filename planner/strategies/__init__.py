"""One module per parallel strategy, planner side (candidates, validity, layer cost, stage bounds,
gradient sync, memory), behind the protocol of base.py, listed in registry.py, with the one table
of which strategies combine in combinations.py."""

"""One module per parallel strategy, at run time: what each attaches to the stage modules and
process groups (runtime/parallel/base.py says how; registry.py lists them)."""

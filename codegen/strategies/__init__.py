"""One module per parallel strategy, for the lowering: what each does to a plan's Programs
(codegen/strategies/base.py says how; registry.py lists them)."""

"""Bi-directional (GEMS) pipelines at run time: the executor runs the two pipelines as the Program's
instructions say; `strategy` declares what the runtime does not do with them (held-out evaluation)."""

"""Context parallelism in the lowering, in one home: `strategy` (the LoweringStrategy) and
`stage_code` (the attention rewritten for sequence chunks, and the ContextSpec).

The package itself imports nothing, so importing one of its modules loads only what that needs."""

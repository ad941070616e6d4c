"""Context parallelism at run time, in one home: `strategy` (what it attaches: the context group,
the sequence chunks and the targets' order), `attention` (the attention the generated stage code
calls), `ring` (ring attention's exchange) and `layout` (which sequence chunks a rank holds).

The package itself imports nothing, so importing one of its modules loads only what that needs."""

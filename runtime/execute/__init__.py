"""What a rank does inside a training step, beyond walking its Program (runtime/executor.py, which
stays at runtime/'s top because torch builds import it): the stage runner, gradient buckets and
their sync, the gradient step (unscale, norm, clip, skip), the optimizer and lr schedule, loss
scaling, the chunked loss and output head, compiled stages, tied weights, BatchNorm statistics,
evaluation, and the device clock and memory tracking. The package itself imports nothing."""

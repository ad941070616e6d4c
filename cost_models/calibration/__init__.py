"""Calibration: measure this machine with the runtime and fit the Cluster's constants.

The only part of cost_models that runs the runtime (its stage runner, executor and
communicators); pricing reads the fitted figures through cost_models/calibrated.py.

    calibrate.py  `meshplan calibrate`: start the rank processes, fit, build the Cluster
    worker.py     one rank process: every measurement, at the same time on every rank
    ops.py        per-op-kind compute timings and their fit
    stage.py      the runtime's fixed costs: a stage call, the loss, ZERO_GRAD, tensor-parallel wrappers
    executor.py   the executor's own time per instruction, from a traced reference pipeline
    curves.py     the op curves (cost_models/op_curves.py) and the probe block
    gpu_ops.py    one GPU's op table (GEMMs, attention, norms, the loss, AdamW, copies, host costs), CUDA events
    gpu_families.py  each op family of that table: its inputs, its call, the work its rate divides by
    gpu_calibrate.py  `meshplan calibrate --device cuda`: that op table and the one-device Cluster carrying it
"""

"""The torch target: a plan applied with PyTorch's own parallel stack (DeviceMesh, DTensor
tensor/sequence parallel styles, FSDP2, torch.distributed.pipelining, activation checkpointing, DCP).

layout.py: `torch_layout(plan, graph)`, the one derivation of a plan's torch layout (its records,
`TorchLayout` and the rest, in records.py; the split modules' styles from the strategy that splits them,
codegen/strategies/tensor/torch_styles.py), applied by planner.parallelize (through runtime/torch_stack)
and written out by the torch script. pipeline.py: `pipeline_layout(plan, graph)`, the layout's pipeline cut by meshplan's own
partition, and `rank_pipeline`, this rank's stages of it. Importing this package does no work.
"""

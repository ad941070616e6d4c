"""A plan's torch layout applied to the user's model with PyTorch's own parallel stack.

The apply side of the torch target: functions that take plain data (a TorchLayout's `to_dict()`,
codegen/torch_target/layout.py) and the user's nn.Module, and import no other meshplan package
than runtime.

vocab.py      the layout's enums (tensor-parallel style, data-parallel wrapper)
mesh.py       the DeviceMesh of a layout, built or checked
tensor.py     tensor and sequence parallel styles by module path (parallelize_module), ties restored
recompute.py  activation checkpointing of the layout's blocks
data.py       replicate / fully_shard over the data axis
apply.py      all of the above in torch's order (tensor, checkpointing, data)
grad_norm.py  clip_grad_norm_ correct across DTensors on different meshes
dcp.py        Distributed Checkpoint save and load that reshard between plans
pipeline_layout.py  a plan's pipeline as plain data (PipelineLayout: schedule, stages, their class source)
pipeline.py   this rank's stages (the model's own tensors) in PipelineStages under the plan's schedule
"""

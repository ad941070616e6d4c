"""Runtime: executes per-rank Programs over torch.distributed (NCCL, gloo)
or MPI. Depends on no other meshplan package."""

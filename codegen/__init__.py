"""Code generation: lowers a Plan into one Program per rank and emits
readable rank scripts plus launchers (torchrun, mpirun, srun)."""

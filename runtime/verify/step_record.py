"""What a rank records each step of a `--verify` run, for the per-step check (runtime/verify/__init__.py).

Just before the optimizer step, every parameter the optimizer holds (a whole parameter, or
under ZeRO this rank's flat shard of a bucket) still has the value it had when the step
began, and its gradient is complete: reduced over data, tied copies summed, divided by the
fp16 loss scale and not yet clipped (runtime/execute/grad_step.py). The recorder
copies both, with the buffers (BatchNorm's running statistics) at the step's start and end.
`runtime.checkpoint.restore.assemble_files` turns every rank's record of a step into whole
tensors by the model's own names, as it does a checkpoint's rank files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.checkpoint import optimizer_param_names


def _buffers(modules: dict) -> dict[str, dict[str, torch.Tensor]]:
    return {str(s): {k: v.detach().cpu().clone() for k, v in m.named_buffers()} for s, m in modules.items()}


class StepRecorder:
    """Copies of one rank's optimizer parameters, gradients and buffers, step by step.

    Args:
        program: the rank's Program; specs: stage -> StageSpec; modules: stage -> module.
        grads: the rank's GradSync (None without a data axis); params: what the optimizer steps,
            in its order.
    """

    def __init__(self, program, specs: dict, modules: dict, grads, params: list):
        self._modules = modules
        self._grads = grads
        self._params = params
        self._names = optimizer_param_names(modules, grads, params)
        named = {f"{s}/{n}": p for s, m in modules.items() for n, p in m.named_parameters()}
        self._header = {
            "coords": list(program.coords), "stage_specs": {str(s): json.dumps(specs[s].to_dict()) for s in specs},
            "buckets": [{"stage": b.stage, "params": list(b.params)} for b in program.buckets],
            "optimizer_params": self._names,
            "shapes": {k: list(named[k].shape) for k in self._names if k in named}
            | {f"{b.stage}/{n}": list(dict(modules[b.stage].named_parameters(remove_duplicate=False))[n].shape)
               for b in program.buckets for n in b.params},
        }
        self._steps: list[dict] = []
        self._current: dict | None = None

    def start(self, step: int) -> None:
        self._current = {"step": step, "buffers_start": _buffers(self._modules)}

    def before_step(self) -> None:
        """Called by the executor at STEP, before the optimizer changes anything."""
        state = {}
        for i, p in enumerate(self._params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            state[i] = {"value": p.detach().cpu().clone(), "grad": g.detach().cpu().clone()}
        self._current["optimizer"] = {"state": state}

    def end(self, loss: float) -> None:
        self._current["buffers"] = _buffers(self._modules)
        self._current["loss"] = loss
        self._steps.append(self._current)
        self._current = None

    def save(self, path: Path) -> None:
        torch.save({**self._header, "steps": self._steps}, path)


def load_records(run_dir: Path, world_size: int) -> list[dict]:
    """Every rank's records (rank order), as saved by StepRecorder.save."""
    out = []
    for r in range(world_size):
        f = Path(run_dir) / f"steps_rank_{r:04d}.pt"
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: rank {r} did not record its steps (--save-steps)")
        out.append(torch.load(f, weights_only=True))
    return out


def step_files(records: list[dict], k: int) -> list[dict]:
    """Each rank's record of its k-th recorded step, in the form assemble_files reads."""
    files = []
    for rec in records:
        st = rec["steps"][k]
        files.append({**{key: v for key, v in rec.items() if key != "steps"}, "params": {},
                      "buffers": st["buffers"], "optimizer": st["optimizer"]})
    return files

"""Spatial-parallel training cases on real processes (gloo), and their single-process reference.

One set of `world` processes runs every case in turn (Python and torch start once). A case is a
LargeImageCNN (kernels 1, 3, 5; strides 1, 2; a 2x2 max pool) split into tiles up to and including
the pool, on a mesh (data, spatial) with spatial fastest: ranks 2k and 2k+1 share an image when the
spatial degree is 2 and the world is 4 (spatial 2 x data 2). The reference runs the same model,
seed and data in one process, one micro-batch per data rank, gradients accumulated.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_LAYERS = ((4, 3, 1), (4, 5, 2), (4, 1, 1), (4, 1, 2), (4, 3, 2), (4, 3, 1))
STEPS = 3


@dataclass(frozen=True)
class Case:
    name: str
    image: int
    split: str
    spatial: int
    data: int
    batch: int = 2                 # global batch
    until: str = "pool"            # last fx node of the spatial part
    batchnorm: str = "sync"
    layers: tuple = MODEL_LAYERS
    model: str = "cnn"             # "cnn" (LargeImageCNN) or "resnet" (PreActResNet-8, ImageNet stem)


def build_model(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    if case.model == "resnet":
        from examples.models import resnet

        return resnet.build(depth=8, width=4, image_size=case.image, in_channels=2, num_classes=3, stem="imagenet")
    from examples.models.large_image_cnn import build

    return build(image_size=case.image, layers=case.layers, num_classes=3, in_channels=2)


def batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(case.batch, 2, case.image, case.image, generator=g),
            torch.randint(0, 3, (case.batch,), generator=g))


def reference(case: Case) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process: per step, one micro-batch per data rank, loss / data, one SGD step."""
    model = build_model(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    per = case.batch // case.data
    for step in range(STEPS):
        x, y = batch(case, step)
        opt.zero_grad()
        total = 0.0
        for k in range(case.data):
            loss = torch.nn.functional.cross_entropy(model(x[k * per:(k + 1) * per]), y[k * per:(k + 1) * per])
            (loss / case.data).backward()
            total += float(loss.detach()) / case.data
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def run_rank(rank: int, world: int, port: int, cases: list[Case], out: str) -> None:
    """One rank: every case in turn; writes out/<case>_rank<r>.pt with losses and parameters."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from codegen.strategies.spatial.tiles import tile_model
    from runtime.comm.torch_dist import TorchCommunicator
    from runtime.parallel.spatial.geometry import TileLayout

    comm = TorchCommunicator("gloo", rank, world, "127.0.0.1", port, timeout=60)
    try:
        for case in cases:
            s, d = case.spatial, case.data
            assert s * d == world
            dc, sc = divmod(rank, s)
            sgroup = comm.group([dc * s + j for j in range(s)])
            dgroup = comm.group([k * s + sc for k in range(d)])
            everyone = comm.group(range(world))
            model = build_model(case)
            per = case.batch // d
            net = tile_model(model, (torch.empty(per, 2, case.image, case.image, device="meta"),), case.until,
                             case.split, s, batchnorm=case.batchnorm)
            net.spatial.attach(TileLayout.for_group(case.split, sgroup), sgroup, comm)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            losses = []
            for step in range(STEPS):
                x, y = batch(case, step)
                x, y = x[dc * per:(dc + 1) * per], y[dc * per:(dc + 1) * per]
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(x), y)
                # every gradient is a partial sum over data x spatial (the gather's backward sums over the tiles)
                (loss / (d * s)).backward()
                for p in net.parameters():
                    everyone.all_reduce(p.grad, "sum")
                lt = loss.detach().reshape(1) / d
                dgroup.all_reduce(lt, "sum")
                losses.append(float(lt))
                opt.step()
            torch.save({"losses": losses, "params": {k: v.detach().clone() for k, v in net.named_parameters()}},
                       Path(out) / f"{case.name}_rank{rank}.pt")
    finally:
        comm.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases: list[Case], world: int, out: Path) -> dict[str, list[dict]]:
    """Run `cases` on `world` spawned processes; per case, every rank's saved result."""
    import torch.multiprocessing as mp

    mp.start_processes(run_rank, args=(world, free_port(), cases, str(out)), nprocs=world, join=True,
                       start_method="spawn")
    return {c.name: [torch.load(out / f"{c.name}_rank{r}.pt") for r in range(world)] for c in cases}

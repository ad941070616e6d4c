"""Measured activation memory of spatial tiles against the cost model's prediction.

    python benchmarks/spatial_memory.py [--side 1024] [--tiles 4]

LargeImageCNN (6 ConvBNReLU layers, kernels 1/3/5, strides 1/2, then a 2x2 max pool) on one
side x side image, fp32. The whole network up to the pool runs on `tiles` tiles (2x2 grid for 4)
on real gloo processes, the head (global average pool, Linear) replicated after the gather. Each
process counts the bytes autograd saves for backward during one forward pass of the whole model
(torch.autograd.graph.saved_tensors_hooks, distinct storages); the same count is taken for the
unsplit model in one process. Reported: the measured ratio tile / whole beside the cost
model's (planner.Evaluator: saved activations of the spatial layers divided by the tiles).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

LAYERS = ((16, 3, 1), (16, 5, 2), (16, 1, 1), (16, 3, 2), (16, 1, 2), (16, 3, 1))


def saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while fn() runs forward."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def model(side: int):
    from examples.models.large_image_cnn import build

    torch.manual_seed(0)
    return build(image_size=side, layers=LAYERS, num_classes=3, in_channels=3)


def rank_main(rank: int, world: int, port: int, side: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from codegen.strategies.spatial.tiles import tile_model
    from runtime.comm.torch_dist import TorchCommunicator
    from runtime.parallel.spatial.geometry import TileLayout

    comm = TorchCommunicator("gloo", rank, world, "127.0.0.1", port, timeout=120)
    try:
        group = comm.group(list(range(world)))
        x = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(1))
        net = tile_model(model(side), (x,), "pool", "grid", world)
        net.spatial.attach(TileLayout.for_group("grid", group), group, comm)
        b = saved_bytes(lambda: net(x))   # the whole forward: tiles, gather, replicated head
        Path(out, f"rank{rank}.txt").write_text(str(b))
    finally:
        comm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--tiles", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import torch.multiprocessing as mp

    import planner
    from planner.evaluator import Evaluator
    from examples.models import large_image_cnn

    whole_model = model(args.side)
    x = torch.randn(1, 3, args.side, args.side)
    whole = saved_bytes(lambda: whole_model(x))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    mp.start_processes(rank_main, args=(args.tiles, port, args.side, out), nprocs=args.tiles, join=True,
                       start_method="spawn")
    tiles = [int(Path(out, f"rank{r}.txt").read_text()) for r in range(args.tiles)]

    g = planner.capture(large_image_cnn.build(image_size=args.side, layers=LAYERS, num_classes=3),
                        large_image_cnn.example_inputs(1, "meta", image_size=args.side, layers=LAYERS,
                                                       num_classes=3))
    ev = Evaluator(g, planner.Cluster.preset("local", devices=args.tiles))
    cfg = planner.ParallelConfig(spatial=args.tiles, spatial_split="grid", spatial_until="pool", dtype="fp32")
    base = planner.ParallelConfig(dtype="fp32")
    pred_whole = sum(ev.layer_cost(layer, base).saved for layer in g.layers)
    pred_tile = sum(ev.layer_cost(layer, cfg).saved for layer in g.layers)
    mib = 2**20
    print(f"LargeImageCNN {args.side}x{args.side}, {args.tiles} tiles (grid), fp32, batch 1")
    print(f"  measured saved activations: whole {whole / mib:.1f} MiB, tiles "
          + ", ".join(f"{t / mib:.1f}" for t in tiles) + " MiB")
    print(f"  measured largest tile / whole: {max(tiles) / whole:.3f}   (1/{args.tiles} = {1 / args.tiles:.3f})")
    print(f"  predicted: whole {pred_whole / mib:.1f} MiB, tile {pred_tile / mib:.1f} MiB, ratio "
          f"{pred_tile / pred_whole:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a rank process runs, as its launcher says: its node, the launch's nodes, its GPU.

Pure functions of the environment, so that every rank reaches the same verdict without
talking to the others:

* `placement(env)`: this process's node index, the launch's node count, and its place on
  its node, from the variables torchrun (GROUP_RANK, GROUP_WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE), Slurm (an srun step's SLURM_NODEID, SLURM_STEP_NUM_NODES,
  SLURM_LOCALID) or Open MPI (OMPI_COMM_WORLD_LOCAL_RANK / _LOCAL_SIZE; nodes = world /
  local size, ranks filled node by node) set; `meshplan run`'s ranks are on one machine.
* `check_nodes`: a launch over several nodes must have the plan's node count (the plan
  places its groups by node: rank r on node r // devices_per_node). One machine may run
  any plan (that is how plans are tried out).
* `cuda_index(env, visible)`: the CUDA device of a rank. A task that sees one GPU (Slurm's
  --gpus-per-task=1 or a per-task CUDA_VISIBLE_DEVICES) uses cuda:0; one that sees its
  node's GPUs uses its local rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


class PlacementError(ValueError):
    """The processes were placed on nodes (or GPUs) in a way the plan cannot run on."""


@dataclass(frozen=True)
class Placement:
    """This process's place in the launch; None where the launcher does not say.

    node: this process's node index (0 .. nodes-1); nodes: the launch's node count;
    local_rank / local_size: its index among its node's processes and their number;
    launcher: which launcher's variables these came from ("torchrun", "slurm", "open mpi", "").
    """

    node: int | None = None
    nodes: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    launcher: str = ""


def _int(env: dict, name: str) -> int | None:
    v = str(env.get(name, "")).strip()
    return int(v) if v.isdigit() else None


def _first(env: dict, names: tuple[str, ...]) -> int | None:
    for n in names:
        if (v := _int(env, n)) is not None:
            return v
    return None


def placement(env: dict) -> Placement:
    """This process's Placement from its launcher's environment variables."""
    if "MESHPLAN_LAUNCHER_PID" in env:   # a rank of `meshplan run` (runtime/lifetime.py): this one machine
        return Placement(0, 1, _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"), "meshplan run")
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_WORLD_SIZE" in env:
        return Placement(_int(env, "GROUP_RANK"), _int(env, "GROUP_WORLD_SIZE"), _int(env, "LOCAL_RANK"),
                         _int(env, "LOCAL_WORLD_SIZE"), "torchrun")
    if "SLURM_STEP_NUM_NODES" in env:   # a task of an srun step (not the batch script itself)
        nodes = _int(env, "SLURM_STEP_NUM_NODES")
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
        node = _int(env, "SLURM_NODEID")
        local = per_node[node] if per_node and node is not None and node < len(per_node) else None
        return Placement(node, nodes, _int(env, "SLURM_LOCALID"), local, "slurm")
    size, local_size = _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if size is not None and local_size:
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        return Placement(None if rank is None else rank // local_size, -(-size // local_size),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), local_size, "open mpi")
    return Placement(local_rank=_first(env, _LOCAL_RANK_VARS))


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list ("2(x3),1" -> [2, 2, 2, 1]); [] if unreadable."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        count, _, times = part.partition("(x")
        if not count.isdigit() or (times and not times.rstrip(")").isdigit()):
            return []
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def check_nodes(where: Placement, plan_nodes: int | None, devices_per_node: int | None) -> None:
    """Refuse a launch over several nodes whose node count is not the plan's (PlacementError).

    plan_nodes / devices_per_node: the plan's cluster (None: a build that does not record it)."""
    if not plan_nodes or not where.nodes or where.nodes == 1 or where.nodes == plan_nodes:
        return
    per = f" of {devices_per_node} processes" if devices_per_node else ""
    raise PlacementError(
        f"this launch spans {where.nodes} nodes ({where.launcher or 'launcher'}), but the plan was made for "
        f"{plan_nodes} node(s){per}: its groups are placed by node. Launch it on {plan_nodes} node(s){per}, "
        f"or make the plan for {where.nodes} nodes (meshplan cluster ... --nodes {where.nodes}) and generate "
        "the build again")


def node_of(rank: int, devices_per_node: int | None) -> int | None:
    """The node the plan puts `rank` on (ranks fill nodes in order), None if the plan does not say."""
    return rank // devices_per_node if devices_per_node else None


def cuda_index(env: dict, visible: int) -> int:
    """The index of this rank's CUDA device among the `visible` ones it can see.

    One visible device (per-task binding: srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per
    task) is cuda:0 whatever the local rank; otherwise the local rank's device (torchrun's
    LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK). Raises PlacementError when the local
    rank has no device of its own."""
    if visible < 1:
        raise PlacementError("this process sees no CUDA device (CUDA_VISIBLE_DEVICES="
                             f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')!r}); use --backend gloo on CPUs")
    if visible == 1:
        return 0
    local = _first(env, _LOCAL_RANK_VARS)
    local = 0 if local is None else local
    if local >= visible:
        raise PlacementError(
            f"this process is local rank {local} of its node but sees {visible} CUDA devices (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')!r}): start at most {visible} processes per node, or give "
            "each task one GPU of its own (srun --gpus-per-task=1)")
    return local

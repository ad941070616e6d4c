"""Build the model, or only one stage's slice of it, from a model reference.

See runtime/spec.py for the three initialisations ("seed", "per-module",
"checkpoint") and which single-process model each one equals.

A stage module is an instance of the stage class the rank script defines
(its forward is the code generated from the fx graph); the model's modules
that code calls are attached to it under their original paths
("blocks.3.attn.qkv"), replaced by their tensor-parallel shard where the
plan splits them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from runtime.refs import call_factory, load_callable
from runtime.spec import StageSpec, TrainSpec
from runtime.program.shards import ModuleShard, ParamShard


# Attributes of every stage module that generated code reads: the torch.device its forward
# runs on (where the captured graph named a device, codegen/specialize.py), the tensor-
# parallel group (for the functions codegen/strategies/tensor/weight_ops.py calls; None until connected), and
# the rank's context-parallel chunks (runtime/parallel/context/strategy.py; None until connected).
RUN_DEVICE = "run_device"
TENSOR_GROUP = "tensor_group"
CONTEXT = "context"
RUNTIME_ATTRS = (RUN_DEVICE, TENSOR_GROUP, CONTEXT)


class MaterializeError(ValueError):
    """The model could not be built as the build asks; the message says what to change."""


def load_factory(ref: str, root: str = "", what: str = "model factory") -> Callable:
    """The callable a "path.py:NAME" reference names (relative paths: from here, else from `root`);
    RefError naming the file and line when importing it fails (syntax error, missing import, ...)."""
    return load_callable(ref, root or None, what)


def _build(factory: Callable, spec: TrainSpec) -> nn.Module:
    """The model factory's model; RefError naming the file and line when the factory fails."""
    return call_factory(factory, spec.model_kwargs, ref=spec.model_ref)


def meta_model(spec: TrainSpec) -> nn.Module:
    """The model on the meta device (no memory), for shapes and signatures."""
    factory = load_factory(spec.model_ref, spec.root)
    with torch.device("meta"):
        model = _build(factory, spec)
    if not isinstance(model, nn.Module):
        raise MaterializeError(f"model factory {spec.model_ref!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def model_signature(model: nn.Module) -> str:
    """A hash of every parameter's and buffer's name, shape and dtype (no values).

    Codegen records it; every rank checks that its model reference still builds the
    model the plan was made for.
    """
    items = sorted((k, list(v.shape), str(v.dtype)) for k, v in model.state_dict(keep_vars=True).items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def signature_mismatch(model: nn.Module, expected: dict[str, list[int]]) -> str:
    """A short description of how the model's tensors differ from `expected` (name -> shape)."""
    have = {k: list(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    missing = sorted(set(expected) - set(have))
    extra = sorted(set(have) - set(expected))
    changed = sorted(k for k in set(have) & set(expected) if have[k] != expected[k])
    parts = []
    if missing:
        parts.append(f"missing {missing[:3]}")
    if extra:
        parts.append(f"unexpected {extra[:3]}")
    if changed:
        k = changed[0]
        parts.append(f"{k} is {have[k]}, the plan has {expected[k]}")
    return "; ".join(parts) or "same tensors, different dtypes"


def derive_seed(seed: int, path: str) -> int:
    """A per-module seed: the same on every rank and in the reference."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:7], "big")


def _leaf_reset(module: nn.Module, path: str, seed: int) -> None:
    """to_empty + reset_parameters of every module under `module`, each under its own seed."""
    module.to_empty(device="cpu")
    for sub_path, sub in module.named_modules(prefix=path):
        own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        if not own:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if reset is None:
            raise MaterializeError(
                f"module {sub_path or '<root>'} ({type(sub).__name__}) holds tensors but has no reset_parameters(); "
                "init 'per-module' cannot initialise it: use init 'seed' or a checkpoint")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, sub_path))
            reset()


def check_checkpoint_file(path: str | os.PathLike, root: str = "") -> Path:
    """The --init checkpoint file `path` (relative paths also under the build `root`), once it is a file in
    torch.save's zip format (the one torch.load can mmap); MaterializeError naming it otherwise."""
    p = Path(path)
    if not p.is_absolute() and root and not p.exists():
        p = Path(root) / p
    if not p.is_file():
        raise MaterializeError(f"checkpoint file {path} does not exist; give --checkpoint a state_dict file "
                               "written by torch.save")
    try:
        with zipfile.ZipFile(p) as z:
            is_torch = any(name.endswith("/data.pkl") for name in z.namelist())
    except (zipfile.BadZipFile, OSError):
        is_torch = False
    if not is_torch:
        raise MaterializeError(f"checkpoint file {path} is not a torch.save file (its zip format, with data.pkl); "
                               "save the model's state_dict with torch.save and give that file")
    return p


def _load_checkpoint(path: str, root: str = "") -> dict:
    p = check_checkpoint_file(path, root)
    try:
        return torch.load(p, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise MaterializeError(f"checkpoint file {path} cannot be read as a state_dict ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None


def _fill_from(module: nn.Module, path: str, sd: dict) -> None:
    module.to_empty(device="cpu")
    prefix = f"{path}." if path else ""
    with torch.no_grad():
        for name, t in list(module.named_parameters(recurse=True)) + list(module.named_buffers(recurse=True)):
            key = prefix + name
            if key not in sd:
                raise MaterializeError(f"checkpoint has no tensor {key!r}")
            if tuple(sd[key].shape) != tuple(t.shape):
                raise MaterializeError(f"checkpoint tensor {key!r} is {tuple(sd[key].shape)}, the model's is {tuple(t.shape)}")
            t.copy_(sd[key])


def build_model(spec: TrainSpec) -> nn.Module:
    """The whole model on the CPU, initialised as the build says (the reference uses this)."""
    factory = load_factory(spec.model_ref, spec.root)
    if spec.init == "seed":
        torch.manual_seed(spec.seed)
        return _build(factory, spec)
    model = meta_model(spec)
    if spec.init == "per-module":
        _leaf_reset(model, "", spec.seed)
    else:
        _fill_from(model, "", _load_checkpoint(spec.checkpoint, spec.root))
    return model


def _set_path(root: nn.Module, path: str, value, kind: str) -> None:
    """Attach a module / parameter / buffer at a dotted path, creating empty parents."""
    parts = path.split(".")
    parent = root
    for p in parts[:-1]:
        if p not in parent._modules:
            parent.add_module(p, nn.Module())
        parent = parent._modules[p]
    if kind == "module":
        parent.add_module(parts[-1], value)
    elif kind == "parameter":
        parent.register_parameter(parts[-1], value)
    else:
        parent.register_buffer(parts[-1], value)


class Splits(Protocol):
    """This rank's parts of the modules and parameters a StageSpec splits (runtime.parallel.registry.StageSplits:
    the strategies that make the splits)."""

    def module(self, module: nn.Module, shard: ModuleShard, rank: int, num: int) -> nn.Module: ...

    def param(self, value: torch.Tensor, shard: ParamShard, rank: int, num: int) -> torch.Tensor: ...


def build_stage(stage_cls: type, sspec: StageSpec, spec: TrainSpec, tensor_rank: int = 0, tensor_size: int = 1,
                device: torch.device | str = "cpu", full_model: nn.Module | None = None,
                splits: Splits | None = None) -> nn.Module:
    """This rank's module for one stage, holding only the stage's (sharded) parameters.

    tensor_rank, tensor_size: this rank's place among the ranks holding slices of the split parameters
    (runtime.parallel.registry.param_place); splits: what makes those slices (needed where the StageSpec
    splits anything). The split modules are built without a group; the strategy's attach hook gives them
    the group once the process groups exist (so every local failure happens before any rank waits for another).
    """
    if (sspec.shards or sspec.param_shards) and splits is None:
        raise MaterializeError(f"stage {sspec.index} splits modules or parameters over ranks: pass build_stage "
                               "the strategies' splits (runtime.parallel.registry.StageSplits())")
    if full_model is None:
        full_model = build_model_for_stages(spec)
    shards = {s.path: s for s in sspec.shards}
    stage = stage_cls()
    sd = _load_checkpoint(spec.checkpoint, spec.root) if spec.init == "checkpoint" else None
    for path in sspec.modules:
        try:
            module = full_model.get_submodule(path)
        except AttributeError:
            raise MaterializeError(f"the model has no module {path!r}, which stage {sspec.index}'s code calls; "
                                   "the plan was made for another model") from None
        if spec.init == "per-module":
            _leaf_reset(module, path, spec.seed)
        elif spec.init == "checkpoint":
            _fill_from(module, path, sd)
        if path in shards:
            module = splits.module(module, shards[path], tensor_rank, tensor_size)
        _set_path(stage, path, module, "module")
    param_shards = {ps.name: ps for ps in sspec.param_shards}
    for path in sspec.attributes:
        owner, _, name = path.rpartition(".")
        holder = full_model.get_submodule(owner) if owner else full_model
        value = getattr(holder, name)
        if spec.init == "checkpoint":
            with torch.no_grad():
                value = nn.Parameter(sd[path].clone(), requires_grad=value.requires_grad) \
                    if isinstance(value, nn.Parameter) else sd[path].clone()
        elif spec.init == "per-module" and isinstance(value, torch.Tensor) and value.is_meta:
            raise MaterializeError(f"{path} is read directly by the model's code (not through a module), so "
                                   "init 'per-module' cannot initialise it: use init 'seed' or a checkpoint")
        if path in param_shards:   # this rank's slice
            value = splits.param(value, param_shards[path], tensor_rank, tensor_size)
        _set_path(stage, path, value, "parameter" if isinstance(value, nn.Parameter) else "buffer")
    for ps in sspec.padded:   # rows padded at tensor degree 1 (Execution.vocab_multiple)
        pad_rows(stage, ps)
    retie(stage, sspec)
    stage.to(device)
    setattr(stage, RUN_DEVICE, torch.device(device))
    setattr(stage, TENSOR_GROUP, None)
    setattr(stage, CONTEXT, None)
    stage.train()
    if spec.execution.compile:
        from runtime.execute.compiled import compile_stage

        compile_stage(stage, sspec, spec.execution)
    return stage


def pad_rows(stage: nn.Module, ps: ParamShard) -> None:
    """The stage's tensor `ps.name` with its rows padded with zeros to ps.split's one-rank size (an output
    layer's vocabulary: its weight and bias, a tied embedding's weight). The padded rows stay zero: no
    logit the model returns or the loss reads comes from them, so their gradient is exactly zero."""
    owner, _, leaf = ps.name.rpartition(".")
    mod = stage.get_submodule(owner) if owner else stage
    old = getattr(mod, leaf)
    padded = ps.split.take(old, ps.dim, 0, 1)
    if isinstance(old, nn.Parameter):
        mod.register_parameter(leaf, nn.Parameter(padded, requires_grad=old.requires_grad))
    else:
        mod.register_buffer(leaf, padded)
    rows = padded.shape[ps.dim]
    if isinstance(mod, nn.Linear) and leaf == "weight":   # its repr and shape checks see the padded layer
        mod.out_features = rows
    elif isinstance(mod, nn.Embedding) and leaf == "weight":
        mod.num_embeddings = rows


def _lookup(root: nn.Module, name: str) -> nn.Parameter | None:
    owner, _, leaf = name.rpartition(".")
    try:
        mod = root.get_submodule(owner) if owner else root
    except AttributeError:
        return None
    p = mod._parameters.get(leaf)
    return p if isinstance(p, nn.Parameter) else None


def retie(stage: nn.Module, sspec: StageSpec) -> None:
    """One parameter per tied group in the stage: tensor-parallel sharding copies each module's
    weight, so the modules that shared one (an embedding and its tied output layer) would hold
    two; the first copy replaces the others (they are the same slice of the same weight)."""
    for grp in sspec.shared:
        held = [(name, p) for name in grp if (p := _lookup(stage, name)) is not None]
        if len(held) < 2:
            continue
        name0, p0 = held[0]
        for name, p in held[1:]:
            if p is p0:
                continue
            if p.shape != p0.shape or not (p.is_meta or torch.equal(p.detach(), p0.detach())):
                raise MaterializeError(f"{name} and {name0} are one tied weight, but this stage holds different "
                                       f"slices of it ({tuple(p.shape)} and {tuple(p0.shape)}); the tensor-parallel "
                                       "split of its two users differs: generate the build again")
            _set_path(stage, name, p0, "parameter")


def separate_copies(modules: dict[int, nn.Module]) -> None:
    """Every stage a rank runs holds its own copy of a weight two of them use (a tied weight
    whose users fall in two stages on one rank): the stages' gradients are summed across all
    copies by runtime.execute.ties, like copies on other ranks, and each copy is stepped alike."""
    seen: set[int] = set()
    for s in sorted(modules):
        fresh: dict[int, nn.Parameter] = {}
        for mod in modules[s].modules():
            for leaf, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) in seen and id(p) not in fresh:
                    fresh[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                if id(p) in fresh:
                    mod._parameters[leaf] = fresh[id(p)]
        seen.update(id(p) for p in modules[s].parameters())


def build_model_for_stages(spec: TrainSpec) -> nn.Module:
    """The full model a rank slices its stages from: real (seed) or on meta (per-module, checkpoint)."""
    if spec.init == "seed":
        factory = load_factory(spec.model_ref, spec.root)
        torch.manual_seed(spec.seed)
        return _build(factory, spec)
    return meta_model(spec)

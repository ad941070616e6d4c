"""`planner.graph.capture`: turn an nn.Module plus example inputs into a ModelGraph.

Tracing: torch.fx.symbolic_trace first (it keeps leaf modules such as
nn.Linear whole, which is what sharding wants); if that fails,
torch.export.export(strict=False) with a symbolic batch dimension, whose ATen
graph handles the control flow and Python tricks of real models (Hugging
Face's among them) and does not depend on the batch size (planner/graph/export.py
also flattens export's no-grad regions and drops its checks). Both give an fx
GraphModule; one analysis pass serves both.

The analysis (planner/graph/analysis.py) runs every node once on meta tensors: shapes, FLOPs, the
activations saved for backward; the user's model is never modified and its weights never touched.
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from planner.graph.export import export_dynamic_batch, meta_twin
from planner.graph.model import ModelGraph
from planner.graph.analysis import NodeFailure, analyze


class CaptureError(ValueError):
    """The model could not be captured; the message says where and why."""


def capture(
    model: nn.Module,
    example_inputs: Any,
    *,
    batch_dim: int = 0,
) -> ModelGraph:
    """Capture `model` as a ModelGraph, costing every node on meta tensors.

    Args:
        model: the nn.Module to plan. It may live on the meta device (built
            under `with torch.device("meta"):`), in which case nothing is
            allocated; otherwise its parameters are only read for shapes.
        example_inputs: forward's inputs for a small example batch: a tensor,
            a tuple/list of positional inputs, or a dict of keyword inputs.
            Meta tensors are fine and cost nothing.
        batch_dim: the dimension of the inputs that holds the samples.

    Returns:
        ModelGraph with per-node OpInfo (figures for the example batch),
        layers (pipeline cut candidates) and branches.

    Raises:
        CaptureError: `model` is not an nn.Module, the inputs do not match
            forward(), or both fx and torch.export failed (the message names
            the model class, where tracing stopped, and both errors).
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"planner.capture expects a torch.nn.Module, got {type(model).__module__}.{type(model).__qualname__}; "
            "pass the model object (for example GPT(config)), not its class, config or output"
        )
    args, kwargs = _normalize_inputs(model, example_inputs)
    batch_size = _batch_size(model, args, kwargs, batch_dim)
    meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))

    errors: list[str] = []
    traced_but_failed = False   # fx traced the model, and running a node on the inputs' shapes failed
    try:
        gm = _fx_trace(model, args, kwargs)
        graph = analyze(gm, model, "fx", meta_args, meta_kwargs, batch_dim, batch_size)
        return graph
    except CaptureError:
        raise
    except Exception as e:  # fx cannot trace arbitrary Python; fall back to export
        traced_but_failed = isinstance(e, NodeFailure)
        errors.append(f"torch.fx.symbolic_trace: {_describe(e)}")

    # torch.export traces the model's meta twin, whatever device the model lives on: the graph (and
    # its fingerprint, which binds a plan) is then the same for a model built on meta, the CPU or a GPU
    # (planner/graph/export.py: meta_twin). A model whose code cannot run as a meta twin is traced on
    # its own device; codegen, which captures on meta, then names the graphs that differ.
    for where, traced, ex_args, ex_kwargs in (("", lambda: meta_twin(model), meta_args, meta_kwargs),
                                              (" on the model's device", lambda: model, args, kwargs)):
        try:
            gm = export_dynamic_batch(traced(), tuple(ex_args), dict(ex_kwargs), batch_dim, batch_size)
            return analyze(gm, model, "export", meta_args, meta_kwargs, batch_dim, batch_size)
        except CaptureError:
            raise
        except Exception as e:
            error = _describe(e)
            if not any(known.endswith(error) for known in errors):   # the same failure twice says nothing new
                errors.append(f"torch.export.export(strict=False){where}: {error}")
        if all(t.is_meta for t in (*model.parameters(), *model.buffers())):
            break   # the model is its own meta twin: tracing it again fails again

    if traced_but_failed:   # not a tracing problem: the computation does not fit the inputs (or itself)
        advice = ("forward() fails on these example inputs: an op got shapes or dtypes it cannot take (named "
                  "above). Check example_inputs (shapes, dtypes, which dimension holds the samples) against the "
                  "sizes build() gives the layers, then capture again.")
    else:
        advice = ("remove data-dependent Python control flow from forward() at the place named above (or make it "
                  "depend only on shapes fixed at construction), then capture again.")
    raise CaptureError(
        f"could not capture {type(model).__qualname__}: both tracers failed.\n  "
        + "\n  ".join(errors)
        + f"\nWhat to do: {advice}"
    )


# ---------------------------------------------------------------------------
# inputs


def capture_ref(model_ref: str, model_kwargs: dict | None = None, batch_size: int = 1) -> ModelGraph:
    """Capture the model a factory reference ("path/to/file.py:build") builds on meta, with
    `batch_size` samples from its module's `example_inputs(batch_size, device, **kwargs)`."""
    # the runtime's reference loader (RefError names the file and line of any failure); not needed at import
    from runtime.refs import RefError, call_factory, load_callable, load_module

    kwargs = dict(model_kwargs or {})
    factory = load_callable(model_ref)
    module_path = model_ref.rsplit(":", 1)[0]
    make_inputs = getattr(load_module(module_path), "example_inputs", None)
    if make_inputs is None:
        raise ValueError(f"{module_path} defines no example_inputs(batch_size, device, **kwargs); add one so "
                         "meshplan knows the shape of a batch (or, from Python, pass a captured graph)")
    with torch.device("meta"):
        model = call_factory(factory, kwargs, ref=model_ref)
    if not isinstance(model, nn.Module):
        raise RefError(f"model factory {model_ref} returned a value of type {type(model).__name__}, "
                       "not a torch.nn.Module; "
                       "return the model")
    inputs = call_factory(make_inputs, kwargs, ref=f"{module_path}:example_inputs", what="example inputs",
                          batch_size=batch_size, device="meta")
    return capture(model, inputs)


def _normalize_inputs(model: nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise CaptureError(
            f"example_inputs for {type(model).__qualname__} must be a tensor, a tuple/list of forward()'s "
            f"positional inputs, or a dict of its keyword inputs; got {type(example_inputs).__qualname__}"
        )
    sig = inspect.signature(model.forward)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise CaptureError(
            f"example inputs do not match {type(model).__qualname__}.forward{sig}: {e}. "
            f"Got {len(args)} positional input(s) {[_short(a) for a in args]}"
            + (f" and keywords {sorted(kwargs)}" if kwargs else "")
        ) from None
    return args, kwargs


def _batch_size(model: nn.Module, args: tuple, kwargs: dict, batch_dim: int) -> int:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        raise CaptureError(f"example inputs for {type(model).__qualname__} contain no tensor; "
                           "pass at least one input tensor with a batch dimension")
    first = tensors[0]
    if not -first.dim() <= batch_dim < max(first.dim(), 1):
        raise CaptureError(f"batch_dim={batch_dim} is out of range for the first input of shape "
                           f"{tuple(first.shape)}; pass the dimension that holds the samples")
    return int(first.shape[batch_dim]) if first.dim() else 1


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
    return type(x).__qualname__


# frames in these files are the capture itself, not where tracing stopped
_OWN_FILES = ("planner/graph/capture.py", "planner/graph/analysis.py")


def _describe(e: BaseException) -> str:
    """An error plus the innermost frame outside torch: where tracing stopped."""
    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    for fr in reversed(frames):
        fn = fr.filename.replace("\\", "/")
        if "/torch/" not in fn and "/meshplan/planner/" not in fn and not fn.endswith(_OWN_FILES):
            where = f" (stopped at {fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()})"
            break
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first[:300]}{where}"


# ---------------------------------------------------------------------------
# tracing


def _fx_trace(model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """symbolic_trace, specialising every forward() argument the user did not pass.

    Optional arguments left as None would otherwise become proxies and send
    `if mask is not None` down the wrong branch.
    """
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    concrete = {
        name: p.default
        for name, p in sig.parameters.items()
        if name not in bound.arguments and p.default is not inspect.Parameter.empty
    }
    return torch.fx.symbolic_trace(model, concrete_args=concrete or None)

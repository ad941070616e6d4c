"""Naming and classifying fx nodes into the op kinds the cost models use.

fx symbolic_trace leaves leaf modules (nn.Linear, nn.Conv2d, ...) as
`call_module` nodes and the rest as torch functions or tensor methods;
torch.export gives ATen ops. Both are mapped onto one small vocabulary so
that a cost model never needs to know which capture path produced a node.
"""

from __future__ import annotations

import torch.nn as nn

from runtime.vocab import OpKind

# Module classes -> kind. Checked with isinstance, so subclasses inherit.
_MODULE_KINDS: tuple[tuple[type, OpKind], ...] = (
    (nn.Linear, OpKind.LINEAR),
    (nn.Bilinear, OpKind.LINEAR),
    (nn.modules.conv._ConvNd, OpKind.CONV),
    (nn.Embedding, OpKind.EMBEDDING),
    (nn.EmbeddingBag, OpKind.EMBEDDING),
    (nn.modules.batchnorm._NormBase, OpKind.NORM),
    (nn.LayerNorm, OpKind.NORM),
    (nn.GroupNorm, OpKind.NORM),
    (nn.modules.pooling.MaxPool1d, OpKind.POOL),
    (nn.modules.pooling.MaxPool2d, OpKind.POOL),
    (nn.modules.pooling.MaxPool3d, OpKind.POOL),
    (nn.modules.pooling.AvgPool1d, OpKind.POOL),
    (nn.modules.pooling.AvgPool2d, OpKind.POOL),
    (nn.modules.pooling.AvgPool3d, OpKind.POOL),
    (nn.modules.pooling.AdaptiveAvgPool1d, OpKind.POOL),
    (nn.modules.pooling.AdaptiveAvgPool2d, OpKind.POOL),
    (nn.modules.pooling.AdaptiveAvgPool3d, OpKind.POOL),
    (nn.modules.pooling.AdaptiveMaxPool2d, OpKind.POOL),
    (nn.Softmax, OpKind.SOFTMAX),
    (nn.LogSoftmax, OpKind.SOFTMAX),
    (nn.MultiheadAttention, OpKind.ATTENTION),
    (nn.CrossEntropyLoss, OpKind.LOSS),
    (nn.MSELoss, OpKind.LOSS),
    (nn.NLLLoss, OpKind.LOSS),
    (nn.Flatten, OpKind.VIEW),
    (nn.Unflatten, OpKind.VIEW),
    (nn.Identity, OpKind.VIEW),
)
if hasattr(nn, "RMSNorm"):
    _MODULE_KINDS += ((nn.RMSNorm, OpKind.NORM),)

# Function / method / ATen base names -> kind. Anything unlisted that returns a
# tensor is ELEMENTWISE (priced as memory-bound), which is the right default
# for activations, arithmetic and dropout.
_NAME_KINDS: dict[str, OpKind] = {}
for _kind, _names in {
    OpKind.LINEAR: ["linear", "addmm"],
    OpKind.MATMUL: ["matmul", "mm", "bmm", "baddbmm", "einsum", "addbmm", "dot", "mv", "outer", "tensordot"],
    OpKind.CONV: ["conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
                  "conv_transpose3d", "_convolution", "cudnn_convolution", "mkldnn_convolution"],
    OpKind.ATTENTION: ["scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_cudnn_attention", "multi_head_attention_forward"],
    OpKind.EMBEDDING: ["embedding", "embedding_bag"],
    OpKind.NORM: ["layer_norm", "batch_norm", "group_norm", "rms_norm", "instance_norm",
                  "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
                  "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                  "native_group_norm", "_fused_rms_norm"],
    OpKind.SOFTMAX: ["softmax", "log_softmax", "_softmax", "_log_softmax", "_safe_softmax"],
    OpKind.POOL: ["max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                  "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
                  "max_pool2d_with_indices", "_adaptive_avg_pool2d"],
    OpKind.CONCAT: ["cat", "concat", "concatenate", "stack", "hstack", "vstack"],
    OpKind.LOSS: ["cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "nll_loss_forward", "l1_loss", "smooth_l1_loss"],
    # Views and metadata ops: no arithmetic; at most a copy (contiguous/clone).
    OpKind.VIEW: ["view", "reshape", "transpose", "permute", "flatten", "unflatten", "squeeze", "unsqueeze",
                  "expand", "expand_as", "split", "split_with_sizes", "chunk", "unbind", "getitem", "narrow",
                  "select", "slice", "t", "contiguous", "view_as", "_unsafe_view", "alias", "detach",
                  "to", "type", "type_as", "float", "half", "bfloat16", "clone", "_to_copy", "repeat",
                  "movedim", "swapaxes", "unsafe_split", "as_strided", "_assert_tensor_metadata",
                  "lift_fresh_copy"],
}.items():
    for _n in _names:
        _NAME_KINDS[_n] = _kind


def op_base(target) -> str:
    """The base name of what a call_function node calls: "addmm" for aten.addmm.default, the
    function's __name__ otherwise."""
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def module_stack(node) -> list[tuple[str, str]]:
    """The node's module stack (fx and torch.export record it), outermost first, as (path, class name)."""
    raw = node.meta.get("nn_module_stack") or {}
    out = []
    for path, cls in raw.values():
        path = str(path)
        for prefix in ("L['self'].", "L__self__.", "self."):
            if path.startswith(prefix):
                path = path[len(prefix):]
        cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        out.append((path, cls_name))
    return out


def module_path_of(node) -> str:
    """The innermost module path of a node ("" for the top level)."""
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def target_name(node, module: nn.Module | None) -> str:
    """A stable, readable name for what a node calls.

    call_module -> the module class ("torch.nn.Linear"); call_method -> the
    method name; call_function -> "aten.addmm" for ATen ops, otherwise the
    function's module-qualified name ("torch.nn.functional.gelu").
    """
    if node.op == "call_module":
        cls = type(module)
        mod = cls.__module__
        if mod.startswith("torch.nn.modules"):
            mod = "torch.nn"
        return f"{mod}.{cls.__qualname__}"
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        t = node.target
        name = getattr(t, "__name__", None)
        overload = getattr(t, "_overloadpacket", None)
        if overload is not None:  # an ATen OpOverload, e.g. aten.addmm.default
            return f"aten.{overload.__name__}"
        mod = getattr(t, "__module__", None) or ""
        if mod in ("_operator", "operator", "builtins"):
            return name or str(t)
        if mod.startswith("torch._C"):
            mod = "torch"
        return f"{mod}.{name}" if name else str(t)
    return str(node.target)


def classify(node, module: nn.Module | None, *, has_param_input: bool, output_is_tensor: bool) -> OpKind:
    """The op kind of one node (see OpInfo.kind)."""
    if node.op == "placeholder":
        return OpKind.INPUT
    if node.op == "output":
        return OpKind.OUTPUT
    if node.op == "get_attr":
        return OpKind.PARAM
    if not output_is_tensor:
        return OpKind.SCALAR
    if node.op == "call_module":
        for cls, kind in _MODULE_KINDS:
            if isinstance(module, cls):
                return kind
        return OpKind.ELEMENTWISE
    base = target_name(node, module).rsplit(".", 1)[-1]
    kind = _NAME_KINDS.get(base, OpKind.ELEMENTWISE)
    # x @ W with a parameter W is a Linear written functionally.
    if kind == OpKind.MATMUL and has_param_input:
        return OpKind.LINEAR
    return kind

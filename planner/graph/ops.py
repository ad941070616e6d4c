"""Naming and classifying fx nodes into the op kinds the cost models use.

fx symbolic_trace leaves leaf modules (nn.Linear, nn.Conv2d, ...) as
`call_module` nodes and the rest as torch functions or tensor methods;
torch.export gives ATen ops. Both are mapped onto one small vocabulary so
that a cost model never needs to know which capture path produced a node.
"""

from __future__ import annotations

import torch.nn as nn

# Module classes -> kind. Checked with isinstance, so subclasses inherit.
_MODULE_KINDS: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "linear"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding"),
    (nn.modules.batchnorm._NormBase, "norm"),
    (nn.LayerNorm, "norm"),
    (nn.GroupNorm, "norm"),
    (nn.modules.pooling.MaxPool1d, "pool"),
    (nn.modules.pooling.MaxPool2d, "pool"),
    (nn.modules.pooling.MaxPool3d, "pool"),
    (nn.modules.pooling.AvgPool1d, "pool"),
    (nn.modules.pooling.AvgPool2d, "pool"),
    (nn.modules.pooling.AvgPool3d, "pool"),
    (nn.modules.pooling.AdaptiveAvgPool1d, "pool"),
    (nn.modules.pooling.AdaptiveAvgPool2d, "pool"),
    (nn.modules.pooling.AdaptiveAvgPool3d, "pool"),
    (nn.modules.pooling.AdaptiveMaxPool2d, "pool"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "softmax"),
    (nn.MultiheadAttention, "attention"),
    (nn.CrossEntropyLoss, "loss"),
    (nn.MSELoss, "loss"),
    (nn.NLLLoss, "loss"),
    (nn.Flatten, "view"),
    (nn.Unflatten, "view"),
    (nn.Identity, "view"),
)
if hasattr(nn, "RMSNorm"):
    _MODULE_KINDS += ((nn.RMSNorm, "norm"),)

# Function / method / ATen base names -> kind. Anything unlisted that returns a
# tensor is "elementwise" (priced as memory-bound), which is the right default
# for activations, arithmetic and dropout.
_NAME_KINDS: dict[str, str] = {}
for _kind, _names in {
    "linear": ["linear", "addmm"],
    "matmul": ["matmul", "mm", "bmm", "baddbmm", "einsum", "addbmm", "dot", "mv", "outer", "tensordot"],
    "conv": ["conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
             "conv_transpose3d", "_convolution", "cudnn_convolution", "mkldnn_convolution"],
    "attention": ["scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_cudnn_attention", "multi_head_attention_forward"],
    "embedding": ["embedding", "embedding_bag"],
    "norm": ["layer_norm", "batch_norm", "group_norm", "rms_norm", "instance_norm",
             "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
             "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
             "native_group_norm", "_fused_rms_norm"],
    "softmax": ["softmax", "log_softmax", "_softmax", "_log_softmax", "_safe_softmax"],
    "pool": ["max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
             "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
             "max_pool2d_with_indices", "_adaptive_avg_pool2d"],
    "concat": ["cat", "concat", "concatenate", "stack", "hstack", "vstack"],
    "loss": ["cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy",
             "binary_cross_entropy_with_logits", "nll_loss_forward", "l1_loss", "smooth_l1_loss"],
    # Views and metadata ops: no arithmetic; at most a copy (contiguous/clone).
    "view": ["view", "reshape", "transpose", "permute", "flatten", "unflatten", "squeeze", "unsqueeze",
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


def classify(node, module: nn.Module | None, *, has_param_input: bool, output_is_tensor: bool) -> str:
    """The op kind of one node (see OpInfo.kind)."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return "param"
    if not output_is_tensor:
        return "scalar"
    if node.op == "call_module":
        for cls, kind in _MODULE_KINDS:
            if isinstance(module, cls):
                return kind
        return "elementwise"
    base = target_name(node, module).rsplit(".", 1)[-1]
    kind = _NAME_KINDS.get(base, "elementwise")
    # x @ W with a parameter W is a Linear written functionally.
    if kind == "matmul" and has_param_input:
        return "linear"
    return kind

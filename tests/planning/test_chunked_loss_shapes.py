"""runtime/execute/chunked_loss.py in a shape-only run: meta tensors and the ShapeGroup of a 2-rank vocabulary
split (as the runtime's shape runs give the last stage) go through forward and backward, giving the
loss's and the gradients' shapes and dtypes without computing anything. (chunked_eval returns host
integers, so it has no shape-only run.)"""

import torch

from runtime.execute.chunked_loss import chunked_cross_entropy
from runtime.parallel.tensor.layers import ShapeGroup


def test_meta_tensors_with_a_shape_group_give_the_shapes():
    h = torch.empty(3, 4, 8, device="meta", requires_grad=True)
    w = torch.empty(7, 8, device="meta", requires_grad=True)
    b = torch.empty(7, device="meta", requires_grad=True)
    t = torch.empty(3, 4, dtype=torch.long, device="meta")
    for group in (None, ShapeGroup(2)):   # gradients formed in forward; logits recomputed in backward
        h.grad = w.grad = b.grad = None
        loss = chunked_cross_entropy(h, w, t, bias=b, group=group, vocab_start=7, chunk_tokens=5)
        loss.backward()
        assert (loss.shape, loss.dtype, loss.device.type) == ((), torch.float32, "meta")
        assert [(x.grad.shape, x.grad.dtype) for x in (h, w, b)] == [(x.shape, x.dtype) for x in (h, w, b)]
        with torch.no_grad():
            assert chunked_cross_entropy(h, w, t, group=group, vocab_start=7).shape == ()

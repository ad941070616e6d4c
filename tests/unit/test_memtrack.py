"""runtime.execute.memtrack: live tensor bytes on CPU, counted per storage, freed through finalizers."""

import torch

from runtime.execute.memtrack import LiveBytes, measure_step_memory

MiB = 2**20


def test_live_bytes_counts_storages_once_and_frees_them():
    with LiveBytes() as t:
        a = torch.empty(MiB // 4)          # 1 MiB
        view = a[: MiB // 8]               # a view: no new storage
        b = torch.empty(2 * MiB // 4)      # 2 MiB
        assert t.live == 3 * MiB and t.peak == 3 * MiB
        del b
        assert t.live == MiB
        c = torch.empty(MiB // 4)
        assert t.live == 2 * MiB and t.peak == 3 * MiB
        del a, view, c
    assert t.live == 0


def test_step_peak_counts_existing_tensors_and_a_training_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)      # 257 KiB of parameters
    x = torch.randn(64, 256)

    def step():
        out = model(x)                     # (64, 256) activations: 64 KiB
        big = torch.ones(MiB // 4)         # 1 MiB temporary, freed before the end
        del big
        out.sum().backward()
        return 7

    result, mem = measure_step_memory(torch.device("cpu"), step)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert result == 7 and mem.method.startswith("live tensor bytes")
    assert mem.baseline >= params + x.numel() * 4
    assert mem.peak - mem.baseline >= MiB                  # the temporary was seen
    assert mem.peak - mem.baseline < MiB + 2 * params + 200 * 1024


def test_fake_tensors_left_by_tracing_are_not_counted():
    """FakeTensors (from torch.export / FakeTensorMode) report the CPU device but have no data:
    track_existing walks every live tensor and must skip them, not fail."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(1000)
    counter = LiveBytes()
    counter.track(fake)
    assert counter.live == 0
    counter.track_existing()  # `fake` is alive here, found through the garbage collector
    del mode

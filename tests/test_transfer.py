"""Small copies to the device through the pinned ring (GPU only): a slot is not refilled before the
copy that last read it has run, so every copy delivers the value it was given even while the stream
is held back by a long kernel (GPU only); row indexes kept on the device, copied once."""
import numpy as np
import pytest
import torch

from eaglet import transfer
from eaglet.transfer import SLOTS, row_index, to_device

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_row_index_is_copied_once_and_the_least_recently_used_goes(monkeypatch):
    monkeypatch.setattr(transfer, "INDEXES", 3)
    monkeypatch.setattr(transfer._rings, "indexes", {}, raising=False)
    cpu = torch.device("cpu")
    a = row_index([3, 1], cpu)
    assert torch.equal(a, torch.tensor([3, 1])) and a.dtype == torch.long
    assert row_index([3, 1], cpu) is a  # kept
    b, _ = row_index([2], cpu), row_index([5], cpu)
    assert row_index([3, 1], cpu) is a  # used again: now the most recent
    row_index([6], cpu)  # a fourth set: [2], the least recently used, goes
    assert row_index([2], cpu) is not b and row_index([3, 1], cpu) is a


@gpu
def test_every_copy_delivers_its_own_value_while_the_stream_is_busy():
    device = torch.device("cuda")
    torch.cuda._sleep(200_000_000)  # holds the stream: the copies below queue behind it
    outs = [to_device(np.full(7, i, dtype=np.int64), torch.long, device) for i in range(3 * SLOTS)]
    got = torch.stack(outs).cpu()
    assert torch.equal(got, torch.arange(3 * SLOTS).unsqueeze(1).expand(-1, 7))


@gpu
def test_a_value_over_a_slot_and_a_float_array_arrive_whole():
    device = torch.device("cuda")
    big = np.arange(1 << 15, dtype=np.int64)  # 256 KiB: over a slot, a fresh pinned buffer
    small = np.array([[0.5, 0.25], [1.0, 2.0]], dtype=np.float32)
    assert torch.equal(to_device(big, torch.long, device).cpu(), torch.from_numpy(big))
    assert torch.equal(to_device(small, torch.float32, device).cpu(), torch.from_numpy(small))


@gpu
def test_a_copy_inside_a_graph_capture_is_refused():
    device = torch.device("cuda")
    out = torch.zeros(3, dtype=torch.long, device=device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(to_device([1, 2, 3], torch.long, device))

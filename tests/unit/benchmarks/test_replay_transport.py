"""benchmarks/gpu_common.py's ReplayTransport: it counts what a rank sends like every transport, and replays an
exchange whose send and receive sizes differ (needs-only traffic) with the first sent elements, then
zeros."""

from __future__ import annotations

import torch

from benchmarks.gpu_common import ReplayTransport


def test_counts_and_replays_uneven_exchanges():
    transport = ReplayTransport(1, 4)
    send = torch.arange(6.0).view(1, 3, 2)
    more, fewer, none = torch.full((1, 5, 2), 7.0), torch.full((1, 2, 2), 7.0), torch.full((1, 2, 2), 7.0)
    transport.exchange((send,), (more,), 2)
    assert more.flatten().tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0] and transport.sent_bytes == 24
    transport.exchange((send,), (fewer,), 1)
    assert fewer.flatten().tolist() == [0, 1, 2, 3] and transport.sent_bytes == 48
    transport.exchange((), (none,), 3)  # nothing sent this step, something received
    assert none.flatten().tolist() == [0, 0, 0, 0] and transport.sent_bytes == 48
    same = torch.empty(1, 3, 2)
    transport.exchange((send,), (same,))
    assert torch.equal(same, send) and transport.sent_bytes == 72
    transport.all_gather_tensor(torch.zeros(4))  # once per other rank: 3 x 16 bytes
    transport.all_reduce_sum_(torch.zeros(2, dtype=torch.float64))  # 3 x 16
    assert transport.sent_bytes == 72 + 48 + 48

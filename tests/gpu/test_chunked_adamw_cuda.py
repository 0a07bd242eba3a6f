"""ChunkedAdamW with CUDA parameters: stream/event ordering and device memory."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt import ChunkedAdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, delay_cycles: int = 0) -> list[float]:
    losses = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(steps):
        x = torch.randn(64, 1024, device="cuda", generator=g)
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)  # the training stream lags: copies race it unless ordered
        loss = model(x).float().pow(2).mean()
        # Lightning's order: zero_grad between the forward and the backward. After the step, it
        # would wait for the worker and hide the overlap this file tests.
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


@pytest.mark.parametrize("delay_cycles", [0, 50_000_000])
def test_overlapped_steps_never_read_stale_parameters(delay_cycles):
    """overlap=True gives what overlap=False gives (each forward saw the updated weights)."""
    a, b = _model(), _model()
    losses_a = _train(a, ChunkedAdamW(a.parameters(), lr=1e-3, chunk_size="1MiB", overlap=True), 6, delay_cycles)
    losses_b = _train(b, ChunkedAdamW(b.parameters(), lr=1e-3, chunk_size="1MiB", overlap=False), 6)
    assert losses_a == losses_b
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


def test_device_memory_holds_no_optimizer_state():
    model = _model()
    params = sum(p.numel() for p in model.parameters())
    # cuBLAS's workspaces (tens of MiB per handle, for this thread and autograd's) are allocated
    # by the first forward and backward: before the measured window, whichever test runs first.
    model(torch.randn(2, 1024, device="cuda")).sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = ChunkedAdamW(model.parameters(), chunk_size="4MiB")
    _train(model, opt, 3)
    opt.wait()
    torch.cuda.synchronize()
    largest = max(c.spec.numel for c in opt._chunks)
    # gradient buffers (4 B/param) + one fp32 write-back buffer of a chunk; no moments, no master
    assert torch.cuda.memory_allocated() - before <= params * 4 + largest * 4 + 2**20
    assert opt.pinned_bytes > 0 or opt.host_bytes == 0

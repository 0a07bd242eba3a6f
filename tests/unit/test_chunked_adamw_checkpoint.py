"""ChunkedAdamW's state in an async save: left to the arena by the staging pool, copied into the pool
once, and as it was at the save even when the next step writes the chunk first (copy-on-write)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import safetensors.torch
import torch

from lightning_ckpt import ChunkedAdamW
from lightning_ckpt.format.plan import make_plan
from lightning_ckpt.offload import inplace
from lightning_ckpt.save.staging import DeferredCopies, StagingPool, layout


def _model_and_optimizer(in_place: bool = False) -> tuple[torch.nn.Module, ChunkedAdamW]:
    """``in_place``: the parameters view one registered host buffer (as ChunkedOffloadStrategy's
    host chunks are), so they are the master weights and the arena holds the moments alone."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 5))
    if in_place:
        net.flat = torch.cat([p.detach().flatten() for p in net.parameters()])
        offset = 0
        for p in net.parameters():
            p.data = net.flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        inplace.register(net, [net.flat])
    # 1 KiB chunks: four chunks, so the copies run chunk by chunk.
    optimizer = ChunkedAdamW(net.parameters(), lr=1e-2, chunk_size="1KiB", overlap=False)
    assert all(c.params_are_master is in_place for c in optimizer._chunks)
    return net, optimizer


def _step(net: torch.nn.Module, optimizer: ChunkedAdamW, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    net(torch.randn(4, 13, generator=g)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _staged_state(pool: StagingPool, plan, image_layout) -> dict[tuple, torch.Tensor]:
    """The optimizer state tensors as the pool holds them (its shard file images, parsed)."""
    return _staged(pool, plan, image_layout, lambda path: path[-1] in ("exp_avg", "exp_avg_sq"))


def _staged(pool: StagingPool, plan, image_layout, wanted) -> dict[tuple, torch.Tensor]:
    """The tensors whose path is ``wanted`` as the pool holds them (its shard file images, parsed)."""
    blobs = {}
    for filename, (offset, size) in image_layout.images.items():
        blobs.update(safetensors.torch.load(bytes(pool.buffer[offset : offset + size])))
    return {spec.path: blobs[spec.blob] for spec in plan.tensors if wanted(spec.path)}


@pytest.mark.parametrize("in_place", [False, True])
def test_the_next_step_copies_a_claimed_chunk_into_the_pool_before_writing_it(in_place):
    net, optimizer = _model_and_optimizer(in_place)
    _step(net, optimizer, 0)
    state = optimizer.state_dict()
    at_save = {(k, n): t.clone() for k, entry in state["state"].items() for n, t in entry.items() if n != "step"}
    moment_bytes = sum(t.numel() * t.element_size() for t in at_save.values())
    weights = {k: t.clone() for k, t in net.state_dict().items()}

    # The weights (outside the arena, or its master region) are copied by the staging call.
    plan = make_plan({"optimizer": state, "state_dict": net.state_dict()}, 2**30)
    image_layout, headers = layout(plan)
    pool = StagingPool()
    copies = pool.stage(plan, image_layout, headers, defer_host=True)
    arena = optimizer._arena
    # Nothing of the moments was copied by the staging call: the arena took them over.
    assert isinstance(copies, DeferredCopies) and not copies.landed()
    assert arena.snapshot_bytes == 0
    assert pool.host_bytes_copied == sum(s.nbytes for s in plan.shards) - moment_bytes  # the step counts

    _step(net, optimizer, 1)  # writes every chunk: each is copied into the pool just before
    assert copies.landed()
    assert arena.copied_on_write == arena.snapshot_bytes == moment_bytes  # every byte once
    staged = _staged_state(pool, plan, image_layout)
    assert staged.keys() == {("optimizer", "state", k, n) for k, n in at_save}
    for (k, n), value in at_save.items():
        assert torch.equal(staged[("optimizer", "state", k, n)], value), (k, n)
        assert not torch.equal(optimizer.state_dict()["state"][k][n], value), (k, n)  # the step moved on
    staged_weights = _staged(pool, plan, image_layout, lambda path: path[0] == "state_dict")
    for k, value in weights.items():
        assert torch.equal(staged_weights[("state_dict", k)], value), k
        assert not torch.equal(net.state_dict()[k], value), k
    pool.close()


def test_waiting_for_the_copies_makes_them_without_a_step_and_staging_without_deferral_copies_at_once():
    net, optimizer = _model_and_optimizer()
    _step(net, optimizer, 0)
    state = optimizer.state_dict()
    plan = make_plan({"optimizer": state}, 2**30)
    image_layout, headers = layout(plan)
    total = sum(s.nbytes for s in plan.shards)
    pool = StagingPool()

    copies = pool.stage(plan, image_layout, headers, defer_host=True)
    assert isinstance(copies, DeferredCopies)
    copies.wait()  # the hand-off thread's part in an async save
    arena = optimizer._arena
    assert copies.landed() and arena.copied_on_write == 0
    assert pool.host_bytes_copied + arena.snapshot_bytes == total

    # Without ``defer_host`` (a ring-staged save) the pool copies everything itself, at once.
    assert pool.stage(plan, image_layout, headers) is None
    assert pool.host_bytes_copied + arena.snapshot_bytes == 2 * total
    staged = _staged_state(pool, plan, image_layout)
    for k, entry in state["state"].items():
        assert torch.equal(staged[("optimizer", "state", k, "exp_avg")], entry["exp_avg"])
    pool.close()


def test_tensors_outside_the_arena_are_not_claimed():
    _, optimizer = _model_and_optimizer()
    arena = optimizer._arena
    elsewhere = torch.zeros(8)
    assert not arena.claim(elsewhere, torch.empty(8))
    assert arena.settled()


_OUTLIVE = """
import gc, torch
from lightning_ckpt import ChunkedAdamW
from lightning_ckpt.offload import inplace
net = torch.nn.Linear(64, 64)
opt = ChunkedAdamW(net.parameters(), lr=1e-2)
net(torch.randn(4, 64)).sum().backward()
opt.step()
state = opt.state_dict()
expected = state["state"][0]["exp_avg"].clone()
del opt
gc.collect()
filler = torch.randn(4_000_000)  # reuses freed memory, if the arena's was given back
assert torch.equal(state["state"][0]["exp_avg"], expected)
print("ok")
"""


def test_state_dict_outlives_the_optimizer() -> None:
    """A state dict kept after its optimizer is collected still reads the arena's bytes: closing
    the arena must not unmap memory that tensors still view (it used to segfault)."""
    done = subprocess.run([sys.executable, "-c", _OUTLIVE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_a_stage_that_fails_midway_leaves_no_claim_behind(monkeypatch):
    """Claims of a save whose staging raised (Ctrl-C, a failed copy) must not be copied later into
    the pool's bytes of the next save staged there."""
    net, optimizer = _model_and_optimizer()
    _step(net, optimizer, 0)
    pool = StagingPool()
    pool.reserve(1 << 20)  # sized ahead, as early staging does: both saves use the same bytes
    plan = make_plan({"optimizer": optimizer.state_dict()}, 2**30)
    image_layout, headers = layout(plan)
    calls, wait_writable = [0], StagingPool.wait_writable

    def interrupted(self: StagingPool, end: int) -> None:
        calls[0] += 1
        if calls[0] == 6:  # after some of the moments were claimed
            raise KeyboardInterrupt("interrupted while staging")
        wait_writable(self, end)

    monkeypatch.setattr(StagingPool, "wait_writable", interrupted)
    try:
        pool.stage(plan, image_layout, headers, defer_host=True)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(StagingPool, "wait_writable", wait_writable)
    assert calls[0] == 6 and optimizer._arena.settled()

    # A different checkpoint (a tensor first, so the moments sit at other offsets) in the same pool.
    extra = torch.arange(300.0)
    state = optimizer.state_dict()
    at_save = {(k, n): t.clone() for k, entry in state["state"].items() for n, t in entry.items() if n != "step"}
    plan = make_plan({"extra": extra, "optimizer": state}, 2**30)
    image_layout, headers = layout(plan)
    pool.stage(plan, image_layout, headers, defer_host=True).wait()
    staged = _staged_state(pool, plan, image_layout)
    for (k, n), value in at_save.items():
        assert torch.equal(staged[("optimizer", "state", k, n)], value), (k, n)
    blobs = {}
    for offset, size in image_layout.images.values():
        blobs.update(safetensors.torch.load(bytes(pool.buffer[offset : offset + size])))
    assert torch.equal(blobs[next(s.blob for s in plan.tensors if s.path == ("extra",))], extra)
    pool.close()

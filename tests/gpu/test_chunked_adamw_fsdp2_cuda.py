"""CUDA: ``ChunkedAdamW`` on FSDP2 parameters on one GPU (a 1-rank process group), with the shards
on the device (fp32 master weights and moments on the host: 12 bytes per parameter there, none on
the device) and with ``CPUOffloadPolicy`` (the shards on the host, stepped in place: 8 bytes)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import lightning_ckpt as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def train(mesh, chunked: bool, offload: bool, steps: int = 6):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))).cuda()
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for layer in net:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(net, mesh=mesh, offload_policy=policy)
    if chunked:
        opt = lc.ChunkedAdamW(net.parameters(), lr=1e-3, weight_decay=0.1, chunk_size="1MiB")
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 512, generator=g).cuda()
        net(x).float().pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    if chunked:
        opt.wait()
    torch.cuda.synchronize()
    return net, opt


@pytest.mark.parametrize("offload", [False, True], ids=["shards-on-gpu", "cpu-offload-policy"])
def test_fsdp2_shards_step_on_the_host_equal_to_fused_adamw(one_rank, offload):
    reference, _ = train(one_rank, chunked=False, offload=offload)
    torch.cuda.reset_peak_memory_stats()
    model, opt = train(one_rank, chunked=True, offload=offload)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        a, b = a.full_tensor().cpu(), b.full_tensor().cpu()
        if offload:  # both step the host shards with torch's fused CPU kernel
            assert torch.equal(a, b), name
        else:  # the reference steps on the GPU: CUDA's kernel differs from the CPU's in the last bits
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    params = sum(p.numel() for p in model.parameters())
    chunks = opt.layout.chunks
    assert sum(spec.numel for spec in chunks) == params
    # host shards are their own master weights (moments only); device shards keep an fp32 master
    assert all(spec.master is not offload for spec in chunks)
    assert opt.host_bytes >= (8 if offload else 12) * params
    for state in opt.state_dict()["state"].values():
        assert state["exp_avg"].to_local().device.type == "cpu"  # no optimizer state on the device

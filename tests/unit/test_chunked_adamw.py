"""ChunkedAdamW on the CPU: layout, exactness against torch.optim.AdamW, state dicts, errors."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch

from lightning_ckpt import ChunkedAdamW
from lightning_ckpt.hostmem import aligned
from lightning_ckpt.offload import ChunkedAdamWError, inplace
from lightning_ckpt.offload.chunks import plan_chunks


class Net(torch.nn.Module):
    """Odd sizes (the fused kernel's scalar tails), a frozen layer, a tied weight, an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 13)
        self.body = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 13))
        self.frozen = torch.nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(13, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.spare = torch.nn.Linear(5, 5)  # used only every other step: its steps diverge

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = self.frozen(self.body(self.embed(x)))
        out = self.head(h).float().pow(2).mean()
        if use_spare:
            out = out + self.spare(torch.ones(5, dtype=self.spare.weight.dtype)).float().sum()
        return out


def groups(net: Net) -> list[dict]:
    decay = [net.embed.weight, net.body[0].weight, net.body[2].weight, net.frozen.weight]
    no_decay = [net.body[0].bias, net.body[2].bias, net.frozen.bias, net.spare.weight, net.spare.bias]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def train(net: Net, opt: torch.optim.Optimizer, steps: int, accumulate: int = 2, set_to_none: bool = True) -> None:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for _ in range(accumulate):
            loss = net(torch.randint(0, 11, (4, 3), generator=g), use_spare=step % 2 == 0)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=set_to_none)


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def train_alike(net: Net, opt: ChunkedAdamW, ref: Net, ref_opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` of ``train`` on both pairs; the weights are then the same."""
    train(net, opt, steps)
    train(ref, ref_opt, steps)
    opt.wait()
    assert_same(net, ref)


def test_layout_packs_per_group_and_dtype_in_order():
    layout = plan_chunks([(0, 10, torch.float32), (0, 5, torch.bfloat16), (0, 7, torch.float32), (1, 3, torch.float32), (0, 40, torch.float32)], 20)
    chunks = [(c.group, c.dtype, [s.param for s in c.slots], c.numel) for c in layout.chunks]
    assert chunks == [
        (0, torch.float32, [0, 2], 17),
        (0, torch.bfloat16, [1], 5),
        (1, torch.float32, [3], 3),
        (0, torch.float32, [4], 40),  # larger than a chunk: a chunk of its own
    ]
    assert [s.offset for s in layout.chunks[0].slots] == [0, 10]
    ends = [c.host_end for c in layout.chunks]
    assert ends == sorted(ends) and layout.nbytes == ends[-1]
    assert layout.chunks[1].host_offset == layout.chunks[0].host_end


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_bit_identical_to_fused_adamw(overlap, set_to_none):
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    opt = ChunkedAdamW(groups(net), lr=1e-2, chunk_size=600, overlap=overlap)
    assert len(opt._chunks) > 2
    train(net, opt, 8, set_to_none=set_to_none)
    train(ref, torch.optim.AdamW(groups(ref), lr=1e-2, fused=True), 8, set_to_none=set_to_none)
    opt.wait()
    assert_same(net, ref)
    # frozen parameters have no state and no chunk memory; the tied weight is stepped once
    assert net.frozen.weight not in opt.state and net.frozen.weight not in opt._where
    assert float(opt.state[net.embed.weight]["step"]) == 8
    # a parameter without a gradient is skipped (torch: None skips, a zeroed gradient steps)
    assert float(opt.state[net.spare.weight]["step"]) == (4 if set_to_none else 8)


def test_gradients_are_views_of_the_chunk_buffers_and_nothing_is_reallocated():
    torch.manual_seed(0)
    net = Net()
    opt = ChunkedAdamW(groups(net), chunk_size="1KiB")
    masters = [c.master_flat.data_ptr() for c in opt._chunks]
    train(net, opt, 1, set_to_none=False)  # the first backward allocates the gradient buffers
    buffers = [c.grad_buffer.data_ptr() for c in opt._chunks]
    train(net, opt, 2, set_to_none=False)
    net(torch.zeros(2, 3, dtype=torch.long)).backward()
    for p, (chunk, i) in opt._where.items():
        if p.grad is not None:
            assert p.grad.data_ptr() == chunk.grads[i].data_ptr()
    assert [c.grad_buffer.data_ptr() for c in opt._chunks] == buffers
    assert [c.master_flat.data_ptr() for c in opt._chunks] == masters
    assert opt.state[net.embed.weight]["exp_avg"].data_ptr() == opt._where[net.embed.weight][0].exp_avg[0].data_ptr()


def test_bf16_parameters_step_an_fp32_master():
    """bf16 parameters: exactly fp32 AdamW(fused) on upcast gradients, rounded to bf16 after each step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in net.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2, fused=True)
    opt = ChunkedAdamW(net.parameters(), lr=1e-2, chunk_size=300)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        net(torch.randn(5, 9, generator=g).bfloat16()).float().pow(2).sum().backward()
        for m, p in zip(master, net.parameters()):
            m.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    opt.wait()
    for m, p in zip(master, net.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, m.detach().bfloat16())
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


def test_grad_scaler_skips_the_step_on_inf():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 4)
    ref = copy.deepcopy(net)
    runs = []
    for model, opt in ((net, ChunkedAdamW(net.parameters(), lr=1e-2)), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        g = torch.Generator().manual_seed(0)
        for step in range(5):
            x = torch.randn(3, 6, generator=g)
            if step == 2:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(float(opt.state[model.weight]["step"]))
    net_opt_steps, ref_steps = runs
    assert net_opt_steps == ref_steps == 4.0
    assert_same(net, ref)


def _train_plain(net, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        net(torch.randint(0, 11, (4, 3), generator=g), use_spare=True).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("direction", ["adamw_to_chunked", "chunked_to_adamw"])
def test_state_dict_round_trips_with_torch_adamw(direction):
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    _train_plain(ref, ref_opt, 3, 0)
    _train_plain(ref, ref_opt, 3, 1)  # uninterrupted reference

    first_cls, second_cls = (
        (torch.optim.AdamW, ChunkedAdamW) if direction == "adamw_to_chunked" else (ChunkedAdamW, torch.optim.AdamW)
    )
    kwargs = {"fused": True}
    first_opt = first_cls(groups(net), lr=1e-2, **kwargs)
    _train_plain(net, first_opt, 3, 0)
    saved = copy.deepcopy(first_opt.state_dict())
    resumed = Net()
    resumed.load_state_dict(net.state_dict())
    second_opt = second_cls(groups(resumed), lr=1e-2, **kwargs)
    second_opt.load_state_dict(saved)
    loaded = second_opt.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for key, state in saved["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][key][name], state[name]), (key, name)
    _train_plain(resumed, second_opt, 3, 1)
    if isinstance(second_opt, ChunkedAdamW):
        second_opt.wait()
    assert_same(resumed, ref)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"amsgrad": True}, "amsgrad"), ({"maximize": True}, "maximize"), ({"capturable": True}, "capturable"),
     ({"differentiable": True}, "differentiable"), ({"chunk_size": "lots"}, "chunk_size"), ({"betas": (0.9, 1.5)}, "betas"),
     ({"exchange": "nccl"}, "exchange")],
)
def test_unsupported_arguments_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=f"`{named}"):
        ChunkedAdamW(torch.nn.Linear(2, 2).parameters(), **kwargs)


def test_refusals_with_a_fix():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="amsgrad.*param group"):
        ChunkedAdamW([{"params": net.parameters(), "amsgrad": True}])
    with pytest.raises(ValueError, match="one device"):
        ChunkedAdamW([net.weight, torch.nn.Parameter(torch.zeros(2, device="meta"))])
    with pytest.raises(ValueError, match="`lr=-1"):
        ChunkedAdamW([net.weight], lr=-1.0)
    # the device exchange needs CUDA parameters (and NCCL): refused on any machine, sharded or not
    with pytest.raises(ValueError, match=r'exchange="device".*on cpu.*exchange="host"'):
        ChunkedAdamW([net.weight], exchange="device")
    opt = ChunkedAdamW([net.weight])
    assert opt.exchange_backend is None  # one process: nothing to exchange
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [net.bias]})
    embed = torch.nn.Embedding(4, 3, sparse=True)
    opt = ChunkedAdamW(embed.parameters())
    embed(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradients"):
        opt.step()
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    opt = ChunkedAdamW(frozen.parameters())
    frozen.requires_grad_(True)
    frozen(torch.ones(2)).sum().backward()
    with pytest.raises(ValueError, match="did not require grad"):
        opt.step()


def test_a_worker_failure_surfaces_at_the_next_step_and_nothing_hangs():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = ChunkedAdamW(net.parameters(), chunk_size=64)  # one chunk per parameter
    net(torch.ones(4)).sum().backward()
    opt.step()
    opt.zero_grad()
    net(torch.ones(4)).sum().backward()
    # The write-back of the first chunk cannot land: its parameter now aliases one element.
    net[0].weight.data = torch.zeros(1).expand(4, 4)
    opt.step()
    finished = threading.Event()
    errors: list[BaseException] = []

    def next_step() -> None:
        try:
            opt.step()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finished.set()

    threading.Thread(target=next_step, daemon=True).start()
    assert finished.wait(60), "step() hung after a worker failure"
    assert len(errors) == 1 and isinstance(errors[0], ChunkedAdamWError)
    assert "chunk 0" in str(errors[0]) and "restore" in str(errors[0])
    with pytest.raises(ChunkedAdamWError):  # and it stays
        net(torch.ones(4))


def held_pair():
    """A small net with an overlapping ``ChunkedAdamW`` whose worker runs each job only once
    ``gate`` is set, and a copy with one that does not overlap (the reference)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    ref = copy.deepcopy(net)
    opt = ChunkedAdamW(net.parameters(), lr=1e-2, chunk_size=64)
    ref_opt = ChunkedAdamW(ref.parameters(), lr=1e-2, chunk_size=64, overlap=False)
    gate = threading.Event()
    run = opt._worker.run

    def delayed(job) -> None:
        gate.wait()
        run(job)

    opt._worker.run = delayed
    return net, ref, opt, ref_opt, gate


def test_the_next_forward_and_state_dict_wait_for_a_delayed_worker():
    """Under an injected delay (the worker is held until the forward has begun), the step runs
    after step() returned and the next forward and model.state_dict() still see updated weights."""
    net, ref, opt, ref_opt, gate = held_pair()
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(5, 7, generator=g)
        loss = net(x).pow(2).sum()
        ref_loss = ref(x).pow(2).sum()
        assert torch.equal(loss, ref_loss), step
        opt.zero_grad()  # Lightning's order: after the forward (zero_grad waits for every chunk)
        ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        gate.clear()
        opt.step()
        assert not all(c.done.is_set() for c in opt._chunks)  # held: stepping goes on after step()
        threading.Timer(0.05, gate.set).start()  # released while the main thread goes on
        ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    net(torch.ones(7)).sum().backward()
    ref(torch.ones(7)).sum().backward()
    gate.clear()
    opt.step()
    ref_opt.step()
    threading.Timer(0.05, gate.set).start()
    for (key, value), expected in zip(net.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(value, expected), key


def test_owners_balance_chunks_and_a_rank_holds_only_its_own():
    from lightning_ckpt.offload.chunks import assign_owners, restrict

    layout = plan_chunks([(0, n, torch.float32) for n in (50, 10, 10, 40, 30)], 50)
    assert [c.numel for c in layout.chunks] == [50, 20, 40, 30]
    owners = assign_owners(layout, 2)
    assert owners == (0, 1, 1, 0)  # least-loaded rank first: loads 80 and 60
    mine = restrict(layout, {i for i, o in enumerate(owners) if o == 1})
    assert [c.host_offset for c in mine.chunks][0] == -1 and mine.chunks[1].host_offset == 0
    assert mine.chunks[2].host_offset == mine.chunks[1].host_end and mine.nbytes == mine.chunks[2].host_end
    assert mine.nbytes < layout.nbytes


def test_cpu_fp32_parameters_are_their_master_weights_and_get_their_memory_back():
    """On the CPU an fp32 parameter owning its storage becomes a view of its master weights (no
    write-back); results stay bit-identical to AdamW; re-pointing a parameter elsewhere brings its
    write-back back; the optimizer's end gives the parameters memory of their own."""
    import gc

    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    opt = ChunkedAdamW(groups(net), lr=1e-2, chunk_size="1KiB")
    assert not any(c.params_are_master for c in opt._chunks)  # the arena holds their master weights
    for p, (chunk, i) in opt._where.items():
        assert p.data_ptr() == chunk.master[i].data_ptr() and chunk.aliased(i)
        # a storage of its own over those bytes: torch.save / safetensors of it write the parameter alone
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    versions = {p: p._version for p in opt._where}
    train_alike(net, opt, ref, ref_opt, 3)
    # updated by the kernel in place, and their version counters say so (saves tell unchanged tensors by them)
    assert all(p._version > v for p, v in versions.items())

    moved = net.body[0].weight
    with torch.no_grad():
        moved.data = moved.detach().clone()  # something points it elsewhere: written back again
    assert not opt._where[moved][0].aliased(opt._where[moved][1])
    train_alike(net, opt, ref, ref_opt, 2)

    arena = opt._arena
    before = [p.detach().clone() for p in net.parameters()]
    del opt, chunk
    gc.collect()
    assert arena.nbytes > 0 and not any(arena.holds(p) for p in net.parameters())
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_parameters_viewing_a_larger_buffer_keep_their_memory():
    flat = torch.zeros(30)
    p = torch.nn.Parameter(flat[:20].view(4, 5))
    q = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = ChunkedAdamW([p, q], lr=1e-2)
    (chunk, i), (bchunk, j) = opt._where[p], opt._where[q]
    assert not chunk.aliased(i) and not bchunk.aliased(j)
    assert p.data_ptr() == flat.data_ptr()
    # Unregistered memory (a flat parameter, a user's view): a master copy of its own.
    assert not chunk.params_are_master and chunk.master_flat.numel() == 20


class _Memory(bytearray):
    """Host memory a weak reference can follow (a bytearray cannot be referenced weakly)."""


class HostChunks:
    """A module's parameters in one flat fp32 host buffer registered with ``inplace``, as
    ChunkedOffloadStrategy's streamer holds them; ``relay`` moves them into a fresh buffer (its
    warm-up), copying the values. Called between steps, after ``wait()`` (the owner's promise)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = list({id(p): p for p in module.parameters()}.values())
        self.relay()

    def relay(self) -> None:
        memory = _Memory(4 * sum(p.numel() for p in self.params))
        self.memory = weakref.ref(memory)  # dead once no tensor views this layout any longer
        self.flat = torch.frombuffer(memory, dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.detach())
                p.data = view
                offset += p.numel()
        inplace.register(self, [self.flat])


def test_parameters_in_registered_host_memory_are_their_own_master_weights():
    """No master weights in the arena; bit-identical to fused AdamW while the owner re-lays the
    memory out between steps; values set from outside (in place, ``p.data = ...``) are what the
    next step starts from; version counters still move."""
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    chunks = HostChunks(net)
    opt = ChunkedAdamW(groups(net), lr=1e-2, chunk_size="1KiB")
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    assert len(opt._chunks) > 2 and all(c.params_are_master and c.master_flat.numel() == 0 for c in opt._chunks)
    assert opt.host_bytes == sum(2 * aligned(4 * c.spec.numel) for c in opt._chunks)  # the moments only
    train(net, opt, 2)
    train(ref, ref_opt, 2)
    opt.wait()
    before = chunks.flat
    chunks.relay()  # the parameters change storage between two steps
    left = before.clone()
    versions = {p: p._version for p in opt._where}
    train_alike(net, opt, ref, ref_opt, 2)
    assert all(p._version > v for p, v in versions.items())
    assert torch.equal(before, left)  # the memory the parameters left is never stepped again
    with torch.no_grad():
        for model in (net, ref):
            model.body[0].weight.fill_(0.25)
            model.body[2].bias.data = torch.full((13,), 0.5)
    train_alike(net, opt, ref, ref_opt, 2)
    net.body[0].weight.data = torch.zeros(13, 37).t()
    net(torch.zeros(2, 3, dtype=torch.long)).backward()
    steps = [s["step"].item() for s in opt.state.values()]
    embedding = net.embed.weight.detach().clone()  # in the first chunk, before the refused one
    with pytest.raises(ValueError, match=r"in place.*non-contiguous torch.float32 tensor of shape \(37, 13\).*p\.copy_"):
        opt.step()
    opt.wait()  # nothing was queued: a retry after the fix cannot step a chunk twice
    assert [s["step"].item() for s in opt.state.values()] == steps and torch.equal(net.embed.weight, embedding)
    inplace.unregister(chunks)
    assert not inplace.steps_in_place(net.embed.weight)
    assert inplace.steps_in_place(torch.empty(0)) and not inplace.steps_in_place(torch.empty(0, dtype=torch.bfloat16))


def test_memory_the_owner_relaid_is_let_go_even_by_a_parameter_without_gradients():
    """The optimizer holds no view of parameters in registered memory between steps: the owner's
    old layout is freed after its re-layout, also when a parameter never gets a gradient."""
    torch.manual_seed(0)
    net = Net()
    net.unused = torch.nn.Linear(3, 3)  # trainable, never in the forward
    chunks = HostChunks(net)
    opt = ChunkedAdamW(net.parameters(), lr=1e-2, chunk_size="1KiB")
    train(net, opt, 1)
    opt.wait()
    first = chunks.memory
    chunks.relay()
    train(net, opt, 2)
    opt.wait()
    gc.collect()
    assert first() is None
    inplace.unregister(chunks)


def test_state_moved_to_a_device_by_lightning_points_back_at_the_arena():
    """Lightning moves optimizer state to the device after a load (``_optimizer_to_device``). Here
    the meta device stands in for a GPU: the moved copies are frozen at the move, so the step and
    later state dicts must go on using the arena and the CPU step counts."""
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    opt = ChunkedAdamW(groups(net), lr=1e-2)
    _train_plain(ref, ref_opt, 3, 0)
    _train_plain(net, opt, 3, 0)
    _optimizer_to_device(opt, torch.device("meta"))
    _train_plain(ref, ref_opt, 3, 1)
    _train_plain(net, opt, 3, 1)
    opt.wait()
    assert_same(net, ref)
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for key, state in theirs.items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert ours[key][name].device.type == "cpu" and torch.equal(ours[key][name], state[name]), (key, name)


@pytest.mark.parametrize("aliased", [True, False])
def test_a_parameter_replaced_with_data_assignment_is_taken_as_set(aliased):
    """``p.data = t`` keeps the version counter: the pointer tells the optimizer its master is stale."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    if not aliased:  # a view of a larger buffer keeps its own memory
        w = torch.zeros(100)[:16].view(4, 4)
        w.copy_(lin.weight.detach())
        lin.weight = torch.nn.Parameter(w)
    opt = ChunkedAdamW(lin.parameters(), lr=0.0, weight_decay=0.0, overlap=False)
    assert opt._chunks[0].aliased(0) is aliased
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    lin.weight.data = torch.full((4, 4), 5.0)
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()  # lr 0: the weight stays what it was set to
    opt.wait()
    assert torch.equal(lin.weight, torch.full((4, 4), 5.0))

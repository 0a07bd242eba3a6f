"""The placement plan of ChunkedOffloadStrategy (pure) and the streamer's slot bookkeeping."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from lightning_ckpt.offload.placement import OffloadBudgetError, Unit, plan_offload
from lightning_ckpt.offload.streamer import Streamer
from lightning_ckpt.offload.streams import HostStreams

# Four units of one 100-byte chunk each, and chunk 4 (50 bytes) that no unit holds.
CHUNKS = [100, 100, 100, 100, 50]
UNITS = [Unit(f"u{i}", (i,)) for i in range(4)]
TRACE = [0, 1, 2, 3]


def test_everything_resident_when_it_fits():
    plan = plan_offload(CHUNKS, UNITS, 500, trace=TRACE, activation=[10, 20, 30, 40])
    assert plan.resident == frozenset(range(5)) and plan.slots == 0
    assert plan.device_bytes == 490
    # Before the warm-up step the activations are unknown: streaming, even when the chunks fit.
    assert plan_offload(CHUNKS, UNITS, 500).slots == 1


def test_smallest_plan_before_the_warm_up():
    plan = plan_offload(CHUNKS, UNITS, 300)
    # Chunk 4 is read outside every unit: always resident. One slot: each unit has one chunk.
    assert plan.resident == {4} and plan.slots == 1 and plan.slot_bytes == 100
    assert plan.device_bytes == 150


def test_prefetch_slots_then_residents_by_use_within_the_budget():
    plan = plan_offload(CHUNKS, UNITS, 420, trace=[0, 1, 0, 2, 3], activation=[10, 10, 10, 10], prefetch=2)
    assert plan.slots == 3  # the running unit and the two after it
    assert plan.device_bytes <= 420
    plan = plan_offload(CHUNKS, UNITS, 440, trace=[0, 1, 0, 2, 3], activation=[10, 10, 10, 10], prefetch=1)
    assert plan.slots == 2
    assert plan.resident == {0, 4}  # unit 0 runs twice: its chunk is the first made resident
    assert plan.device_bytes == 360


def test_budget_too_small_names_the_unit_and_the_bytes():
    with pytest.raises(OffloadBudgetError, match=r"`device_memory_budget=200`.*unit 'u2'.* 100 bytes and its activations 90 bytes.* needs 240 bytes"):
        plan_offload(CHUNKS, UNITS, 200, trace=TRACE, activation=[10, 20, 90, 40])


def test_a_parameter_the_budget_cannot_hold_is_named_with_the_budget_it_needs():
    # Chunks 0-3 each hold one parameter (never split): no chunk_size shrinks their slot.
    single = {c: f"u{c}.weight" for c in range(4)}
    with pytest.raises(
        OffloadBudgetError,
        match=r"`device_memory_budget=150` bytes cannot hold parameter 'u0\.weight': it takes 100 bytes on its own"
        r".* needs at least 190 bytes whatever `chunk_size` is\. Raise `device_memory_budget` to at least 190 bytes;"
        r" lowering `chunk_size` cannot help",
    ):
        plan_offload(CHUNKS, UNITS, 150, trace=TRACE, activation=[10, 20, 40, 10], single=single)
    # Without the names (chunks of several parameters) the advice stays to lower chunk_size.
    with pytest.raises(OffloadBudgetError, match=r"lower `chunk_size`"):
        plan_offload(CHUNKS, UNITS, 150, trace=TRACE, activation=[10, 20, 40, 10])


def test_slots_sized_by_one_parameter_are_not_blamed_on_chunk_size():
    # One slot of the 100-byte parameter fits; the unit's two slots do not.
    with pytest.raises(OffloadBudgetError, match=r"needs 200 bytes\. .*cannot shrink the slots: parameter 'a\.w' alone fills 100 bytes") as info:
        plan_offload([100, 30], [Unit("a", (0, 1))], 150, single={0: "a.w"})
    assert "lower `chunk_size`" not in str(info.value)


def test_plans_stay_within_the_budget():
    rng = random.Random(0)
    for _ in range(300):
        chunks = [rng.randint(1, 100) for _ in range(rng.randint(1, 12))]
        units = [Unit(f"u{u}", tuple(rng.sample(range(len(chunks)), rng.randint(1, min(3, len(chunks)))))) for u in range(rng.randint(1, 6))]
        trace = [rng.randrange(len(units)) for _ in range(rng.randint(1, 10))]
        activation = [rng.randint(0, 50) for _ in units]
        budget = rng.randint(50, sum(chunks) + 60)
        try:
            plan = plan_offload(chunks, units, budget, trace=trace, activation=activation, prefetch=rng.randint(0, 3))
        except OffloadBudgetError:
            continue
        assert plan.device_bytes <= budget
        streamed = {c for u in units for c in u.chunks} - plan.resident
        assert all(len(set(u.chunks) & streamed) <= plan.slots for u in units)
        assert all(chunks[c] <= plan.slot_bytes for c in streamed)


def two_layers() -> tuple[list[torch.nn.Linear], Streamer]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    # 64 + 64 bytes per layer (weight, bias padded): one 128-byte chunk each; 200 bytes: one slot.
    params = [p for layer in layers for p in layer.parameters()]
    streamer = Streamer([("a", layers[0]), ("b", layers[1])], params, 128, 200, 0, torch.device("cpu"), HostStreams())
    return layers, streamer


def test_host_chunks_hold_the_parameters_and_slots_are_reused():
    layers, streamer = two_layers()
    assert streamer.plan.slots == 1 and streamer.plan.resident == frozenset()
    expected = layers[0].weight.detach().clone()
    streamer._fetch_unit(0, pin=True)
    assert layers[0].weight.untyped_storage().data_ptr() == streamer.slots[0].data_ptr()
    with pytest.raises(RuntimeError, match="no free slot for chunk 1"):
        streamer._fetch_unit(1, pin=True)  # the only slot is pinned: never evicted
    streamer._unpin(0)
    streamer._fetch_unit(1, pin=True)
    assert layers[0].weight.untyped_storage().data_ptr() == streamer.host[0].data_ptr()
    assert torch.equal(layers[0].weight, expected)
    assert streamer.h2d_bytes == 256


def test_a_resident_chunk_on_the_cpu_is_its_host_chunk_and_its_refills_stay_ordered_and_counted():
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    params = [p for layer in layers for p in layer.parameters()]
    streams = HostStreams()
    streams.copy_delay = 0.01  # each refill completes late: its use must wait for it
    streams.log = []
    # Layer b is in no unit: its chunk is resident (read outside the hooks, refilled before each step).
    streamer = Streamer([("a", layers[0])], params, 128, 300, 0, torch.device("cpu"), streams)
    assert streamer.plan.resident == frozenset({1})
    assert streamer.resident[1].data_ptr() == streamer.host[1].data_ptr()  # no memory of its own
    for _ in range(2):
        streamer.refresh_unhooked()
        assert layers[1].weight.data_ptr() == streamer.host[1].data_ptr()
        streamer.release_all()  # after a backward: the next use refills it
    assert streamer.h2d_bytes == 2 * 128  # what a device copies, though no bytes moved here
    copies = [e for e in streams.log if e[0] == "copy_in"]
    idle = [e[1] for e in streams.log if e[0] == "record" and e[2] == ("idle",)]
    assert [e[3] for e in copies] == [("fetch", 1, "resident")] * 2
    assert copies[1][2] == idle[0]  # the second refill waits for the release after the first use
    assert [e[1] for e in streams.log if e[0] == "wait"] == [e[1] for e in copies]  # each use waits
    streams.close()


def test_a_saved_view_of_a_slot_survives_the_slot_being_reused():
    layers, streamer = two_layers()
    expected = layers[0].weight.detach().t().clone()
    streamer._fetch_unit(0, pin=True)
    packed = streamer.pack_saved(layers[0].weight.t())  # what autograd saves for a linear layer
    streamer._unpin(0)
    streamer._fetch_unit(1, pin=True)  # the slot now holds layer 1's chunk
    streamer._unpin(1)
    unpacked = streamer.unpack_saved(packed)  # fetches layer 0's chunk again
    assert torch.equal(unpacked, expected)
    assert unpacked.untyped_storage().data_ptr() == streamer.slots[0].data_ptr()
    activation = torch.randn(3, 5)
    assert streamer.unpack_saved(streamer.pack_saved(activation)) is activation


def test_the_step_peak_counts_where_it_is_above_every_unit():
    plan = plan_offload(CHUNKS, UNITS, 420, trace=TRACE, activation=[10, 10, 10, 10], activation_peak=70, prefetch=2)
    assert plan.activation_bytes == 70 and plan.slots == 3 and plan.device_bytes == 420


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prefetch": -1}, r"`prefetch=-1` must be a non-negative int"),
        ({"chunk_size": "lots"}, r"`chunk_size='lots'` is not a size"),
        ({"device_memory_budget": "16 apples"}, r"`device_memory_budget='16 apples'` is not a size"),
        ({"unit_types": []}, r"`unit_types` is empty"),
    ],
)
def test_configuration_errors_name_the_argument(options, message):
    from lightning_ckpt import ChunkedOffloadStrategy

    with pytest.raises(ValueError, match=message):
        ChunkedOffloadStrategy(**options)


def test_a_device_other_than_cuda_or_cpu_is_refused_at_construction():
    from lightning_ckpt import ChunkedOffloadStrategy

    with pytest.raises(ValueError, match=r"ChunkedOffloadStrategy\(device='mps'\): only CUDA devices"):
        ChunkedOffloadStrategy(device="mps")


def test_host_streams_run_late_copies_in_order_after_what_they_wait_for():
    streams = HostStreams()
    streams.copy_delay = 0.01
    streams.log = []
    src, dst = torch.arange(4.0), torch.zeros(4)
    release = streams.record(("release", 0, 0))
    first = streams.copy_in(dst, src, after=release, label="a")
    second = streams.copy_in(dst, src + 1, after=None, label="b")
    assert not first.query()  # still on the copy thread: a use must wait for it
    streams.wait(second, label="use")
    assert first.query() and torch.equal(dst, src + 1)  # in issue order, like a stream
    assert [e[0] for e in streams.log] == ["record", "copy_in", "copy_in", "wait"]
    assert streams.log[1][2] == release.id
    streams.close()


def test_host_grads_add_arrivals_and_earlier_gradients_as_autograd_does():
    from lightning_ckpt.offload.gradients import HostGrads

    p = torch.nn.Parameter(torch.zeros(3))
    buffer = torch.zeros(64, dtype=torch.uint8)
    grads = HostGrads(HostStreams(), [p], [(0, 0)], {0: buffer}, pin=False)
    a, b, c = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([7.0, 8.0, 9.0])
    grads.begin()
    for g in (a, b):  # a parameter whose gradient accumulator autograd made twice in one backward
        p.grad = g.clone()
        grads.arrive(p)
        assert p.grad is None  # the device gradient is gone; the host buffer has it
    grads.finish()
    assert torch.equal(p.grad, a + b) and p.grad.data_ptr() == buffer.data_ptr()
    grads.begin()  # gradient accumulation: the next backward adds to it
    assert p.grad is None
    p.grad = c.clone()
    grads.arrive(p)
    grads.finish()
    assert torch.equal(p.grad, (a + b) + c) and p.grad.data_ptr() == buffer.data_ptr()
    assert grads.d2h_bytes == 3 * 12


def test_prefetch_order_and_eviction_after_the_warm_up():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    # One 128-byte chunk per layer; the warm-up traces 240 bytes of activations: two slots fit.
    streamer = Streamer([(str(i), m) for i, m in enumerate(layers)], list(model.parameters()), 128, 584, 2, torch.device("cpu"), HostStreams())
    held: list[list[int | None]] = []
    for layer in layers:  # registered after the streamer's hooks: sees the slots after each fetch
        layer.register_forward_pre_hook(lambda module, args: held.append(list(streamer.holder)))
    x = torch.randn(3, 4, requires_grad=True)
    expected_grads = []
    for step in range(2):
        held.clear()
        with torch.autograd.graph.saved_tensors_hooks(streamer.pack_saved, streamer.unpack_saved):
            loss = model(x).pow(2).sum()
        loss.backward()
        streamer.end_backward()
        expected_grads.append([p.grad.clone() for p in model.parameters()])
        assert streamer.holder == [None] * len(streamer.slots)  # after backward: every slot free
        for p in model.parameters():
            p.grad = None
    assert streamer.plan.slots == 2 and streamer.plan.activation_bytes == 240
    # Layer 0 runs with layer 1 prefetched; layer 2 then takes layer 0's slot (used furthest
    # ahead: last in backward); layer 3 takes layer 1's.
    assert held == [[0, 1], [2, 1], [2, 3], [2, 3]]
    assert streamer.peak_device_bytes <= 584
    assert all(torch.equal(a, b) for a, b in zip(*expected_grads))  # same weights, same gradients


def test_the_host_gradients_scaler_keeps_the_scalers_state_and_results():
    """On CUDA the strategy makes Lightning's scaler copy its scale to the host before unscaling
    host gradients (tests/gpu covers the race); the scaler's settings, state and arithmetic stay."""
    from lightning_ckpt.lightning.offload_strategy import unscale_on_the_host

    def run(scaler: torch.amp.GradScaler, poison: bool) -> tuple[torch.Tensor, float]:
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([p], lr=1.0)
        scaler.scale((p * (float("inf") if poison else 2.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        return p.detach().clone(), scaler.get_scale()

    for poison in (False, True):
        plain = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        host = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        unscale_on_the_host(host)
        unscale_on_the_host(host)  # once is enough
        assert isinstance(host, torch.amp.GradScaler) and type(host).__mro__[2] is torch.amp.GradScaler
        a, b = run(plain, poison), run(host, poison)
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
        assert host.state_dict() == plain.state_dict()


def _two_backwards(order: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two 4x4 linears used in ``order``; one graph, two backwards (retain_graph) around the
    warm-up's end (as two ``manual_backward`` calls of one loss in the first training step)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    reference = copy.deepcopy(layers)
    x = torch.randn(2, 4)

    # Reference: plain autograd, gradients of the two backwards accumulated.
    h = x
    for i in order:
        h = reference[i](h)
    loss = h.pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()

    params = [p for layer in layers for p in layer.parameters()]
    # 128-byte chunk per layer; warm-up: one slot; after it everything fits (resident).
    streamer = Streamer([("a", layers[0]), ("b", layers[1])], params, 128, 100_000, 0, torch.device("cpu"), HostStreams())
    assert streamer.warming_up and streamer.plan.slots >= 1 and not streamer.plan.resident
    with torch.autograd.graph.saved_tensors_hooks(streamer.pack_saved, streamer.unpack_saved):
        h = x
        for i in order:
            h = layers[i](h)
        loss = h.pow(2).sum()
    streamer.begin_backward()
    loss.backward(retain_graph=True)
    streamer.end_backward()  # warm-up over: repacked, re-planned
    assert not streamer.warming_up
    streamer.begin_backward()
    loss.backward()
    streamer.end_backward()
    got = [p.grad for layer in layers for p in layer.parameters()]
    want = [p.grad for layer in reference for p in layer.parameters()]
    return got, want


def test_second_backward_after_the_warm_up_relayout_same_order():
    """A saved view of a slot, read by a backward after the warm-up made its chunk resident: on the
    CPU the resident chunk is a region of the host pool, at a storage offset of its own."""
    got, want = _two_backwards([0, 1])
    for g, w in zip(got, want):
        assert torch.allclose(g, w), (g, w)


def test_second_backward_after_the_warm_up_relayout_reversed_order():
    """The forward uses the layers in reverse: the warm-up's re-layout renumbers the chunks, and a
    saved view still reads its own parameter's bytes."""
    got, want = _two_backwards([1, 0])
    for g, w in zip(got, want):
        assert torch.allclose(g, w), (g, w)


def test_host_grads_one_wait_covers_every_copy_even_when_the_thread_starts_mid_backward():
    from lightning_ckpt.offload.gradients import HostGrads

    ps = [torch.nn.Parameter(torch.zeros(16)) for _ in range(3)]
    buffer = torch.zeros(3 * 64, dtype=torch.uint8)
    streams = HostStreams()
    grads = HostGrads(streams, ps, [(0, 0), (0, 64), (0, 128)], {0: buffer}, pin=False)
    grads.begin()
    for k, p in enumerate(ps):
        if k == 1:
            streams.copy_delay = 0.05  # the copy thread starts here; later copies are slow
        if k == 2:
            streams.copy_delay = 0.0  # would a later copy go synchronous and finish first?
        p.grad = torch.full((16,), float(k + 1))
        grads.arrive(p)
    grads.finish()
    for k, p in enumerate(ps):
        assert torch.equal(p.grad, torch.full((16,), float(k + 1))), k
    streams.close()

"""Run by test_fabric_distributed.py as a script: Fabric's launcher re-executes it for the other ranks.

``fabric_fit.py REPORT train STRATEGY N``: on N CPU ranks (gloo), STRATEGY (``fsdp2``:
``ShardedFabricModelParallelStrategy``; ``fsdp1``: ``ShardedFabricFSDPStrategy``; ``sharded-ddp``:
``ShardedFabricDDPStrategy``; ``ddp``: Fabric's own DDP with the plugin, synchronous only) trains 3 steps, writes the full (gathered) state to ``full-3.pt``, saves
``step=3.ckpt`` with ``fabric.save``, trains 3 more steps; then fresh objects are loaded from the
checkpoint with ``fabric.load`` and train the same 3 steps. Reports, from every rank, whether the
restored state equals the saved one and the resumed run ends equal to the uninterrupted one.

``fabric_fit.py REPORT reshard fsdp2 N CKPT FULL``: on N ranks, loads ``CKPT`` into fresh objects
and reports whether the full state equals ``FULL``.

``LCKPT_TEST_ASYNC=1``: the plugin saves asynchronously.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from distributed.sharded_fit import states_equal  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import lightning_ckpt as lc  # noqa: E402

ASYNC = os.environ.get("LCKPT_TEST_ASYNC") == "1"


def parallelize(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def make_fabric(strategy: str, devices: int) -> Fabric:
    if strategy == "fsdp2":
        chosen = lc.ShardedFabricModelParallelStrategy(parallelize, data_parallel_size=devices, tensor_parallel_size=1)
    elif strategy == "fsdp1":
        chosen = lc.ShardedFabricFSDPStrategy()
    elif strategy == "sharded-ddp":
        chosen = lc.ShardedFabricDDPStrategy()
    else:
        chosen = DDPStrategy()
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=chosen, plugins=[lc.ShardedCheckpointIO(async_save=ASYNC)])
    fabric.launch()
    return fabric


def setup(fabric: Fabric):
    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)
    )
    if isinstance(fabric.strategy, lc.ShardedFabricFSDPStrategy):
        # FSDP (1) wrapped by hand per Linear, then the whole: on CPU (device_id=cpu).
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        cpu = torch.device("cpu")
        for i, layer in enumerate(net):
            if isinstance(layer, torch.nn.Linear):
                net[i] = FSDP(layer, device_id=cpu, use_orig_params=True)
        net = FSDP(net, device_id=cpu, use_orig_params=True)
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    return model, optimizer


def train(fabric: Fabric, model, optimizer, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + fabric.global_rank)  # each rank its own batch
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()


def full_state(fabric: Fabric, model, optimizer=None) -> dict:
    """The whole model (and optimizer) state on every rank (a collective)."""
    module = model.module
    # Every rank gathers the whole (no cpu_offload: it would gather on rank 0 only), and copies
    # it: some tensors (the optimizer's steps) are the live ones.
    options = StateDictOptions(full_state_dict=True)
    state = {"model": get_model_state_dict(module, options=options)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer.optimizer, options=options)
    return clone(state)


def clone(value):
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def gather(fabric: Fabric, value) -> list:
    import torch.distributed as dist

    if fabric.world_size == 1:
        return [value]
    values: list = [None] * fabric.world_size
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    report, mode, strategy, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    fabric = make_fabric(strategy, devices)
    result: dict = {"world_size": fabric.world_size}
    if mode == "train":
        model, optimizer = setup(fabric)
        train(fabric, model, optimizer, 0, 3)
        saved = full_state(fabric, model, optimizer)
        if fabric.global_rank == 0:
            torch.save(saved, "full-3.pt")
        fabric.save("step=3.ckpt", {"model": model, "optimizer": optimizer, "step": 3, "note": "fabric"})
        train(fabric, model, optimizer, 3, 3)
        uninterrupted = full_state(fabric, model, optimizer)

        model2, optimizer2 = setup(fabric)
        state = {"model": model2, "optimizer": optimizer2, "step": 0}
        remainder = fabric.load("step=3.ckpt", state)
        restored = states_equal(full_state(fabric, model2, optimizer2), saved)
        train(fabric, model2, optimizer2, 3, 3)
        resumed = states_equal(full_state(fabric, model2, optimizer2), uninterrupted)
        # Loading the model alone leaves the optimizer's files unread (sharded) or returns them (DDP).
        model3, _ = setup(fabric)
        partial = sorted(fabric.load("step=3.ckpt", {"model": model3}))
        model_only = states_equal(full_state(fabric, model3)["model"], saved["model"])
        # A filtered save (biases left out) loads with strict=False; the biases keep their values.
        fabric.save("filtered.ckpt", {"model": model2, "step": 6}, filter={"model": lambda key, _: "bias" not in key})
        model4, _ = setup(fabric)
        before = full_state(fabric, model4)["model"]
        fabric.load("filtered.ckpt", {"model": model4}, strict=False)
        after, trained = full_state(fabric, model4)["model"], full_state(fabric, model2)["model"]
        filtered = all(
            torch.equal(after[k], before[k] if "bias" in k else trained[k]) for k in after
        ) and not all(torch.equal(after[k], trained[k]) for k in after)
        result.update(
            filtered_load=gather(fabric, filtered),
            step=state["step"],
            remainder=remainder,
            restored_equals_saved=gather(fabric, restored),
            resumed_equals_uninterrupted=gather(fabric, resumed),
            partial_remainder=partial,
            model_only_equals_saved=gather(fabric, model_only),
        )
    elif mode == "reshard":
        checkpoint, full = sys.argv[5], sys.argv[6]
        model, optimizer = setup(fabric)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(checkpoint, state)
        result.update(step=state["step"], restored_equals_saved=states_equal(full_state(fabric, model, optimizer), torch.load(full)))
    fabric.strategy.checkpoint_io.teardown()
    if fabric.global_rank == 0:
        with open(report, "w") as f:
            json.dump(result, f)
    close_process_group()
    # DDP's reducer, freed at interpreter exit after the group is gone, joins gloo's work loop while
    # holding the GIL that loop waits for (torch 2.13): rank 1 then never exits. Nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

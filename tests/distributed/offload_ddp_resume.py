"""Run by test_offload_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

Checkpoints move between ``ChunkedOffloadStrategy`` (one process, a budget that forces
streaming) and a 2-rank DDP Trainer (gloo, CPU), through ``ShardedCheckpointIO``, both ways.
One process and 2 ranks sum the gradients in another order, so the exact comparisons pair runs
that must agree bit for bit:

- offload -> DDP: the offload checkpoint equals a default-strategy checkpoint of the same run;
  DDP resumed from either trains alike (ChunkedAdamW), and so does DDP with
  ``torch.optim.AdamW(fused=True)`` resumed from the offload one; what each rank holds after the
  load (weights, optimizer state), before the next step, is the checkpoint's tensors.
- DDP -> offload: a 2-rank checkpoint (each rank writes its ChunkedAdamW share) resumes under
  ``ChunkedOffloadStrategy`` exactly as under the default strategy, with the checkpoint's
  tensors loaded into the host chunks and the optimizer.

Rank 0 writes a JSON report to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from chunked_adamw_fit import EPOCH, Net, flat  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from models import trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.format import manifest as fmt  # noqa: E402

WIDTH = 64
CHUNK = "17KiB"  # the offload strategy's chunk: one 64 x 64 layer (weight and bias) each


class Wide(Net):
    """``Net`` (its data, split across ranks as in one process) with layers wide enough to stream:
    ``optimizer`` is ``"chunked"`` (ChunkedAdamW) or ``"adamw"`` (torch's, fused)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer == "chunked")
        layers: list[torch.nn.Module] = [torch.nn.Linear(9, WIDTH), torch.nn.Tanh()]
        for _ in range(6):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
        self.layers = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 3))


def param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in Wide("chunked").parameters())


# two streaming slots of one layer each and the activations (~64 KB): 2/3 of the parameter bytes
BUDGET = 70_000


class Loaded(Callback):
    """What the run holds once the checkpoint is restored, before its first step: the weights and
    the optimizer's ``state_dict()`` (a collective under sharded DDP: every rank runs this)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        state = trainer.optimizers[0].state_dict()["state"]
        self.optimizer = {k: {n: t.detach().clone() for n, t in s.items()} for k, s in state.items()}


def matches(weights: dict, state: dict, path: str) -> bool:
    """Are ``weights`` (a model's state dict) and ``state`` (an AdamW state dict's ``"state"``)
    exactly the tensors saved at ``path``?"""
    saved = lc.load_checkpoint(path)
    saved_weights, saved_state = saved["state_dict"], saved["optimizer_states"][0]["state"]
    if set(saved_weights) != set(weights) or set(saved_state) != set(state) or not saved_state:
        return False
    if not all(torch.equal(weights[key], tensor) for key, tensor in saved_weights.items()):
        return False
    for index, entry in saved_state.items():
        mine = state[index]
        if set(entry) != set(mine) or float(entry["step"]) != float(mine["step"]):
            return False
        if not all(torch.equal(mine[n].cpu(), entry[n]) for n in ("exp_avg", "exp_avg_sq")):
            return False
    return True


def same_tensors(loaded: Loaded, path: str) -> bool:
    """Does the run ``loaded`` watched hold exactly the checkpoint at ``path`` after the load?"""
    return matches(loaded.weights, loaded.optimizer, path)


def same_checkpoints(a: str, b: str) -> bool:
    """Do two checkpoints hold bit-identical weights and AdamW state?"""
    first = lc.load_checkpoint(a)
    return matches(first["state_dict"], first["optimizer_states"][0]["state"], b)


def fit(
    optimizer: str = "chunked", max_steps: int = 2 * EPOCH, ddp: bool = False, offload: bool = False,
    dirpath: str | None = None, ckpt_path: str | None = None,
) -> tuple[Trainer, Wide, Loaded]:
    """A seeded fit of ``Wide(optimizer)``: 2 DDP ranks, ``ChunkedOffloadStrategy`` under ``BUDGET``
    or the default strategy (one process); saving every ``EPOCH`` steps to ``dirpath``."""
    seed_everything(0, workers=True)
    model, loaded = Wide(optimizer), Loaded()
    callbacks: list[Callback] = [loaded]
    if dirpath:
        # under DDP every rank writes its part: its own ChunkedAdamW share
        callbacks.append(lc.ShardedModelCheckpoint(dirpath=dirpath, every_n_train_steps=EPOCH, save_top_k=-1, metrics_file=None))
    strategy = "ddp" if ddp else lc.ChunkedOffloadStrategy(device_memory_budget=BUDGET, chunk_size=CHUNK) if offload else "auto"
    trainer = Trainer(
        **trainer_kwargs(
            devices=2 if ddp else 1, strategy=strategy, max_steps=max_steps, callbacks=callbacks,
            enable_checkpointing=bool(dirpath), plugins=[lc.ShardedCheckpointIO()], use_distributed_sampler=False,
        )
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if model.chunked:
        trainer.optimizers[0].wait()
    return trainer, model, loaded


def saved(folder: str) -> str:
    (name,) = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    return os.path.join(folder, name)


def moment_writers(path: str) -> list[int]:
    """The ranks whose files hold the checkpoint's AdamW moments."""
    with open(os.path.join(path, fmt.MANIFEST_FILE), "rb") as f:
        manifest = fmt.Manifest.from_bytes(f.read(), path)
    files = [
        piece["file"] if record.chunks else record.file
        for record in manifest.tensors
        if record.component.startswith("optimizer") and record.path[-1] in ("exp_avg", "exp_avg_sq")
        for piece in (record.chunks or [None])
    ]
    return sorted({manifest.files[f].rank for f in files})


def one_process(root: str) -> dict:
    """Rank 0 alone, beside the live 2-rank group: the offload and default-strategy runs."""
    _, uninterrupted, _ = fit()
    offload_trainer, _, _ = fit(offload=True, max_steps=EPOCH, dirpath=os.path.join(root, "offload"))
    stats = offload_trainer.strategy.memory_stats()
    fit(max_steps=EPOCH, dirpath=os.path.join(root, "default"))
    ddp_ckpt = saved(os.path.join(root, "ddp"))
    offload_trainer, from_ddp_offload, loaded_offload = fit(offload=True, ckpt_path=ddp_ckpt)
    resumed_stats = offload_trainer.strategy.memory_stats()
    _, from_ddp_default, loaded_default = fit(ckpt_path=ddp_ckpt)
    return {
        "uninterrupted": flat(uninterrupted),
        "report": {
            "ddp_ckpt_moment_writers": moment_writers(ddp_ckpt),
            "budget": BUDGET,
            "param_bytes": param_bytes(),
            "offload_streamed_chunks": [stats["streamed_chunks"], resumed_stats["streamed_chunks"]],
            "offload_peak_within_budget": max(s["peak_device_bytes"] for s in (stats, resumed_stats)) <= BUDGET,
            "offload_ckpt_equals_default_ckpt": same_checkpoints(*(saved(os.path.join(root, k)) for k in ("offload", "default"))),
            "ddp_to_offload_loaded_equals_ckpt": same_tensors(loaded_offload, ddp_ckpt),
            "ddp_to_default_loaded_equals_ckpt": same_tensors(loaded_default, ddp_ckpt),
            "ddp_to_offload_losses_equal_default": from_ddp_offload.losses == from_ddp_default.losses,
            "ddp_to_offload_steps": len(from_ddp_offload.losses),
            "ddp_to_offload_weights_equal_default": torch.equal(flat(from_ddp_offload), flat(from_ddp_default)),
        },
    }


def main(report: str) -> None:
    root = os.path.dirname(report)
    # 2 ranks: uninterrupted, and a checkpoint at EPOCH (each rank writes its ChunkedAdamW share)
    trainer, ddp_uninterrupted, _ = fit(ddp=True)
    fit(ddp=True, max_steps=EPOCH, dirpath=os.path.join(root, "ddp"))
    rank = trainer.global_rank
    local = one_process(root) if rank == 0 else None
    torch.distributed.barrier()  # rank 1 waits for the one-process checkpoints
    offload_ckpt, default_ckpt = saved(os.path.join(root, "offload")), saved(os.path.join(root, "default"))
    resumed = {}
    runs = (("offload", "chunked", offload_ckpt), ("default", "chunked", default_ckpt), ("adamw", "adamw", offload_ckpt))
    for label, optimizer, path in runs:
        ddp_trainer, model, loaded = fit(optimizer, ddp=True, ckpt_path=path)
        agree = ddp_trainer.strategy.all_gather(flat(model))
        exact = ddp_trainer.strategy.all_gather(torch.tensor([same_tensors(loaded, path)]))
        resumed[label] = (model, bool(exact.all()), all(torch.equal(agree[0], g) for g in agree))
    if rank != 0:
        return
    assert local is not None
    (offload, offload_loaded, offload_agree), (default, default_loaded, _), (adamw, adamw_loaded, _) = resumed.values()
    result = local["report"] | {
        "world_size": trainer.world_size,
        "offload_to_ddp_loaded_equals_ckpt": offload_loaded,
        "default_to_ddp_loaded_equals_ckpt": default_loaded,
        "offload_to_ddp_adamw_loaded_equals_ckpt": adamw_loaded,
        "offload_to_ddp_ranks_agree": offload_agree,
        "offload_to_ddp_losses_equal_default": offload.losses == default.losses,
        "offload_to_ddp_steps": len(offload.losses),
        "offload_to_ddp_weights_equal_default": torch.equal(flat(offload), flat(default)),
        "offload_to_ddp_adamw_losses_equal_chunked": adamw.losses == offload.losses,
        "offload_to_ddp_adamw_weights_equal_chunked": torch.equal(flat(adamw), flat(offload)),
        # against the uninterrupted runs: other reduction orders, so close, not equal
        "offload_to_ddp_max_diff_ddp": float((flat(offload) - flat(ddp_uninterrupted)).abs().max()),
        "offload_to_ddp_max_diff_one_process": float((flat(offload) - local["uninterrupted"]).abs().max()),
    }
    with open(report, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    close_process_group()

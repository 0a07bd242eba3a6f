"""Run by test_chunked_adamw_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

2 CPU ranks (gloo), DDP, a sharded ChunkedAdamW saved by ShardedModelCheckpoint through
ShardedCheckpointIO: every rank writes its own chunks' moments (no gather of the state at the
save). The checkpoint then resumes on 2 ranks (against the uninterrupted run), on 1 rank with
ChunkedAdamW and with torch.optim.AdamW (against each other), and holds torch's full AdamW state.
``argv[2] == "async"`` saves with ``async_save=True``. Rank 0 writes a JSON report to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from chunked_adamw_fit import EPOCH, Net, flat  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from models import trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.format import manifest as fmt  # noqa: E402

ASYNC = len(sys.argv) > 2 and sys.argv[2] == "async"
gathers: list[int] = []  # broadcasts of optimizer state on the training thread (state_dict's gather)
_broadcast = torch.distributed.broadcast


def counting_broadcast(tensor, *args, **kwargs):
    if threading.current_thread() is threading.main_thread() and kwargs.get("group") is not None:
        gathers.append(tensor.numel())
    return _broadcast(tensor, *args, **kwargs)


torch.distributed.broadcast = counting_broadcast


def fit(chunked: bool, max_steps: int, devices: int = 2, dirpath=None, ckpt_path=None):
    seed_everything(0, workers=True)
    model = Net(chunked)
    saving = [lc.ShardedModelCheckpoint(dirpath=dirpath, every_n_train_steps=EPOCH, save_top_k=-1)] if dirpath else []
    trainer = Trainer(
        **trainer_kwargs(
            devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=max_steps, callbacks=saving,
            enable_checkpointing=bool(dirpath), plugins=[lc.ShardedCheckpointIO(async_save=ASYNC)],
            use_distributed_sampler=False,
        )
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if chunked:
        trainer.optimizers[0].wait()
    return trainer, model


def main(report: str) -> None:
    folder = os.path.join(os.path.dirname(report), "ckpts")
    _, uninterrupted = fit(True, 2 * EPOCH)
    gathers.clear()
    trainer, _ = fit(True, EPOCH, dirpath=folder)
    trainer.strategy.checkpoint_io.wait()
    gathered_at_save = len(gathers)
    optimizer = trainer.optimizers[0]
    full = optimizer.state_dict()  # the plain state dict: gathered, torch's full format
    # state-dict index of each parameter -> the rank that owns (holds and writes) its moments
    index = {id(p): i for i, p in enumerate(trainer.lightning_module.parameters())}
    owner = {index[id(p)]: chunk.owner for chunk in optimizer._chunks for p in chunk.params}
    # async: the bytes this rank's arena copied into its staging pool, against its own moments' bytes
    owned_bytes = sum(8 * p.numel() for chunk in optimizer._chunks if chunk.owned for p in chunk.params)
    staged = trainer.strategy.all_gather(torch.tensor([optimizer._arena.snapshot_bytes, owned_bytes]))
    (name,) = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    path = os.path.join(folder, name)
    resumed_trainer, resumed = fit(True, 2 * EPOCH, ckpt_path=path)
    gathered = resumed_trainer.strategy.all_gather(flat(resumed))
    if trainer.global_rank != 0:
        return
    with open(os.path.join(path, fmt.MANIFEST_FILE), "rb") as f:
        manifest = fmt.Manifest.from_bytes(f.read(), path)
    writers = {}  # "param index/moment" -> the ranks whose files hold it
    for record in manifest.tensors:
        if record.component.startswith("optimizer") and record.path[-1] in ("exp_avg", "exp_avg_sq"):
            files = [piece["file"] for piece in record.chunks or []] or [record.file]
            writers[f"{record.path[-2]}/{record.path[-1]}"] = sorted({manifest.files[f].rank for f in files})
    saved = lc.load_checkpoint(path)["optimizer_states"][0]
    same_as_full = all(
        torch.equal(saved["state"][k][n], full["state"][k][n]) for k in full["state"] for n in ("step", "exp_avg", "exp_avg_sq")
    )
    # One rank: ChunkedAdamW and torch's AdamW resumed from the 2-rank checkpoint train alike.
    _, one_rank_chunked = fit(True, 2 * EPOCH, devices=1, ckpt_path=path)
    _, one_rank_adamw = fit(False, 2 * EPOCH, devices=1, ckpt_path=path)
    with open(report, "w") as f:
        json.dump(
            {
                "world_size": trainer.world_size,
                "owner": {str(k): v for k, v in owner.items()},
                "writers": writers,
                "gathered_at_save": gathered_at_save,
                "arena_staged_and_owned_bytes": staged.view(-1, 2).tolist(),
                "saved_equals_full_state": same_as_full,
                "resumed_equals_uninterrupted": torch.equal(flat(resumed), flat(uninterrupted)),
                "ranks_agree": all(torch.equal(gathered[0], g) for g in gathered),
                "one_rank_chunked_equals_adamw": torch.equal(flat(one_rank_chunked), flat(one_rank_adamw)),
                "one_rank_max_diff": float((flat(one_rank_chunked) - flat(uninterrupted)).abs().max()),
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1])
    close_process_group()

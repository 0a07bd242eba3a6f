"""The multi-rank save protocol without a process group: ranks are threads with their own plugin.

Plain tensors are replicated on every rank (as in DDP), so each is written by one rank; rank 0
commits once every part is published. Checks the guarantee (nothing committed unless every rank's
part is durable and consistent) and the version-3 manifest.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from helpers import flip_byte

import lightning_ckpt as lc
from lightning_ckpt.format import manifest as fmt


def _state(step: int = 1) -> dict:
    g = torch.Generator().manual_seed(step)
    weights = {f"layer{i}.weight": torch.randn(64, 32, generator=g) for i in range(6)}
    weights["empty"] = torch.zeros(0, 3)
    weights["head.weight"] = weights["layer0.weight"]  # tied
    return {
        "state_dict": weights,
        "optimizer_states": [{"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(10, dtype=torch.bfloat16)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "epoch": 0,
        "global_step": step,
        "hyper_parameters": {"name": "tiny", "sizes": (1, 2)},
    }


def _save_on_ranks(path, states, timeout: float = 30.0, skip: tuple[int, ...] = ()) -> list[BaseException | None]:
    """Every rank (a thread) calls save_sharded; returns each rank's exception or None."""
    errors: list[BaseException | None] = [None] * len(states)

    def rank(r: int) -> None:
        io = lc.ShardedCheckpointIO(part_timeout=timeout)
        try:
            io.save_sharded(states[r], path, r, len(states), lambda token: "t0ken")
        except BaseException as err:  # noqa: BLE001 - reported to the test
            errors[r] = err
        finally:
            io.teardown()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(states)) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_two_ranks_spread_the_replicated_state_and_one_process_loads_it_whole(tmp_path):
    path = tmp_path / "c.ckpt"
    assert _save_on_ranks(path, [_state(), _state()]) == [None, None]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == fmt.SHARDED_FORMAT_VERSION == 3
    assert manifest["extra"] == {"world_size": 2}
    shards = {n: f["rank"] for n, f in manifest["files"].items() if n.endswith(".safetensors")}
    assert set(shards.values()) == {0, 1} and all(f"rank{r:05d}" in n for n, r in shards.items())
    loaded = lc.load_checkpoint(path)
    assert _equal(loaded, _state())
    lc.verify_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]  # no part folder left


def test_a_rank_that_saves_other_tensors_fails_the_save_and_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "c.ckpt"
    assert _save_on_ranks(path, [_state(1), _state(1)]) == [None, None]
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    other = _state(2)
    other["state_dict"]["extra"] = torch.ones(3)
    errors = _save_on_ranks(path, [_state(2), other])
    assert isinstance(errors[0], lc.CheckpointWriteError) and "different set of tensors" in str(errors[0])
    assert "Nothing was committed" in str(errors[0])
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_a_sharded_load_leaves_skipped_components_unread(tmp_path):
    # Evaluating from a sharded checkpoint reads no optimizer file (not even to hash it).
    from lightning_ckpt.format.dcp import load_sharded

    path = tmp_path / "c.ckpt"
    assert _save_on_ranks(path, [_state(), _state()]) == [None, None]
    optimizer_files = [p for p in path.iterdir() if p.name.startswith("optimizer")]
    assert optimizer_files
    for file in optimizer_files:
        flip_byte(file, file.stat().st_size - 1)
    targets = {"state_dict": {k: torch.zeros_like(v) for k, v in _state()["state_dict"].items()}}
    loaded = load_sharded(path, targets, skip=("optimizer_states",))
    assert "optimizer_states" not in loaded and loaded["global_step"] == 1
    assert _equal(targets["state_dict"], _state()["state_dict"])  # loaded in place
    with pytest.raises(lc.CorruptCheckpointError, match="optimizer"):
        load_sharded(path, targets)


def test_ranks_agree_on_the_layout_whatever_device_their_shards_live_on():
    # Rank k's shards are on cuda:k: a layout that counted devices failed every multi-GPU save.
    from lightning_ckpt.save.ranks import layout_digest, plan_part

    tensors = plan_part(_state(), 0, 2, 2**20).tensors
    assert {t["device"] for t in tensors} == {"cpu"}
    assert layout_digest([{**t, "device": "cuda:1"} for t in tensors]) == layout_digest(tensors)
    for field, other in (("shape", [1]), ("dtype", "float16"), ("path", ["elsewhere"])):
        assert layout_digest([{**tensors[0], field: other}, *tensors[1:]]) != layout_digest(tensors), field


def test_a_missing_rank_times_out_on_rank_0_and_nothing_is_committed(tmp_path):
    path = tmp_path / "c.ckpt"
    errors = _save_on_ranks(path, [_state(), _state()], timeout=1.0, skip=(1,))
    assert isinstance(errors[0], lc.CheckpointWriteError)
    assert "ranks [1] did not finish" in str(errors[0]) and "shared filesystem" in str(errors[0])
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # rank 0 removed the shared folder


def test_a_damaged_piece_is_named_on_load(tmp_path):
    path = tmp_path / "c.ckpt"
    assert _save_on_ranks(path, [_state(), _state()]) == [None, None]
    victim = sorted(path.glob("model-rank00001-*.safetensors"))[0]
    flip_byte(victim, victim.stat().st_size - 5)
    with pytest.raises(lc.CorruptCheckpointError, match=victim.name):
        lc.load_checkpoint(path)


def test_the_next_run_removes_part_folders_of_other_runs(tmp_path):
    stale = tmp_path / ".c.ckpt.lckpt-part-deadbeef-3"
    stale.mkdir()
    (stale / "model-rank00001-00001-of-00001.safetensors").write_bytes(b"x" * 10)
    assert _save_on_ranks(tmp_path / "c.ckpt", [_state(), _state()]) == [None, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


def test_sharded_resume_from_a_url_without_local_dir_names_the_fix():
    import lightning_ckpt as lc
    from lightning_ckpt.lightning.strategies import _local_copy

    strategy = lc.ShardedModelParallelStrategy()
    io = lc.ShardedCheckpointIO()
    with pytest.raises(ValueError, match=r"needs `ShardedCheckpointIO\(local_dir=\.\.\.\)`.*convert URL \./local\.ckpt"):
        _local_copy(strategy, io, "s3://bucket/run/last.ckpt")


def test_a_reused_storage_reader_reads_the_checkpoint_as_it_is_now(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lightning_ckpt.format.dcp import ShardedStorageReader

    path = tmp_path / "last.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, path)
    storage = ShardedStorageReader(path)
    key = '["state_dict", "w"]'
    for value in (0.0, 1.0):
        if value:  # replaced since the first load (an atomic re-save of the same path)
            lc.save_checkpoint({"state_dict": {"w": torch.full((3,), value)}}, path)
        target = {key: torch.empty(3)}
        dcp.load(target, storage_reader=storage, no_dist=True)
        assert torch.equal(target[key], torch.full((3,), value))
    storage.files.close()

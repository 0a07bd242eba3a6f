"""ckpt_path="last" with a damaged newest checkpoint on 2 CPU ranks (gloo): every rank skips the
same damaged checkpoints and resumes from the same one, without a collective to agree."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


# ``flip``: last.ckpt was saved in the same step as epoch=1-step=4.ckpt, so incremental saves made
# its files hard links of that checkpoint's: the flipped byte damages both (one file on disk), and
# the checksum failures fall back twice, to epoch=0-step=2.ckpt.
@pytest.mark.parametrize(("how", "used"), [("flip", "epoch=0-step=2.ckpt"), ("truncate-both", "epoch=0-step=2.ckpt")])
def test_every_rank_resumes_from_the_same_intact_checkpoint(tmp_path, how, used):
    result = run_script("distributed/ddp_damaged_last.py", how, tmp_path=tmp_path)
    assert result["world_size"] == 2 and result["ranks_agree"]
    ranks = [json.loads((tmp_path / f"report.json.rank{r}").read_text()) for r in range(2)]
    assert [r["ckpt_path"] for r in ranks] == [str(tmp_path / "ckpts" / used)] * 2
    assert all(r["global_step"] == 6 for r in ranks)  # 3 epochs of 2 steps: the run went on

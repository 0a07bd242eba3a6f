"""CUDA, 2 GPUs: ``ChunkedAdamW`` under DDP sending the owners' updated values over NCCL
(``exchange="device"``) trains the same weights, bit for bit, as the host exchange over gloo."""

from __future__ import annotations

import pytest
import torch
from helpers import run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def test_device_exchange_equals_the_host_exchange(tmp_path):
    result = run_script("distributed/chunked_adamw_fit.py", "gpu", tmp_path=tmp_path)
    assert result["world_size"] == 2
    assert result["backends"] == ["gloo", "nccl"]
    assert result["device_equals_host"] and result["losses_equal"] and result["ranks_agree"]

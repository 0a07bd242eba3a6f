"""``export_hf`` / ``python -m lightning_ckpt export-hf``: a checkpoint's model as a Hugging Face
folder that ``from_pretrained`` loads exactly (models from small configs, random init, no
downloads); the prefix found or refused with the candidates; the config from the checkpoint or
given; tied weights stored once; shards and their index; clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from models import trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc
from lightning_ckpt import cli

transformers = pytest.importorskip("transformers")

VOCAB = 128


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, architectures=["GPT2LMHeadModel"]
    )


class Finetune(LightningModule):
    """The Hugging Face model under an attribute that is not ``model`` (its keys: ``net.model...``),
    its config saved as a dict (loads with ``weights_only``)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (8, 16), generator=gen)), batch_size=4)


def assert_loads_exactly(out, trained: torch.nn.Module, cls, **kwargs) -> None:
    loaded = cls.from_pretrained(out, **kwargs)
    expected = trained.state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value.to(got[key].dtype)), key


@pytest.mark.parametrize("config", [llama_config, gpt2_config], ids=["llama", "gpt2-tied"])
def test_a_trained_model_exports_and_from_pretrained_loads_it_exactly(tmp_path, config):
    seed_everything(0)
    module = Finetune(config().to_dict())
    trainer = Trainer(**trainer_kwargs(max_steps=2, default_root_dir=tmp_path, plugins=[lc.ShardedCheckpointIO()]))
    trainer.fit(module)
    checkpoint = tmp_path / "final.ckpt"
    trainer.save_checkpoint(checkpoint)

    out = tmp_path / "hf"
    result = lc.export_hf(checkpoint, out)
    assert result["prefix"] == "net." and result["files"] == ["model.safetensors"]
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == config().model_type
    cls = getattr(transformers, config().architectures[0])
    assert_loads_exactly(out, module.net, cls)
    if config is gpt2_config:  # tied: the head is the embedding, stored once
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:
            assert "lm_head.weight" not in f.keys() and "transformer.wte.weight" in f.keys()
        assert result["dropped_tied"] == ["lm_head.weight"]


def test_cast_sharded_output_from_the_command_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    checkpoint = tmp_path / "c.ckpt"
    lc.save_checkpoint({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, checkpoint)
    config_dir = tmp_path / "cfg"
    llama_config().save_pretrained(config_dir)

    out = tmp_path / "hf"
    argv = ["export-hf", str(checkpoint), str(out), "--config", str(config_dir), "--dtype", "bf16", "--max-shard-size", "100KB"]
    assert cli.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files) and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert_loads_exactly(out, model.to(torch.bfloat16), transformers.LlamaForCausalLM, torch_dtype=torch.bfloat16)


def test_a_remote_checkpoint_exports(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    url = "memory://bucket/export/c.ckpt"
    state = {f"lm.{k}": v for k, v in model.state_dict().items()}
    lc.save_checkpoint({"state_dict": state, "hyper_parameters": {"config": gpt2_config().to_dict()}}, url)
    assert lc.export_hf(url, tmp_path / "hf")["prefix"] == "lm."
    assert_loads_exactly(tmp_path / "hf", model, transformers.GPT2LMHeadModel)


def test_a_config_object_in_the_hyper_parameters_needs_trust_or_a_config(tmp_path):
    model = transformers.LlamaForCausalLM(llama_config())
    checkpoint = tmp_path / "c.ckpt"
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    lc.save_checkpoint({"state_dict": state, "hyper_parameters": {"config": llama_config()}}, checkpoint)
    with pytest.raises(lc.ExportError, match="--unsafe-load"):
        lc.export_hf(checkpoint, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # nothing written
    lc.export_hf(checkpoint, tmp_path / "hf", weights_only=False)
    assert_loads_exactly(tmp_path / "hf", model, transformers.LlamaForCausalLM)


def test_the_prefix_is_refused_with_the_candidates_when_several_attributes_hold_the_model(tmp_path):
    model = transformers.LlamaForCausalLM(llama_config())
    state = {f"{attr}.{k}": v for attr in ("student", "teacher") for k, v in model.state_dict().items()}
    checkpoint = tmp_path / "c.ckpt"
    lc.save_checkpoint({"state_dict": state, "hyper_parameters": {"config": llama_config().to_dict()}}, checkpoint)
    with pytest.raises(lc.ExportError, match="'student', 'teacher'"):
        lc.export_hf(checkpoint, tmp_path / "hf")
    assert lc.export_hf(checkpoint, tmp_path / "hf", prefix="teacher")["prefix"] == "teacher."
    with pytest.raises(lc.ExportError, match="no key of its state_dict starts with 'pupil.'"):
        lc.export_hf(checkpoint, tmp_path / "hf", prefix="pupil")
    # weights of another model under the one attribute: refused, naming what is missing
    other = {f"net.{k}": v for k, v in transformers.GPT2LMHeadModel(gpt2_config()).state_dict().items()}
    lc.save_checkpoint({"state_dict": other, "hyper_parameters": {"config": llama_config().to_dict()}}, tmp_path / "o.ckpt")
    with pytest.raises(lc.ExportError, match="no attribute of the LightningModule holds all of the model's weights"):
        lc.export_hf(tmp_path / "o.ckpt", tmp_path / "other")


def test_without_a_config_the_export_is_refused_saying_how_to_give_one(tmp_path, capsys):
    checkpoint = tmp_path / "c.ckpt"
    lc.save_checkpoint({"state_dict": {"net.w": torch.ones(2)}}, checkpoint)
    assert cli.main(["export-hf", str(checkpoint), str(tmp_path / "hf")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "no model config in its hyper_parameters" in err and "--config" in err
    with pytest.raises(SystemExit) as refused:  # argparse: the choices named
        cli.main(["export-hf", str(checkpoint), str(tmp_path / "hf"), "--dtype", "int8"])
    assert refused.value.code == 2 and "choose from 'bf16', 'fp16', 'fp32'" in capsys.readouterr().err
    with pytest.raises(lc.ExportError, match="`dtype='int8'`: use one of bf16, fp16, fp32"):
        lc.export_hf(checkpoint, tmp_path / "hf", dtype="int8", config={"model_type": "llama"})

"""`model.device` / `--device`: where the model, engine and trainer run, and no silent CPU fallback.

These run on any machine: CUDA is made to look absent (or present) with monkeypatch, so the error
paths are tested the same way on a CPU box and on a GPU one.
"""

from pathlib import Path

import pytest
import torch

from rzero.cli import main
from rzero.config import ConfigError, load_config
from rzero.engine import Engine
from rzero.model.io import load_model
from rzero.ops import AttentionMeta, resolve_device
from rzero.train.trainer import Trainer, TrainerSettings

SUITE = Path(__file__).resolve().parent / "fixtures" / "eval" / "suite.toml"


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_resolve_device(no_cuda):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"'cuda' was asked for.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(RuntimeError, match="'cuda:1' was asked for"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")


def test_auto_picks_cuda_when_torch_sees_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)  # restored after
    precision = torch.get_float32_matmul_precision()
    try:
        assert resolve_device("auto") == torch.device("cuda")
        # CUDA fp32 matmuls in IEEE fp32: no TF32 anywhere.
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(precision)


def test_config_device(no_cuda):
    assert load_config(None).model.device == "cpu"
    assert load_config(None, ["model.device=auto"]).model.device == "auto"
    with pytest.raises(ConfigError, match=r"model\.device"):
        load_config(None, ["model.device=gpu"])
    # The Ray workers and trainer ranks build their models on the CPU: refused, not moved quietly.
    with pytest.raises(ConfigError, match="one process only"):
        load_config(None, ["model.device=cuda", "rollout.backend=ray"])
    with pytest.raises(ConfigError, match="one process only"):
        load_config(None, ["model.device=cuda", "train.world_size=2"])


@pytest.mark.parametrize("command", ["check", "serve", "eval"])
def test_cli_device_cuda_without_cuda_is_an_error(command, tiny_dense_dir, no_cuda, capsys):
    argv = [command, "--model", str(tiny_dense_dir), "--device", "cuda"]
    if command == "eval":
        argv += ["--suite", str(SUITE)]
    assert main(argv) == 2
    assert "'cuda' was asked for" in capsys.readouterr().err


def test_engine_and_trainer_stay_where_the_model_is(tiny_dense_dir):
    model = load_model(tiny_dense_dir, "fp32")
    engine = Engine(model, eos_token_ids=[], num_kv_blocks=4)
    assert engine.device == torch.device("cpu")
    assert all(k.device.type == "cpu" for pair in engine.kv_caches for k in pair)
    trainer = Trainer(model, torch.float32, TrainerSettings(), device="cpu")
    assert trainer.device == torch.device("cpu") and trainer.master.device == torch.device("cpu")


def test_attention_meta_moves_every_index_tensor():
    meta = AttentionMeta.build([3, 1], [0, 5], [[0], [1]], row_tile=16)
    assert meta.to("cpu") is meta  # already there: no copy
    moved = meta.to("meta")  # PyTorch's shape-only device: shows every tensor field moves
    assert moved.device == torch.device("meta")
    assert moved.slot_mapping.device.type == moved.q_index.device.type == moved.kv_lens.device.type == "meta"
    assert (moved.q_lens, moved.num_tokens, moved.padded_tokens) == (meta.q_lens, meta.num_tokens, meta.padded_tokens)

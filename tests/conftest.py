"""Shared fixtures: tiny locally built model directories, offline Hugging Face."""

from __future__ import annotations

import os

# transformers / huggingface_hub read these when first imported: set them before any test does.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_dense_dir(model_root) -> Path:
    """`rzero init-model --preset tiny-dense` (fp32 weights, seed 0), built once per session."""
    from rzero.model.presets import init_model

    return init_model("tiny-dense", model_root / "tiny-dense", seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(model_root) -> Path:
    """`rzero init-model --preset tiny-moe` (fp32 weights, seed 0), built once per session."""
    from rzero.model.presets import init_model

    return init_model("tiny-moe", model_root / "tiny-moe", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_dense_dir, tiny_moe_dir) -> dict[str, Path]:
    return {"tiny-dense": tiny_dense_dir, "tiny-moe": tiny_moe_dir}

"""Checkpoints of a run: written completely or not at all, loaded completely or not at all.

  checkpoints/step_N/  model/ (HF format: safetensors + config + tokenizer, fp32 master weights),
                       trainer.pt (optimizer, scheduler, ring buffer), orchestrator.pt (rollouts
                       generated but not yet trained on), rng.pt
  checkpoints/latest   name of the newest complete checkpoint (replaced atomically)
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from rzero.files import atomic_write_text
from rzero.model.io import load_model, read_tokenizer_files, save_model
from rzero.rollout.orchestrator import Orchestrator
from rzero.train.trainer import Trainer


def save_checkpoint(
    run_dir: Path, step: int, trainer: Trainer, backend: Orchestrator, tokenizer_files: dict[str, bytes]
) -> Path:
    """Write checkpoints/step_N completely, then point `latest` at it; keep the last two."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(trainer.master, tmp / "model", extra_files=tokenizer_files, dtype="fp32")
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
        torch.save(backend.state_dict(), tmp / "orchestrator.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = run_dir / "checkpoints" / name
    return path if name and path.is_dir() else None


def _checkpoints_newest_first(run_dir: Path) -> list[Path]:
    steps = [p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]), reverse=True)


def load_checkpoint(path: Path) -> dict:
    """Everything a resume needs from one checkpoint, fully loaded (so a damaged file shows here,
    not halfway through the run). Raises ValueError naming the damaged file."""
    state = {"model": load_model(path / "model", "fp32"), "tokenizer_files": read_tokenizer_files(path / "model")}
    for key in ("trainer", "orchestrator", "rng"):
        file = path / f"{key}.pt"
        try:
            # On the CPU whatever device saved it: the trainer moves each tensor to its own device
            # (optimizer state follows its parameters; ring weights are copied into the model).
            state[key] = torch.load(file, weights_only=False, map_location="cpu")
        except Exception as err:  # truncated or garbage pickles raise many different types
            raise ValueError(f"{file}: cannot be read ({type(err).__name__}: {err})") from None
    return state


def find_resume_checkpoint(run_dir: Path, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads completely, falling back to older ones (saying so)."""
    for path in _checkpoints_newest_first(run_dir):
        try:
            return path, load_checkpoint(path)
        except (OSError, ValueError) as err:
            log(f"checkpoint {path.name} is unusable ({err}); trying the previous one")
    return None

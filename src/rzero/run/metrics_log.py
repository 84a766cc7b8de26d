"""metrics.jsonl (one JSON object per trainer step; names in docs/design.md), TensorBoard, W&B."""

from __future__ import annotations

import json
from pathlib import Path

from rzero.config import RunConfig
from rzero.files import atomic_write_text


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a torn or garbled line (a kill mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLog:
    def __init__(self, run_dir: Path, config: RunConfig, keep_below_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if keep_below_step is not None and self.path.exists():
            # On resume, drop steps after the checkpoint: they are computed again.
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) is not None]
            kept = [line for line in kept if _step_of(line) < keep_below_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")
        self.tb = None
        if config.run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A deep queue: with the default (10) each step's few dozen scalars block on the writer
            # thread, which waits for the GIL behind the rollout worker: ~17 ms a step in the default job.
            self.tb = SummaryWriter(str(run_dir / "tb"), max_queue=4096)
        self.wandb = None
        if config.run.wandb:
            import wandb  # optional: only when the user asks for it

            self.wandb = wandb.init(project=config.run.wandb_project, dir=str(run_dir), config=config.model_dump())

    def write(self, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        step = int(metrics["step"])
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

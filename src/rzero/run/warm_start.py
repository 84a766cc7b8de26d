"""Supervised warm start of a freshly built model on the task's reference answers.

The steps are the trainer's own (`Trainer.supervised_step`): the same scoring, micro-batching,
master-gradient copy and AdamW step as RL, with cross-entropy on the reference tokens.
"""

from __future__ import annotations

from rzero.config import RunConfig
from rzero.model.io import parse_dtype
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer, TrainerSettings

# Warm-start tasks come from indices disjoint from the RL run's (RL uses 0, 1, 2, ...).
FIRST_TASK = 10_000_000


def reference_rollout(env, tokenizer, index: int) -> Rollout:
    """Task `index` with its reference answer as the completion. Environment text in the
    reference (tool responses) is context, not a target: mask 0."""
    task = env.task(index)
    prompt = tokenizer.encode(task.prompt, add_special_tokens=False).ids
    reference = env.reference(task)
    completion, mask = [], []
    for text, trained in [(reference, True)] if isinstance(reference, str) else reference:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        completion += ids
        mask += [int(trained)] * len(ids)
    n = len(completion)
    return Rollout(prompt, completion, [0.0] * n, [0] * n, 0.0, mask=None if all(mask) else mask)


def warm_start(model: Qwen3ForCausalLM, tokenizer, env, config: RunConfig, log=print) -> float:
    """Supervised steps on the task's reference answers, in place on `model` (fp32); returns the
    last loss. A non-finite loss stops it with an error (nothing diverged is kept)."""
    ws = config.warm_start
    settings = TrainerSettings(
        lr=ws.lr,
        weight_decay=0.01,  # AdamW's default, which warm starts have always used
        grad_clip=1.0,
        micro_batch_tokens=config.train.micro_batch_tokens,
        # Reference answers of distinct tasks: a prompt rarely repeats next to itself, so sharing
        # saves nothing here; off, a base model keeps the bits it had before sharing existed.
        share_prompts=False,
        decompose=False,
    )
    trainer = Trainer(
        model, parse_dtype(config.model.dtype), settings, numerics=config.model.numerics, device=config.model.device
    )
    loss = float("nan")
    for step in range(ws.steps):
        batch = [reference_rollout(env, tokenizer, FIRST_TASK + step * ws.batch_size + i) for i in range(ws.batch_size)]
        loss = trainer.supervised_step(batch)["loss"]
        if loss != loss:  # NaN: the step was skipped because the loss or the gradient was not finite
            raise RuntimeError(
                f"warm start diverged at step {step + 1}/{ws.steps}; "
                f"lower warm_start.lr (now {ws.lr}) or set warm_start.steps = 0"
            )
        if step % 50 == 0 or step == ws.steps - 1:
            log(f"warm start {step + 1}/{ws.steps}: loss {loss:.3f}")
    return loss

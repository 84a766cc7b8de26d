"""`rzero train`: the whole run, wiring the trainer (rzero.train) to the rollout workers
(rzero.rollout): warm start, the RL loop, checkpoints and resume, the metrics log, the report."""

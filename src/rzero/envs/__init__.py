"""Tasks and tools the rollouts run in."""

"""GRPO/DAPO: advantages, losses, importance sampling, dynamic sampling, policy, trainer, checkpoints."""

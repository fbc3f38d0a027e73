"""Online reinforcement learning (GRPO and its kin): rollouts, rewards, advantages and the loss."""

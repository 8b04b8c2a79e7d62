"""Training steps, state, optimizers, LoRA, preemption and metrics: next-token prediction and
any objective that fits the `objective.Objective` protocol."""

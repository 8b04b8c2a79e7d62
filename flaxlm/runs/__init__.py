"""The Gin-bound run functions a user starts (train, grpo, evaluate, infer/score, import/export,
serve, the lm-eval harness) and the step loop only they share."""

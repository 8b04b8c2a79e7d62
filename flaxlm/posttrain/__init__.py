"""Objectives beyond next-token prediction: preference (DPO, IPO, ORPO, SimPO), RL (GRPO) and
rewards."""

"""Reward functions for GRPO (verifiable rewards), bindable in Gin.

A reward function takes the prompts, the sampled completions (text, up to EOS) and the
reference answers, all `Sequence[str]` of one length, and returns one float per completion:

    def my_reward(prompts, completions, answers) -> list[float]: ...

Bind a list in Gin (`GrpoConfig.reward_fns = [@rewards.exact_match, @my_module.my_reward]`)
with optional `reward_weights`; the reward of a completion is the weighted sum.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import gin


def _normalise(text: str) -> str:
    return " ".join(text.split())


@gin.configurable
def exact_match(
    prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
) -> list[float]:
    """1.0 where the completion equals the answer (whitespace collapsed and stripped)."""
    del prompts
    return [float(_normalise(c) == _normalise(a)) for c, a in zip(completions, answers)]


@gin.configurable
def leading_number_match(
    prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
) -> list[float]:
    """1.0 where the first number in the completion equals the answer's (GSM8K-style
    grading of arithmetic; a completion with no number scores 0)."""
    del prompts
    out = []
    for completion, answer in zip(completions, answers):
        found = re.search(r"-?\d+(?:\.\d+)?", completion)
        expected = re.search(r"-?\d+(?:\.\d+)?", answer)
        out.append(float(bool(found and expected) and found.group() == expected.group()))
    return out


@gin.configurable
def format_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    pattern: str = r"-?\d+",
) -> list[float]:
    """1.0 where the whole completion (stripped) matches the regex `pattern` (a format
    check: e.g. digits only, or `<think>.*</think><answer>.*</answer>`)."""
    del prompts, answers
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

"""Reasoning in chat answers, as vLLM's `--reasoning-parser` returns it: what a model writes
inside its thinking block (`<think>` ... `</think>`) comes back as the message's `reasoning`
(vLLM's field, formerly `reasoning_content`), the rest as its `content`; streamed, as
`delta.reasoning` then `delta.content`.

- `qwen3` (Qwen3), `glm45` (GLM-4.5 on): an answer that opens with `<think>` reasons until
  `</think>`; one that does not (thinking turned off, the template closing an empty block in
  the prompt) is all content.
- `deepseek_r1` (DeepSeek-R1, QwQ-32B), `minimax_m2` (MiniMax-M2): templates that open the
  block in the prompt: the answer starts inside it (a `<think>` it writes anyway is dropped);
  `seed_oss` (Seed-OSS) alike with `<seed:think>` ... `</seed:think>`, as vLLM's reads it.
- `deepseek_v3` (DeepSeek-V3.1 on): as `deepseek_r1` where the request's
  `chat_template_kwargs` turn thinking on (`thinking` or `enable_thinking`), else all
  content, as the template renders it.
- `mistral` (Magistral): an answer that opens with `[THINK]` reasons until `[/THINK]`.
- `openai_gptoss` (gpt-oss): harmony's analysis channel is the reasoning, the final channel
  the content (`harmony.py`; its calls reach the `openai` tool-call format).

An answer that ends inside its block (at `max_tokens`) is all reasoning, streamed or whole
(vLLM's whole answers give such a Qwen3 answer as content instead). The tags are read from
the text: a chat answer keeps them where its tokenizer marks them special (`tag_ids`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flaxlm.runs.serve import harmony
from flaxlm.runs.serve.stream import prefix_at_end


@dataclasses.dataclass(frozen=True)
class Block:
    """A family's thinking block: its tags, and where an answer starts (`inside`: in the
    block; `opens`: inside only if it writes the opening tag first; `per_request`: inside
    where the request's template variables turn thinking on, else with no block;
    `harmony`: gpt-oss's channels, `harmony.Splitter`)."""

    start: str
    end: str
    starts: str


THINK = Block("<think>", "</think>", "opens")
INSIDE = Block("<think>", "</think>", "inside")
PARSERS: dict[str, Block] = {
    "qwen3": THINK,
    "glm45": THINK,
    "deepseek_r1": INSIDE,
    "minimax_m2": INSIDE,
    "seed_oss": Block("<seed:think>", "</seed:think>", "inside"),
    "deepseek_v3": Block("<think>", "</think>", "per_request"),
    "mistral": Block("[THINK]", "[/THINK]", "opens"),
    "openai_gptoss": Block(harmony.CHANNEL, harmony.END, "harmony"),
}


def tag_ids(added_vocab: Mapping[str, int], parser: str) -> frozenset[int]:
    """The ids of `parser`'s tags where a tokenizer has them as tokens of their own (its
    `get_added_vocab()`): kept in the text the parser reads even where the tokenizer marks
    them special (vLLM's parsers read the ids; flaxlm's read the text)."""
    block = PARSERS[parser]
    tags = harmony.TAGS if block.starts == "harmony" else (block.start, block.end)
    return frozenset(added_vocab[tag] for tag in tags if tag in added_vocab)


def check_parser(name: str | None) -> None:
    """A ValueError naming the setting for a parser flaxlm does not have."""
    if name is not None and name not in PARSERS:
        raise ValueError(
            f"serve.reasoning_parser={name!r}: expected None or one of {list(PARSERS)}."
        )


def thinks(template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request's template variables turn thinking on (`per_request` blocks)."""
    kwargs = template_kwargs or {}
    return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))


class Splitter:
    """Splits an answer's text, fed in pieces as it streams, into reasoning and content,
    holding back what may still turn out to be a tag (`feed`, then `flush` at the end)."""

    def __init__(self, parser: str, template_kwargs: Mapping[str, Any] | None = None):
        """`template_kwargs`: the request's `chat_template_kwargs` (`deepseek_v3` reads
        them)."""
        block = PARSERS[parser]
        self.start, self.end = block.start, block.end
        thinking = thinks(template_kwargs)
        self.starts_inside = block.starts == "inside" or (
            block.starts == "per_request" and thinking
        )
        # 'start' (may still open with the tag), 'reasoning', 'content'
        self.state = "content" if block.starts == "per_request" and not thinking else "start"
        self.thought = False  # whether the answer had a block
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` makes final."""
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                if self.held.startswith(self.start):
                    self.held, self.state, self.thought = (
                        self.held[len(self.start) :],
                        "reasoning",
                        True,
                    )
                    continue
                if self.start.startswith(self.held):
                    return reasoning, content  # may still be the opening tag
                self.state = "reasoning" if self.starts_inside else "content"
                self.thought = self.starts_inside
                continue
            if self.state == "content":
                content, self.held = content + self.held, ""
                return reasoning, content
            at = self.held.find(self.end)
            if at >= 0:
                reasoning += self.held[:at]
                self.held, self.state = self.held[at + len(self.end) :], "content"
                continue
            keep = prefix_at_end(self.held, self.end)
            reasoning += self.held[: len(self.held) - keep]
            self.held = self.held[len(self.held) - keep :]
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held once the answer has ended."""
        held, self.held = self.held, ""
        if self.state == "start":
            self.thought = self.starts_inside
            self.state = "reasoning" if self.starts_inside else "content"
        return (held, "") if self.state == "reasoning" else ("", held)


def splitter(
    parser: str, template_kwargs: Mapping[str, Any] | None = None
) -> Splitter | harmony.Splitter:
    """What splits an answer's reasoning from its content for `parser` (`template_kwargs`:
    the request's `chat_template_kwargs`, which `deepseek_v3` reads)."""
    if PARSERS[parser].starts == "harmony":
        return harmony.Splitter()
    return Splitter(parser, template_kwargs)


def split(
    text: str, parser: str, template_kwargs: Mapping[str, Any] | None = None
) -> tuple[str | None, str | None]:
    """`(reasoning, content)` of a whole answer, as its streamed pieces would add up: the
    reasoning None where the answer had no block, the content None where it is empty."""
    splitter_ = splitter(parser, template_kwargs)
    parts = [splitter_.feed(text), splitter_.flush()]
    reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
    return (reasoning if splitter_.thought else None), (content or None)

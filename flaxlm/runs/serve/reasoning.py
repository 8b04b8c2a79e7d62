"""Reasoning in chat answers, as vLLM's `--reasoning-parser` returns it: what a model writes
inside its `<think>` ... `</think>` block comes back as the message's `reasoning` (vLLM's
field, formerly `reasoning_content`), the rest as its `content`; streamed, as
`delta.reasoning` then `delta.content`.

- `qwen3` (Qwen3): an answer that opens with `<think>` reasons until `</think>`; one that
  does not (Qwen3 with `enable_thinking=False`, whose template closes an empty block in the
  prompt) is all content.
- `deepseek_r1` (DeepSeek-R1, QwQ-32B: templates that open the block in the prompt): the
  answer starts inside the block (a `<think>` it writes anyway is dropped).

An answer that ends inside its block (at `max_tokens`) is all reasoning, streamed or whole
(vLLM's whole answers give such a Qwen3 answer as content instead). The tags are read from
the text: a chat answer keeps them where its tokenizer marks them special (`tag_ids`)."""

from __future__ import annotations

from typing import Any

from flaxlm.runs.serve.stream import prefix_at_end

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def tag_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tags where a tokenizer has them as tokens of their own: kept in the
    text the parser reads even where the tokenizer marks them special (vLLM's parsers read
    the ids; flaxlm's read the text)."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return frozenset(added[tag] for tag in (START, END) if tag in added)


def check_parser(name: str | None) -> None:
    """A ValueError naming the setting for a parser flaxlm does not have."""
    if name is not None and name not in PARSERS:
        raise ValueError(
            f"serve.reasoning_parser={name!r}: expected None or one of {list(PARSERS)}."
        )


class Splitter:
    """Splits an answer's text, fed in pieces as it streams, into reasoning and content,
    holding back what may still turn out to be a tag (`feed`, then `flush` at the end)."""

    def __init__(self, parser: str):
        self.starts_inside = parser == "deepseek_r1"
        self.state = "start"  # 'start' (may still open with <think>), 'reasoning', 'content'
        self.thought = False  # whether the answer had a block
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` makes final."""
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                if self.held.startswith(START):
                    self.held, self.state, self.thought = self.held[len(START) :], "reasoning", True
                    continue
                if START.startswith(self.held):
                    return reasoning, content  # may still be the opening tag
                self.state = "reasoning" if self.starts_inside else "content"
                self.thought = self.starts_inside
                continue
            if self.state == "content":
                content, self.held = content + self.held, ""
                return reasoning, content
            at = self.held.find(END)
            if at >= 0:
                reasoning += self.held[:at]
                self.held, self.state = self.held[at + len(END) :], "content"
                continue
            keep = prefix_at_end(self.held, END)
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


def split(text: str, parser: str) -> tuple[str | None, str | None]:
    """`(reasoning, content)` of a whole answer, as its streamed pieces would add up: the
    reasoning None where the answer had no block, the content None where it is empty."""
    splitter = Splitter(parser)
    parts = [splitter.feed(text), splitter.flush()]
    reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
    return (reasoning if splitter.thought else None), (content or None)

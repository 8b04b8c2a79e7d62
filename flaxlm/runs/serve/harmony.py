"""gpt-oss's answers in OpenAI's harmony format, read as vLLM serves them
(`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`).

An answer is a run of messages, each `HEADER<|message|>BODY` and ended by `<|end|>` (the last
by a stop token, `<|return|>` or `<|call|>`, which decodes to nothing); the next one starts
`<|start|>assistant`. The header names the message's channel (`<|channel|>analysis`, `final`,
`commentary`) and, for a tool call, its recipient (`to=functions.NAME`, before or after the
channel, then `<|constrain|>json`). `Splitter` turns the analysis channel into the answer's
reasoning and the final and commentary channels into its content; a call to a function
reaches the content as `<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|end|>`,
which the `openai` tool-call format (`tool_formats.py`) reads into the message's
`tool_calls`. The tags are special tokens in gpt-oss's tokenizer: a chat answer keeps them
where this parser reads it (`reasoning.tag_ids`)."""

from __future__ import annotations

import re

from flaxlm.runs.serve.stream import prefix_at_end

START, END, MESSAGE, CHANNEL, CONSTRAIN = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
)
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN)
CALL = f"{CHANNEL}commentary to="  # how a function call reaches the content
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||\Z)")


def header(text: str) -> tuple[str | None, str | None]:
    """(channel, function) of a message's header: the function's name where the message is
    a call to one (`to=functions.NAME`), else None."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        channel = re.split(r"\s|<\||to=", text[at + len(CHANNEL) :], maxsplit=1)[0] or None
    recipient = _RECIPIENT.search(text)
    name = recipient.group(1) if recipient else None
    function = name[len("functions.") :] if name and name.startswith("functions.") else None
    return channel, function


class Splitter:
    """Splits a harmony answer, fed in pieces as it streams, into reasoning (the analysis
    channel) and content (the rest, calls as `CALL` messages), holding back what may still
    turn out to be a tag (`feed`, then `flush`), as `reasoning.Splitter` does for
    `<think>` blocks."""

    def __init__(self) -> None:
        self.state = "header"  # 'header' (until <|message|>) or 'body' (until <|end|>)
        self.channel: str | None = None
        self.function: str | None = None
        self.thought = False  # whether the answer had an analysis message
        self.messages = 0
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` makes final."""
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "header":
                at = self.held.find(MESSAGE)
                if at < 0:
                    return reasoning, content  # the header is not whole yet
                self.channel, self.function = header(self.held[:at])
                self.held, self.state = self.held[at + len(MESSAGE) :], "body"
                self.messages += 1
                if self.function is not None:
                    content += f"{CALL}functions.{self.function}{MESSAGE}"
                continue
            at = self.held.find(END)
            ended = at >= 0
            if not ended:
                at = len(self.held) - prefix_at_end(self.held, END)
            body, self.held = self.held[:at], self.held[at + (len(END) if ended else 0) :]
            if self.channel == "analysis" and self.function is None:
                reasoning, self.thought = reasoning + body, True
            else:
                content += body + (END if ended and self.function is not None else "")
            if not ended:
                return reasoning, content
            self.state = "header"
            if self.held.startswith(START):
                self.held = self.held[len(START) :]

    def flush(self) -> tuple[str, str]:
        """What is still held once the answer has ended: the end of a body; a header cut
        off gives nothing, unless the answer had no message at all (then it is content)."""
        held, self.held = self.held, ""
        if self.state == "header":
            return "", ("" if self.messages else held)
        if self.channel == "analysis" and self.function is None:
            self.thought = True
            return held, ""
        return "", held

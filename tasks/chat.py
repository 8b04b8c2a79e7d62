"""Chat SFT and preference tasks over local JSONL files, rendered with a chat template.

Encoding (signed offset; `flaxlm.models.features.decode_signed` reads it back): a token `id`
that carries loss is stored as `id + 1`, one that does not as `-(id + 1)`, and 0 stays
padding. So id 0 survives packing and padding, and the loss mask travels with the tokens
through any seqio pipeline. Read the chat task with `features.ChatFeatureConverter` and the
preference task with `features.PreferenceFeatureConverter` (`DatasetConfig.feature_converter`).

Chat records (`register_chat_task`), one conversation a line, in either form:
  OpenAI:   {"messages": [{"role": "system"|"user"|"assistant"|..., "content": str}, ...]}
  ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}
The tokenizer's own chat template renders the whole conversation (`apply_chat_template`).
Every assistant turn is trained, nothing else (system prompt, user turns, the template's
role headers). An assistant turn's tokens are found by prefix rendering: for assistant
message i, messages[:i] rendered with the generation prompt (the prompt) and messages[:i+1]
(prompt and answer) must both be token prefixes of the whole rendering; the tokens between
their ends are the turn's: its content and its end-of-turn token (all the model must
generate after the generation prompt). A template that is not prefix-consistent (one that
renders earlier turns differently once a later turn follows, e.g. by dropping their
reasoning) fails naming the record and the first differing tokens; no mask is guessed.

Trailing whitespace: tokens the template places after the turn's last special token
(ChatML's newline after <|im_end|>, Gemma's after <end_of_turn>) are not trained. The model
stops at its end-of-turn token, and at inference the template supplies that newline as
part of the next prompt. They stay in the sequence, as context without loss.

Preference records (`register_preference_task`), one pair a line:
  plain:          {"prompt": str, "chosen": str, "rejected": str}
  conversational: {"prompt" (or "messages"): [messages...], "chosen": str | [one assistant
                  message], "rejected": the same, "tools"?, "chat_template_kwargs"?}
Plain text with an HF tokenizer is tokenized as TRL's DPO does it (`plain_pair_as_trl`:
the tokenizer's special tokens, EOS appended to an answer only when its text lacks it);
with a seqio vocabulary it is encoded as is and each answer ends with its EOS; a
conversational prompt is the template's rendering with the generation prompt, and an
answer the rendering of prompt + answer minus the prompt (prefix-checked as above; all of
it trained, the template's whitespace after the end-of-turn token too, as TRL's DPO does).
`chosen` and `rejected` are signed sequences: the prompt negative, the answer positive.

Truncation: a conversation longer than `max_length` tokens is cut on the right; a pair
longer than that first loses the start of its prompt (keeping at least the last
`max_prompt_length` tokens), then the end of its answers. Each split's count is printed at
registration; `drop_truncated` drops those examples instead. Every record is read, checked
and rendered when the task is registered (a bad line fails before training, naming its file
and line) and held in memory as token ids; only indices are shuffled (deterministic).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gin
import numpy as np
import seqio
import tensorflow as tf

from flaxlm.data import vocabularies
from flaxlm.data.jsonl_reader import read_numbered_jsonl
from flaxlm.data.vocabularies import CHAT_TEMPLATE_ARGUMENTS, HuggingFaceVocabulary
from tasks.jsonl import in_memory_token_dataset, split_file_lists

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
Messages = list[dict[str, Any]]


def signed(ids: Sequence[int], loss: bool) -> list[int]:
    """`ids` in the signed-offset encoding: `id + 1` if they carry loss, else `-(id + 1)`."""
    return [int(i) + 1 for i in ids] if loss else [-(int(i) + 1) for i in ids]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ChatRenderer:
    """Renders conversations with a transformers tokenizer's own chat template as
    signed-offset ids (see the module docstring for what is trained)."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
                "template; use a chat model's tokenizer directory (its tokenizer_config.json "
                "or chat_template.jinja holds the template)."
            )
        self.tokenizer = tokenizer
        self.control_ids = vocabularies.special_token_ids(tokenizer)
        # The roles a conversation may use: those every chat template renders, and `tool`
        # where this template renders tool messages.
        template = str(tokenizer.chat_template)
        self.roles = ("system", "user", "assistant") + (("tool",) if "tool" in template else ())

    def check_roles(self, messages: Messages, where: str) -> None:
        """A ValueError naming `where` and the message of a role the template does not know
        (a misspelt 'asistant' would otherwise be trained as context, silently)."""
        for n, message in enumerate(messages):
            if message["role"] not in self.roles:
                raise ValueError(
                    f"{where}: message {n} has role {message['role']!r}, which the chat "
                    f"template does not know; use one of {list(self.roles)}."
                )

    def ids(
        self,
        messages: Messages,
        add_generation_prompt: bool = False,
        template_args: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """`apply_chat_template(messages, tokenize=True)`'s token ids, as a plain list;
        `template_args`: a record's `tools` and template variables (`template_args`)."""
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            **(template_args or {}),
        )
        if hasattr(out, "keys"):  # transformers 5: a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _prefix_error(self, where: str, i: int, what: str, a: list[int], b: list[int]) -> str:
        j = _first_difference(a, b)
        return (
            f"{where}: the chat template is not prefix-consistent, so the tokens of assistant "
            f"message {i} cannot be located: {what} (first difference at token {j}: "
            f"{self._text(a[j : j + 8])!r} vs {self._text(b[j : j + 8])!r}). Use a template "
            "that renders earlier turns the same whatever follows them, or fix the record."
        )

    def _turn_end(self, ids: list[int], start: int) -> int:
        """The end of the trained span `ids[start:]`: after its last special token when
        only whitespace follows that token, else the end."""
        last = max((j for j in range(start, len(ids)) if ids[j] in self.control_ids), default=-1)
        if last < 0 or last + 1 == len(ids) or self._text(ids[last + 1 :]).strip():
            return len(ids)
        return last + 1

    def spans(
        self,
        messages: Messages,
        trained: Sequence[int],
        where: str = "conversation",
        template_args: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The rendering of `messages` and, for each index in `trained` (an assistant
        message), the `[start, end)` of the tokens that carry its loss."""
        full = self.ids(messages, template_args=template_args)
        spans = []
        for i in trained:
            prompt = self.ids(messages[:i], True, template_args)
            upto = self.ids(messages[: i + 1], template_args=template_args)
            if upto[: len(prompt)] != prompt:
                what = (
                    f"messages[:{i}] with the generation prompt ({len(prompt)} tokens) is not "
                    f"a prefix of messages[:{i + 1}] ({len(upto)} tokens)"
                )
                raise ValueError(self._prefix_error(where, i, what, prompt, upto))
            if full[: len(upto)] != upto:
                what = (
                    f"messages[:{i + 1}] ({len(upto)} tokens) is not a prefix of the whole "
                    f"conversation ({len(full)} tokens)"
                )
                raise ValueError(self._prefix_error(where, i, what, upto, full))
            end = self._turn_end(upto, len(prompt))
            if end <= len(prompt):
                raise ValueError(f"{where}: assistant message {i} renders to no tokens.")
            spans.append((len(prompt), end))
        return full, spans

    def conversation(
        self,
        messages: Messages,
        where: str = "conversation",
        trained: Sequence[int] | None = None,
        template_args: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Signed ids of `messages`: the tokens of the assistant messages (or of the
        messages `trained` lists) positive, every other token negative."""
        if trained is None:
            trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        full, spans = self.spans(messages, trained, where, template_args)
        weights = np.zeros(len(full), bool)
        for start, end in spans:
            weights[start:end] = True
        return [t + 1 if w else -(t + 1) for t, w in zip(full, weights)]


def render_conversation(
    tokenizer: Any, messages: Messages, where: str = "conversation"
) -> list[int]:
    """Signed-offset ids of `messages` rendered by `tokenizer`'s chat template: every
    assistant turn (its content and end-of-turn token) positive, the rest negative. A
    template that is not prefix-consistent fails naming `where`."""
    return ChatRenderer(tokenizer).conversation(messages, where)


# ---------------------------------------------------------------------------- records


def _openai_messages(raw: Any, where: str, key: str) -> Messages:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of messages.")
    out = []
    for n, m in enumerate(raw):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"{where}: {key}[{n}] is not a {{'role', 'content'}} object.")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and m["role"] == "assistant"):
            raise ValueError(
                f"{where}: {key}[{n}] has 'tool_calls' {shown(calls)}; only an assistant "
                "message calls tools, with a list of calls."
            )
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise ValueError(
                f"{where}: {key}[{n}] has no string 'content' (only an assistant message "
                "with 'tool_calls' may leave it out or null)."
            )
        out.append(dict(m))
    return out


# Columns TRL reads and these tasks do not: images (for a vision processor).
UNREAD_COLUMNS = ("images", "image")
# What only a chat template reads: TRL hands them to it, and ignores them on plain text.
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")


def check_unread_columns(
    record: Mapping[str, Any], where: str, columns: Sequence[str] = UNREAD_COLUMNS
) -> None:
    """A ValueError naming `where` and the column for a record that sets one TRL would read
    and these tasks would not (its rows would differ from TRL's without a word)."""
    for key in columns:
        if _set(record, key):
            raise ValueError(
                f"{where}: {key!r} is a column TRL reads (images go to a vision processor) "
                "and this task does not: leave it out of the records."
            )


def _set(record: Mapping[str, Any], key: str) -> bool:
    return record.get(key) not in (None, [], {}, "")


def template_args(record: Mapping[str, Any], where: str) -> dict[str, Any]:
    """What a chat record hands `apply_chat_template` besides its messages, as TRL's SFT
    does: `tools` (a list of JSON schemas, or a JSON string of one; an empty list is none)
    and the `chat_template_kwargs` variables."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ValueError(f"{where}: 'tools' is a string but not JSON ({e}).") from e
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ValueError(f"{where}: 'tools' must be a list of JSON schemas, got {shown(tools)}.")
    variables = record.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise ValueError(f"{where}: 'chat_template_kwargs' must be an object.")
    reserved = sorted(set(variables) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise ValueError(
            f"{where}: chat_template_kwargs {reserved} are apply_chat_template's own "
            "arguments, not the template's variables."
        )
    return {**({"tools": tools} if tools else {}), **variables}


def shown(value: Any) -> str:
    """`value` for an error message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def chat_messages(record: Mapping[str, Any], where: str) -> Messages:
    """The `{"role", "content"}` messages of an OpenAI or ShareGPT record (an assistant's
    `tool_calls` and a message's other fields kept for the template); a malformed record
    fails naming `where` (file:line)."""
    check_unread_columns(record, where)
    if "messages" in record:
        return _openai_messages(record["messages"], where, "messages")
    if "conversations" not in record:
        raise ValueError(
            f"{where}: expected a 'messages' list (OpenAI: [{{'role', 'content'}}, ...]) or a "
            f"'conversations' list (ShareGPT: [{{'from', 'value'}}, ...]); got {sorted(record)}."
        )
    raw = record["conversations"]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of turns.")
    out = []
    for n, turn in enumerate(raw):
        if not (isinstance(turn, dict) and isinstance(turn.get("value"), str)):
            raise ValueError(f"{where}: conversations[{n}] is not a {{'from', 'value'}} object.")
        if turn.get("from") not in SHAREGPT_ROLES:
            raise ValueError(
                f"{where}: conversations[{n}] has 'from' {turn.get('from')!r}; expected one of "
                f"{sorted(SHAREGPT_ROLES)}."
            )
        out.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return out


def _answer(raw: Any, where: str, key: str, conversational: bool) -> str | dict[str, Any]:
    if isinstance(raw, str):
        return {"role": "assistant", "content": raw} if conversational else raw
    if conversational and isinstance(raw, list) and len(raw) == 1:
        (message,) = _openai_messages(raw, where, key)
        if message["role"] == "assistant":
            return message
    if conversational:
        raise ValueError(f"{where}: {key!r} must be a string or [one assistant message].")
    raise ValueError(
        f"{where}: {key!r} must be a string: a plain-text prompt takes plain-text answers (give "
        "the prompt as a list of messages for chat-template answers)."
    )


def preference_parts(
    record: Mapping[str, Any], where: str
) -> tuple[str | Messages, str | dict[str, Any], str | dict[str, Any]]:
    """`(prompt, chosen, rejected)` of a preference record: strings for a plain-text
    record, a message list and two assistant messages for a conversational one (whose
    `tools` and `chat_template_kwargs` `template_args` reads, as TRL's DPO does)."""
    check_unread_columns(record, where)
    if ("prompt" in record) == ("messages" in record):
        raise ValueError(f"{where}: give the prompt as 'prompt' (or 'messages'), exactly once.")
    key = "prompt" if "prompt" in record else "messages"
    prompt = record[key]
    conversational = not isinstance(prompt, str)
    if conversational:
        prompt = _openai_messages(prompt, where, key)
    for column in TEMPLATE_COLUMNS:
        if not conversational and _set(record, column):
            raise ValueError(
                f"{where}: {column!r} goes to the chat template, which a plain-text pair does "
                "not use (TRL ignores it there): give the prompt as a list of messages, or "
                f"leave {column!r} out."
            )
    for name in ("chosen", "rejected"):
        if name not in record:
            raise ValueError(f"{where}: missing {name!r}.")
    chosen = _answer(record["chosen"], where, "chosen", conversational)
    rejected = _answer(record["rejected"], where, "rejected", conversational)
    return prompt, chosen, rejected


# ---------------------------------------------------------------------------- splits


@dataclasses.dataclass
class Truncation:
    """What `max_length` cut from one split: examples read, examples too long, and the
    loss-carrying (answer) and prompt tokens lost."""

    examples: int = 0
    truncated: int = 0
    lost_answer: int = 0
    lost_prompt: int = 0
    untrainable: int = 0  # dropped by on_untrainable='drop'

    def line(self, task: str, split: str, max_length: int, noun: str, drop: bool) -> str:
        head = (
            f"Task {task!r} ({split}): {self.truncated} of {self.examples} {noun} longer than "
            f"{max_length} tokens"
        )
        tail = f"; {self.untrainable} that cannot teach dropped." if self.untrainable else "."
        if not self.truncated:
            return head + tail
        if drop:
            return head + ", dropped (drop_truncated)" + tail
        lost = f"{self.lost_answer} assistant tokens"
        if noun == "pairs":
            lost = f"{self.lost_prompt} prompt and {self.lost_answer} answer tokens"
        return head + f", truncated ({lost} lost)" + tail


UNTRAINABLE = ("error", "drop")


def check_untrainable(setting: str) -> None:
    if setting not in UNTRAINABLE:
        raise ValueError(f"on_untrainable={setting!r}: expected one of {list(UNTRAINABLE)}.")


def untrainable(where: str, why: str, setting: str, stats: Truncation) -> bool:
    """True (counted in `stats`) where `setting` drops an example that cannot teach; a
    ValueError naming the record where it is 'error'."""
    if setting == "drop":
        stats.untrainable += 1
        return True
    raise ValueError(
        f"{where}: {why}, so it cannot teach; fix or remove the record, or set "
        "on_untrainable='drop' to count and drop such records."
    )


def token_column(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`(values, row_splits)` of ragged int rows, as `in_memory_token_dataset` reads them."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.fromiter((t for r in rows for t in r), np.int32, int(splits[-1]))
    return values, splits


def _loss_tokens(ids: Sequence[int]) -> int:
    return sum(1 for t in ids if t > 0)


def render_chat_files(
    files: Sequence[str],
    renderer: ChatRenderer,
    max_length: int,
    drop_truncated: bool = False,
    on_untrainable: str = "error",
) -> tuple[list[list[int]], Truncation]:
    """Signed ids of every conversation in `files` (cut to `max_length`, or left out when
    `drop_truncated`) and what the cut cost. A conversation with an empty assistant message
    (no content to learn, only the end of the turn) is an error, or dropped and counted
    (`on_untrainable`)."""
    rows, stats = [], Truncation()
    for path in files:
        for number, record in read_numbered_jsonl(path, required=()):
            where = f"{path}:{number}"
            messages = chat_messages(record, where)
            renderer.check_roles(messages, where)
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError(f"{where}: no assistant message, so nothing to train on.")
            empty = [
                i
                for i, m in enumerate(messages)
                if m["role"] == "assistant"
                and not str(m.get("content") or "").strip()
                and not m.get("tool_calls")
            ]
            why = f"assistant message {empty[0] if empty else 0} is empty"
            if empty and untrainable(where, why, on_untrainable, stats):
                continue
            args = template_args(record, where)
            ids = renderer.conversation(messages, where, template_args=args)
            stats.examples += 1
            if len(ids) > max_length:
                stats.truncated += 1
                stats.lost_answer += _loss_tokens(ids[max_length:])
                if drop_truncated:
                    continue
                ids = ids[:max_length]
            rows.append(ids)
    return rows, stats


def _check_lengths(name: str, max_length: int, max_prompt_length: int | None = None) -> None:
    if max_length < 1:
        raise ValueError(f"Task {name!r}: max_length={max_length} must be positive.")
    if max_prompt_length is not None and not 0 < max_prompt_length < max_length:
        raise ValueError(
            f"Task {name!r}: max_prompt_length={max_prompt_length} must be positive and below "
            f"max_length={max_length} (room must be left for the answers)."
        )


def _register(
    name: str,
    columns: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]],
    vocabulary: seqio.Vocabulary,
) -> str:
    """Registers the task serving the in-memory `{split: {feature: column}}`."""

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        return in_memory_token_dataset(columns[split], shuffle=shuffle_files, seed=seed)

    features = next(iter(columns.values()))
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=tuple(columns)),
        preprocessors=[],  # already token ids (signed)
        output_features={
            k: seqio.Feature(vocabulary=vocabulary, add_eos=False, dtype=tf.int32) for k in features
        },
        metric_fns=[],
    )
    return name


@gin.configurable
def register_chat_task(
    name: str = gin.REQUIRED,
    split_files: Mapping[str, str | Sequence[str]] = gin.REQUIRED,
    tokenizer_path: str = gin.REQUIRED,
    max_length: int = gin.REQUIRED,
    drop_truncated: bool = False,
    on_untrainable: str = "error",
) -> str:
    """Registers (once) a chat SFT task named `name` with feature `targets` (signed ids of
    whole conversations, assistant turns positive); returns the name. Read it with
    `features.ChatFeatureConverter`, with `TASK_FEATURE_LENGTHS['targets'] >= max_length`.

    Args:
      split_files: {split: glob or list of globs} of JSONL files (OpenAI or ShareGPT lines).
      tokenizer_path: a local HF tokenizer directory with a chat template (the model's).
      max_length: longer conversations are cut to this many tokens on the right (one line
        per split says how many, and how many assistant tokens that lost).
      drop_truncated: drop those conversations instead.
      on_untrainable: a conversation with an empty assistant message: 'error' (naming its
        file and line) or 'drop' (counted in the split's line).
    """
    if name in seqio.TaskRegistry.names():
        return name
    _check_lengths(name, max_length)
    check_untrainable(on_untrainable)
    files = split_file_lists(name, split_files)
    vocabulary = HuggingFaceVocabulary(tokenizer_path)
    renderer = ChatRenderer(vocabulary.tokenizer)
    columns = {}
    for split, paths in files.items():
        rows, stats = render_chat_files(paths, renderer, max_length, drop_truncated, on_untrainable)
        print(stats.line(name, split, max_length, "conversations", drop_truncated), flush=True)
        if not rows:
            raise ValueError(f"Task {name!r} ({split}): no conversations left in {paths}.")
        columns[split] = {"targets": token_column(rows)}
    return _register(name, columns, vocabulary)


def truncate_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], max_length: int, max_prompt: int
) -> tuple[list[int], list[int], list[int]]:
    """The pair within `max_length` tokens a sequence: the prompt keeps its last tokens,
    at least `max_prompt` of them, then the answers lose their ends."""
    longest = max(len(chosen), len(rejected))
    keep = max(max_prompt, max_length - longest)
    if len(prompt) > keep:
        prompt = prompt[-keep:]
    room = max_length - len(prompt)
    return prompt, chosen[:room], rejected[:room]


def plain_pair_as_trl(
    vocabulary: HuggingFaceVocabulary, prompt: str, chosen: str, rejected: str
) -> tuple[list[int], list[list[int]]]:
    """Signed `(prompt ids, [chosen ids, rejected ids])` of a plain-text pair as TRL's DPO
    tokenizes it: the texts with the tokenizer's special tokens (its BOS, where it adds one),
    each answer's text ending with the EOS text once (appended only when not already there),
    prompt + answer tokenized together and the answer taken from where the two renderings
    part (tokens that merge across the boundary go to the answer)."""
    eos = vocabulary.tokenizer.eos_token
    if eos is None:
        raise ValueError(f"The tokenizer {vocabulary!r} has no EOS to end the answers.")
    prompt_ids = vocabulary.encode_text(prompt)
    full = [
        vocabulary.encode_text(prompt + (a if a.endswith(eos) else a + eos))
        for a in (chosen, rejected)
    ]
    n = min(_first_difference(prompt_ids, f) for f in full)
    return signed(prompt_ids[:n], False), [signed(f[n:], True) for f in full]


def render_preference_files(
    files: Sequence[str],
    vocabulary: seqio.Vocabulary,
    renderer: Callable[[], ChatRenderer],
    max_length: int,
    max_prompt_length: int,
    drop_truncated: bool = False,
    on_untrainable: str = "error",
) -> tuple[dict[str, list[list[int]]], Truncation]:
    """`{"chosen": rows, "rejected": rows}` of signed ids (prompt negative, answer positive)
    for every pair in `files`, truncated as `truncate_pair` says (or left out when
    `drop_truncated`), and what that cost. `renderer()` gives the chat template's renderer
    (asked only for conversational records). A pair whose chosen and rejected answers are
    the same tokens (its loss is the same under any policy: no gradient) is an error, or
    dropped and counted (`on_untrainable`)."""
    out: dict[str, list[list[int]]] = {"chosen": [], "rejected": []}
    stats = Truncation()
    for path in files:
        for number, record in read_numbered_jsonl(path, required=()):
            where = f"{path}:{number}"
            prompt, chosen, rejected = preference_parts(record, where)
            answers = []
            if isinstance(prompt, str) and isinstance(vocabulary, HuggingFaceVocabulary):
                ids, answers = plain_pair_as_trl(vocabulary, prompt, chosen, rejected)
            elif isinstance(prompt, str):
                if vocabulary.eos_id is None:
                    raise ValueError(f"{where}: the vocabulary has no EOS to end the answers.")
                ids = signed(vocabulary.encode(prompt), False)
                for answer in (chosen, rejected):
                    answers.append(signed([*vocabulary.encode(answer), vocabulary.eos_id], True))
            else:
                chat, extra = renderer(), template_args(record, where)
                chat.check_roles([*prompt, chosen, rejected], where)
                for answer in (chosen, rejected):
                    full, spans = chat.spans([*prompt, answer], [len(prompt)], where, extra)
                    # As TRL's DPO: the answer is all that follows the prompt (the
                    # template's newline after the end-of-turn token included).
                    start, ids = spans[0][0], signed(full[: spans[0][0]], False)
                    answers.append(signed(full[start:], True))
            stats.examples += 1
            why = "its chosen and rejected answers are the same tokens"
            if answers[0] == answers[1] and untrainable(where, why, on_untrainable, stats):
                continue
            pair = (ids, *answers)
            if len(ids) + max(len(a) for a in answers) > max_length:
                stats.truncated += 1
                cut = truncate_pair(ids, answers[0], answers[1], max_length, max_prompt_length)
                stats.lost_prompt += len(ids) - len(cut[0])
                for answer, kept in zip(answers, cut[1:]):
                    stats.lost_answer += _loss_tokens(answer) - _loss_tokens(kept)
                if drop_truncated:
                    continue
                pair = cut
            out["chosen"].append(pair[0] + pair[1])
            out["rejected"].append(pair[0] + pair[2])
    return out, stats


@gin.configurable
def register_preference_task(
    name: str = gin.REQUIRED,
    split_files: Mapping[str, str | Sequence[str]] = gin.REQUIRED,
    tokenizer_path: str | None = None,
    vocabulary: seqio.Vocabulary | None = None,
    max_length: int = gin.REQUIRED,
    max_prompt_length: int | None = None,
    drop_truncated: bool = False,
    on_untrainable: str = "error",
) -> str:
    """Registers (once) a preference task named `name` with features `chosen` and `rejected`
    (signed ids: the prompt negative, the answer positive); returns the name. Read it with
    `features.PreferenceFeatureConverter`, with both task feature lengths >= max_length.

    Args:
      split_files: {split: glob or list of globs} of JSONL files of pairs (plain or
        conversational, see the module docstring).
      tokenizer_path: a local HF tokenizer directory: its chat template renders the
        conversational records, and it is the vocabulary unless `vocabulary` is given.
      vocabulary: encodes plain-text records (answers end with its EOS); bytes if neither
        this nor `tokenizer_path` is given (the tiny models read bytes).
      max_length: the most tokens of prompt + answer; longer pairs lose the start of the
        prompt, then the end of the answers (one line per split says how many).
      max_prompt_length: the prompt keeps at least its last this many tokens when cut
        (default max_length // 2).
      drop_truncated: drop the pairs that do not fit instead.
      on_untrainable: a pair whose chosen and rejected answers are the same: 'error'
        (naming its file and line) or 'drop' (counted in the split's line).
    """
    if name in seqio.TaskRegistry.names():
        return name
    check_untrainable(on_untrainable)
    if max_prompt_length is None:
        max_prompt_length = max_length // 2
    _check_lengths(name, max_length, max_prompt_length)
    files = split_file_lists(name, split_files)
    hf = HuggingFaceVocabulary(tokenizer_path) if tokenizer_path else None
    vocabulary = vocabulary or hf or seqio.ByteVocabulary()
    chat: list[ChatRenderer] = []

    def renderer() -> ChatRenderer:
        if hf is None:
            raise ValueError(
                f"Task {name!r}: a conversational record needs a chat template; give "
                "tokenizer_path (a local HF tokenizer directory)."
            )
        if not chat:
            chat.append(ChatRenderer(hf.tokenizer))  # loaded once, on first use
        return chat[0]

    columns = {}
    for split, paths in files.items():
        rows, stats = render_preference_files(
            paths,
            vocabulary,
            renderer,
            max_length,
            max_prompt_length,
            drop_truncated,
            on_untrainable,
        )
        print(stats.line(name, split, max_length, "pairs", drop_truncated), flush=True)
        if not rows["chosen"]:
            raise ValueError(f"Task {name!r} ({split}): no pairs left in {paths}.")
        columns[split] = {k: token_column(v) for k, v in rows.items()}
    return _register(name, columns, vocabulary)

"""Writes train.jsonl and validation.jsonl (short multi-turn conversations in OpenAI
`{"messages": [...]}` form, some with a system message) and tokenizer/ beside this file.

tokenizer/ is a byte-level tokenizer with a ChatML chat template, for the tiny models of
gin/chat_sft.gin: ids 0-255 are the bytes (no merges), 256 <|endoftext|> (padding), 257
<|im_start|>, 258 <|im_end|> (EOS, the end of a turn); 259 ids fit the tiny models' 384.
Saved with transformers' `save_pretrained`, loaded with `local_files_only=True`.

Deterministic: `python data/chat/make.py` rewrites the same files (transformers and
tokenizers are needed for tokenizer/ only).
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = [None, None, "You are a helpful assistant.", "Answer briefly."]
NAMES = ["Ada", "Bo", "Cyd", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Lou", "Max"]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "piano", "lemon", "ocean"]
THINGS = {"sky": "blue", "grass": "green", "snow": "white", "sun": "yellow", "coal": "black"}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def arithmetic(rng: random.Random) -> list[tuple[str, str]]:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 5)
    return [
        (f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
        (f"And times {c}?", f"{a + b} times {c} is {(a + b) * c}."),
    ]


def words(rng: random.Random) -> list[tuple[str, str]]:
    word = rng.choice(WORDS)
    return [
        (f"Uppercase the word: {word}", word.upper()),
        ("Now reverse it.", word.upper()[::-1]),
    ]


def names(rng: random.Random) -> list[tuple[str, str]]:
    name = rng.choice(NAMES)
    return [
        (f"Hi! I am {name}.", f"Hello, {name}! How can I help?"),
        ("What is my name?", f"Your name is {name}."),
    ]


def colors(rng: random.Random) -> list[tuple[str, str]]:
    first, second = rng.sample(sorted(THINGS), 2)
    return [
        (f"What color is the {first}?", f"The {first} is {THINGS[first]}."),
        (f"And the {second}?", f"The {second} is {THINGS[second]}."),
        ("Thanks!", "You are welcome."),
    ]


def conversation(rng: random.Random) -> dict:
    turns = rng.choice([arithmetic, words, names, colors])(rng)
    system = rng.choice(SYSTEMS)
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def save_tokenizer(path: str) -> None:
    import tokenizers
    import transformers

    # GPT-2's printable stand-ins for the 256 bytes, so that id == byte value.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = (b for b in range(256) if b not in printable)
    stand_in = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    vocab = {stand_in[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    assert fast.encode("hi\n\xe9", add_special_tokens=False) == list("hi\n\xe9".encode())


def main() -> None:
    rng = random.Random(19)
    for split, count in (("train", 64), ("validation", 16)):
        with open(os.path.join(HERE, f"{split}.jsonl"), "w") as f:
            for _ in range(count):
                f.write(json.dumps(conversation(rng)) + "\n")
    save_tokenizer(os.path.join(HERE, "tokenizer"))


if __name__ == "__main__":
    main()

"""Writes train.jsonl (200 pairs) and validation.jsonl (32) beside this file: a synthetic
preference set for byte-level tiny models, `{"prompt", "chosen", "rejected"}` a line.

Each prompt is a short piece of news, good or bad by its verb ("Ann passed the exam." /
"Tom missed the race."); the preferred answer congratulates good news (" Bravo!") and
sympathises with bad news (" Oh no."), the rejected one does the opposite. The same answers
are chosen for one prompt and rejected for another, so the model must read the prompt, but
only one word of it. Prompts are at most 24 bytes, answers at most 8; the validation prompts
are not in the training set (their verbs are).

Measured with DPO (beta 0.1, adamw 3e-4, 16 pairs a step) on models/llama_tiny.gin from a
random init: reward accuracy about 0.5 at the start, 0.9 by step 20, 1.0 on the validation
pairs by step 30 and stable to step 100. At a constant 1e-3 it learns as fast but turns
unstable after about 70 steps (use warm-up and decay, or a lower rate).

Deterministic: `python data/preferences/make.py` rewrites the same files.
"""

from __future__ import annotations

import itertools
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SUBJECTS = ["I", "We", "Tom", "Ann", "Bob", "Eve"]
GOOD = ["won", "passed", "aced", "fixed"]
BAD = ["lost", "failed", "missed", "dropped"]
OBJECTS = ["the exam", "the race", "the game", "the test", "the quiz", "the match"]
CONGRATULATE = [" Great!", " Yay!", " Nice!", " Bravo!", " Cheers!"]
SYMPATHISE = [" Sorry.", " Oh no.", " Too bad", " Ouch."]


def main() -> None:
    rng = random.Random(19)
    news = [
        (f"{s} {v} {o}.", v in GOOD) for s, v, o in itertools.product(SUBJECTS, GOOD + BAD, OBJECTS)
    ]
    rng.shuffle(news)
    splits = {"validation": news[:32], "train": news[32:232]}
    assert len(splits["train"]) == 200
    for split, items in splits.items():
        with open(os.path.join(HERE, f"{split}.jsonl"), "w") as f:
            for prompt, good in items:
                chosen, rejected = rng.choice(CONGRATULATE), rng.choice(SYMPATHISE)
                if not good:
                    chosen, rejected = rejected, chosen
                assert len(prompt.encode()) <= 24
                assert all(len(a.encode()) <= 8 for a in (chosen, rejected))
                pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
                f.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
    main()

"""Writes train.jsonl (84) and validation.jsonl (16): every single-digit sum "a+b=" with its
answer, shuffled with seed 0. GRPO's example task (gin/grpo.gin)."""

import json
import os
import random

pairs = [(a, b) for a in range(10) for b in range(10)]
random.Random(0).shuffle(pairs)
here = os.path.dirname(os.path.abspath(__file__))
for name, rows in (("train", pairs[16:]), ("validation", pairs[:16])):
    with open(os.path.join(here, f"{name}.jsonl"), "w") as f:
        for a, b in rows:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")

"""How often greedy decoding gives a preference set's chosen or rejected answer, before and
after preference training (issue 19's "moves the policy's greedy output toward the chosen
answers").

    python benchmarks/preference_greedy.py --before /tmp/sft --after /tmp/dpo \
        [--pairs data/preferences/validation.jsonl]

`--before` / `--after`: flaxlm MODEL_DIRs (a LoRA run's adapters merged) or HF directories of
one byte-level model (the tiny gin models); prompts are read as training reads them (the
decoder's start token, then the prompt's bytes).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import numpy as np
import seqio

from flaxlm.checkpoints import run_dir
from flaxlm.inference import generation
from flaxlm.parallel.partitioning import Partitioner


def greedy_answers(checkpoint: str, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    partitioner = Partitioner(mesh_shape=(1, -1, 1))
    loaded = run_dir.load_model_and_params(checkpoint, partitioner)
    vocab = seqio.ByteVocabulary()
    ids = [vocab.encode(p) for p in prompts]
    inputs = np.zeros((len(ids), max(map(len, ids)) + 1), np.int32)
    for i, row in enumerate(ids):
        inputs[i, 1 : len(row) + 1] = row
    lengths = np.asarray([len(row) + 1 for row in ids])
    out = generation.generate(
        loaded.model,
        loaded.params,
        {"inputs": inputs, "inputs_lengths": lengths},
        max_new_tokens=max_new_tokens,
    )
    return [vocab.decode(generation.until_eos(row, loaded.model.eos_ids)) for row in out]


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--pairs", default="data/preferences/validation.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=10)
    args = p.parse_args(argv)
    with open(args.pairs) as f:
        pairs = [json.loads(line) for line in f]
    prompts = [pair["prompt"] for pair in pairs]
    result = {}
    for name in ("before", "after"):
        texts = greedy_answers(getattr(args, name), prompts, args.max_new_tokens)
        counts = {
            k: sum(t == pair[k] for t, pair in zip(texts, pairs)) for k in ("chosen", "rejected")
        }
        result[name] = counts
        print(
            f"{name}: greedy = chosen {counts['chosen']}, = rejected {counts['rejected']} of "
            f"{len(pairs)} (e.g. {texts[:3]})"
        )
    return result


if __name__ == "__main__":
    main()

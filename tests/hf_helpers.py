"""Shared by the HuggingFace family tests: tiny torch models saved to a temp dir, logits."""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_torch_model(torch_model, path) -> str:
    """Saves a torch HF model (safetensors) and returns the directory."""
    torch_model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def padded_batch(vocab_size: int, lengths=(12, 7, 12, 3), seed: int = 0):
    """Right-padded token ids [batch, max_len] (pad id 0) and the 0/1 attention mask."""
    rng = np.random.default_rng(seed)
    max_len = max(lengths)
    ids = np.zeros((len(lengths), max_len), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, vocab_size, n)
        mask[row, :n] = 1
    return ids, mask


def decoder_batch(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """seqio decoder-only features for the same tokens (padding as segment id 0)."""
    length = ids.shape[1]
    return {
        "decoder_input_tokens": ids.astype(np.int32),
        "decoder_target_tokens": ids.astype(np.int32),
        "decoder_segment_ids": mask.astype(np.int32),
        "decoder_positions": np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy(),
        "decoder_loss_weights": mask.astype(np.int32),
    }


def torch_logits(torch_model, **inputs) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = torch_model(**{k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()})
    return out.logits.float().numpy()


def max_abs_diff(ours, theirs, mask: np.ndarray) -> float:
    """Largest |difference| over real (mask == 1) positions and the real vocabulary."""
    ours = np.asarray(ours)[..., : theirs.shape[-1]]
    keep = mask.astype(bool)
    return float(np.max(np.abs(ours[keep] - theirs[keep])))


def train_on_batch(model, params, partitioner, batch, steps: int, learning_rate: float = 3e-3):
    """`steps` partitioned train steps from imported `params`, all on `batch`: the final
    state and each step's metrics (floats)."""
    from flaxlm import optimizers, trainer

    tx = optimizers.create_optimizer(learning_rate=learning_rate)
    setup = trainer.Setup(model, partitioner, tx, {k: v.shape[1] for k, v in batch.items()})
    step = setup.partition_train_step(trainer.make_train_step(model, partitioner, learning_rate))
    state, history = setup.state_from_params(params), []
    for _ in range(steps):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def bare_base_model_logits(torch_model, base_module, path, prefixes, ids, mask) -> float:
    """Saves the bare base model (hub GPT2Model / OPTModel files: tensor names without the
    `transformer.` / `model.` prefix), checks its names start with `prefixes`, loads it with
    flaxlm: the largest logit difference from the full torch model."""
    from safetensors import safe_open

    from flaxlm import hf

    bare = save_torch_model(base_module, path)
    with safe_open(os.path.join(bare, "model.safetensors"), "np") as f:
        assert all(name.startswith(prefixes) for name in f.keys())
    model, params = hf.from_pretrained(bare)
    ours = model.compute_logits(params, decoder_batch(ids, mask))
    return max_abs_diff(ours, torch_logits(torch_model, input_ids=ids, attention_mask=mask), mask)

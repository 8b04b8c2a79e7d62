"""Shared by the HuggingFace family tests: tiny torch models saved to a temp dir, logits."""

from __future__ import annotations

import contextlib
import json
import os

import jax
import numpy as np

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_torch_model(torch_model, path) -> str:
    """Saves a torch HF model (safetensors) and returns the directory."""
    torch_model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def random_hf_model(config_cls, model_cls, perturb=("norm.weight",), **kwargs):
    """A seeded random torch HF model (eager attention, eval mode) whose params ending in
    `perturb` get noise too (HF starts norms at 1 and biases at 0: make them count)."""
    import torch

    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(tuple(perturb)):
                p.add_(0.1 * torch.randn_like(p))
    return model


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


def gin_config(repo_dir, name: str, config_cls, bindings=()):
    """`config_cls()` as gin/models/<name>.gin binds it, with a user's `bindings` after (the
    gin config cleared after)."""
    import gin

    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings([f"{repo_dir}/gin/models/{name}.gin"], list(bindings))
        return config_cls()
    finally:
        gin.clear_config()


def train_on_batch(model, params, partitioner, batch, steps: int, learning_rate: float = 3e-3):
    """`steps` partitioned train steps from imported `params`, all on `batch`: the final
    state and each step's metrics (floats)."""
    from flaxlm.training import optimizers
    from flaxlm.training import steps as train_steps

    tx = optimizers.create_optimizer(learning_rate=learning_rate)
    setup = train_steps.Setup(model, partitioner, tx, {k: v.shape[1] for k, v in batch.items()})
    step = setup.partition_train_step(
        train_steps.make_train_step(model, partitioner, learning_rate)
    )
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

    from flaxlm.checkpoints import hf

    bare = save_torch_model(base_module, path)
    with safe_open(os.path.join(bare, "model.safetensors"), "np") as f:
        assert all(name.startswith(prefixes) for name in f.keys())
    model, params = hf.from_pretrained(bare)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    return max_abs_diff(ours, torch_logits(torch_model, input_ids=ids, attention_mask=mask), mask)


# ---------------------------------------------------------------- one family, every promise

MESHES = ((1, 4, 2), (2, 2, 2))
# `check_family` of a family's other configurations: the attention kernels and the first mesh
# are checked once, on its first; each configuration's own reading and math on every one.
LIGHT = {"implementations": (), "meshes": MESHES[-1:]}
GREEDY_TOKENS = 30
# A tiny dense decoder's HF config fields: a vocabulary of 120, 2 layers 32 wide, 4 query and
# 2 key/value heads, sharp enough attention that positions visibly matter, no special ids
# (HF's min_new_tokens would otherwise forbid an EOS).
TINY_DENSE = dict(
    vocab_size=120,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=96,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def hf_greedy_batch(torch_model, prompts, new_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    """HF `generate`'s greedy continuations of `prompts` (lists of ids), batched with left
    padding (pad id 0): the new tokens of each row."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.no_grad():
        out = torch_model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def flaxlm_greedy_batch(model, params, prompts, new_tokens: int = GREEDY_TOKENS, **kw):
    """flaxlm's greedy continuations of `prompts`, no EOS stop (as `hf_greedy_batch`)."""
    from flaxlm.inference import generation

    width = max(len(p) for p in prompts)
    inputs = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        inputs[row, : len(p)] = p
    batch = {"inputs": inputs, "inputs_lengths": np.array([len(p) for p in prompts])}
    out = generation.generate(model, params, batch, max_new_tokens=new_tokens, eos_id=None, **kw)
    return np.asarray(out).tolist()


@contextlib.contextmanager
def paged_engine(model, params, partitioner=None):
    """The serving engine, started, over a paged cache with small pages and several
    dispatches a prompt (4 rows, pages of 4 slots, prefill chunks of 8 tokens of 2 prompts,
    4 tokens a decode dispatch), on one device unless `partitioner`."""
    import jax

    from flaxlm.parallel.partitioning import Partitioner
    from flaxlm.runs.serve.engine import Engine

    partitioner = partitioner or Partitioner(mesh_shape=(1, 1, 1), devices=jax.devices()[:1])
    engine = Engine(
        model, params, partitioner, None, max_batch_size=4, page_size=4, num_pages=32,
        max_seq_len=48, decode_steps=4, prefill_chunk=8, prefill_rows=2,
    )  # fmt: skip
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def engine_tokens(engine, prompts, new_tokens: int) -> list[list[int]]:
    """`engine`'s greedy tokens for `prompts` (ids only: no vocabulary), `new_tokens` each
    (the tiny models have no EOS), all submitted at once."""
    from flaxlm.inference.sampling import Sampling
    from flaxlm.runs.serve.api import Completion

    jobs = [Completion(p, new_tokens, Sampling(), [], None, 0) for p in prompts]
    for job in jobs:
        engine.submit(job)
    out = []
    for job in jobs:
        tokens = []
        while (event := job.events.get(timeout=120))[0] == "token":
            tokens.append(event[1])
        assert event[:2] == ("done", "length"), event
        out.append(tokens)
    return out


def engine_generates_as_hf(model, params, torch_model, vocab_size: int) -> bool:
    """Whether the serving engine's greedy tokens (`engine_greedy`) for three prompts of
    mixed lengths are HF `generate`'s (`hf_greedy_batch`)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, vocab_size, n).tolist() for n in (11, 4, 17)]
    return engine_greedy(model, params, prompts) == hf_greedy_batch(torch_model, prompts)


def engine_greedy(
    model, params, prompts, new_tokens: int = GREEDY_TOKENS, partitioner=None
) -> list[list[int]]:
    """The serving engine's greedy tokens for `prompts` (`paged_engine`, `engine_tokens`)."""
    with paged_engine(model, params, partitioner) as engine:
        return engine_tokens(engine, prompts, new_tokens)


def check_scanned(torch_model, model, params, vocab_size: int, out, *, alone=False) -> None:
    """A model read from `torch_model`'s files with its layers scanned: HF's logits, its
    greedy tokens (decoding unstacks the stack; `alone`: HF's each prompt alone, where its
    left padding would enter a window) and files HF reloads (written to `out`)."""
    import jax
    import transformers

    from flaxlm.checkpoints import hf

    ids, mask = padded_batch(vocab_size, (24, 13, 24, 6))
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = jax.jit(model.compute_logits)(params, decoder_batch(ids, mask))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    prompts = [[5, 17, 3, 99, 42], [7, 8]]
    if alone:
        tokens = [hf_greedy_batch(torch_model, [p], 6)[0] for p in prompts]
    else:
        tokens = hf_greedy_batch(torch_model, prompts, 6)
    assert flaxlm_greedy_batch(model, params, prompts, 6) == tokens
    hf.save_pretrained(model, params, out)
    # Eager attention as `torch_model`'s (random_hf_model): the same weights, the same math.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), attn_implementation="eager"
    )
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) <= 1e-6 * max(1.0, np.abs(theirs).max())


def check_family(
    torch_model,
    path,
    vocab_size: int,
    *,
    lengths=(24, 13, 24, 6),
    prompt_lengths=(11, 4, 17),
    implementations=("jax", "chunked"),
    refused=(),
    tmp_path=None,
    scan=True,
    reload_cls=None,
    meshes=MESHES,
    **overrides,
) -> None:
    """Every promise a family makes against its HF PyTorch reference, saved at `path`:

    float32 logits within 1e-4 unsharded, with each attention implementation (those in
    `refused` must raise a ValueError naming the implementation) and on `MESHES` (the
    second with scanned layers, unless `scan` is False: layers that differ; a family's other
    configurations pass `implementations=()` and `meshes=MESHES[-1:]`: what differs between
    them is the config's reading and math, the kernels and the first mesh are the first's);
    greedy
    generation token-identical to HF `generate` for `GREEDY_TOKENS` tokens from prompts of
    mixed lengths; export -> transformers reload with
    no missing or unexpected keys, logits within 1e-5 relative, generation config kept.
    `overrides` go to `hf.from_pretrained` (config fields); `reload_cls` reloads the export
    (None: `AutoModelForCausalLM`; Mistral 4's class, which transformers' auto map lacks).
    """
    import dataclasses
    import json

    import pytest
    import transformers

    from flaxlm.checkpoints import hf
    from flaxlm.parallel.partitioning import Partitioner

    ids, mask = padded_batch(vocab_size, lengths)
    batch = decoder_batch(ids, mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    model, params = hf.from_pretrained(path, **overrides)
    ours = np.asarray(jax.jit(model.compute_logits)(params, batch))
    assert max_abs_diff(ours, theirs, mask) < 1e-4
    assert int(ours[..., :vocab_size].argmax(-1).max()) < vocab_size
    for implementation in (*implementations, *refused):
        config = dict(attention=implementation, attention_chunk_size=8)
        if implementation in refused:
            with pytest.raises(ValueError, match=implementation):
                dataclasses.replace(model.config, **config)
            continue
        other = type(model)(dataclasses.replace(model.config, **config))
        got = jax.jit(other.compute_logits)(params, batch)
        assert max_abs_diff(got, theirs, mask) < 1e-4, implementation

    for mesh in meshes:
        scanned = scan and mesh == MESHES[-1]
        sharded, sharded_params = hf.from_pretrained(
            path, Partitioner(mesh_shape=mesh), scan_layers=scanned, **overrides
        )
        got = jax.jit(sharded.compute_logits)(sharded_params, batch)
        assert max_abs_diff(got, theirs, mask) < 1e-4, mesh

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, vocab_size, n).tolist() for n in prompt_lengths]
    assert flaxlm_greedy_batch(model, params, prompts) == hf_greedy_batch(torch_model, prompts)

    if tmp_path is None:
        return
    out = tmp_path / "export"
    hf.save_pretrained(model, params, out)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # shareable
    reloaded, info = (reload_cls or transformers.AutoModelForCausalLM).from_pretrained(
        str(out), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded) is type(torch_model)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    assert max_abs_diff(ours, again, mask) <= 1e-5 * max(1.0, np.abs(again).max())
    source = os.path.join(str(path), "generation_config.json")
    if os.path.exists(source):
        with open(source) as a, open(out / "generation_config.json") as b:
            assert json.load(a) == json.load(b)


# ---------------------------------------------------------------- tokenizers as the hub ships them

QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_TEXT = [
    "def main():\n    return 0\n",
    "import os\nprint(os.getcwd())\n",
    "The quick brown fox jumps over the lazy dog. \u00e9t\u00e9 \u4e2d\u6587",
]


def save_gemma_style_tokenizer(path, vocab_size: int = 400) -> int:
    """A SentencePiece-style BPE in tokenizer.json as Gemma ships it (spaces as '▁', byte
    fallback to <0x..> tokens, <pad>=0 <eos>=1 <bos>=2 <unk>=3), trained here on a few
    lines, saved into `path`; returns its length."""
    import tokenizers
    import transformers
    from tokenizers import decoders, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials + byte_tokens, show_progress=False
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(path))
    return len(fast)


def save_byte_bpe_tokenizer(path, vocab_size: int = 320, style: str = "qwen") -> int:
    """A byte-level BPE tokenizer trained here on a few lines (no download), shaped like
    Qwen2.5's ('qwen': <|endoftext|> EOS, no BOS, ChatML template) or Llama 3's ('llama3':
    <|begin_of_text|> BOS, <|end_of_text|> EOS, <|eot_id|>), saved with `save_pretrained`
    into `path`; returns its length."""
    import tokenizers
    import transformers

    specials = {
        "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
    }[style]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tok.add_special_tokens(specials)
    if style == "qwen":
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=specials[0], pad_token=specials[0]
        )
        fast.chat_template = QWEN_CHAT_TEMPLATE
    else:
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]
        )
    fast.save_pretrained(str(path))
    return len(fast)


def save_with_mtp_layers(torch_model, path, out, depths: int):
    """A copy of the checkpoint saved at `path` with `depths` multi-token-prediction layers,
    written to `out` as the Hub's DeepSeek-V3 and GLM-4.5 files lay theirs out (decoder layers
    `num_hidden_layers + k`, the norm after each as `shared_head.norm`, and their copies of
    the embedding and head), from transformers' own `MtpModel` on a copy of `torch_model`
    (random weights, norms and correction biases perturbed as `random_hf_model` does);
    config.json's `num_nextn_predict_layers` says how many. Returns (main torch model,
    MtpModel)."""
    import copy

    import torch
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpModel

    main = copy.deepcopy(torch_model)
    torch.manual_seed(5)
    mtp_model = MtpModel(main, depths).eval()
    # Set here (MtpModel's own init leaves them empty in some states); the embedding and the
    # head are the main model's.
    randomise_params(mtp_model, 5, skip=("embed_tokens", "shared_head"))
    layers = main.config.num_hidden_layers
    tensors = {k: v.contiguous() for k, v in main.state_dict().items()}
    for name, tensor in mtp_model.state_dict().items():
        if name.startswith(("embed_tokens", "shared_head")):  # the main model's, tied
            continue
        _, k, rest = name.split(".", 2)
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        tensors[f"model.layers.{layers + int(k)}.{rest}"] = tensor.contiguous()
    for k in range(depths):  # the Hub's copies in each MTP layer, not read
        prefix = f"model.layers.{layers + k}"
        tensors[f"{prefix}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{prefix}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = depths
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return main, mtp_model


def hf_mtp_logits(main, mtp_model, ids, depths: int) -> list[np.ndarray]:
    """Each MTP depth's logits over a whole batch of unpadded rows, as transformers' MTP
    drafting computes them: depth k (from 0) reads the previous depth's (the trunk's final
    hidden states for the first) at positions 0.. and the tokens k + 1 places on, at their
    positions; `[rows, length - k - 1, vocab]`."""
    import torch

    length = ids.shape[1]
    with torch.no_grad():
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        out = []
        for k in range(depths):
            positions = torch.arange(k + 1, length)[None].expand(ids.shape[0], -1)
            hidden = mtp_model.forward_layer(
                k, hidden[:, : length - k - 1], positions, None, input_ids=ids[:, k + 1 :]
            )
            out.append(mtp_model._project_to_logits(hidden).float().numpy())
    return out


def randomise_params(module, seed: int, norm_center: float = 1.0, skip=()) -> None:
    """Seeded random values for `module`'s params but those whose names start with `skip`:
    norms `norm_center` + 0.2 x N(0, 1) (1 for x w norms, 0 for (1 + w) ones), the others
    0.1 x N(0, 1), and the routers' correction biases (buffers) 0.3 x N(0, 1)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.startswith(tuple(skip)):
                continue
            if name.endswith("norm.weight"):
                param.copy_(norm_center + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
        for name, buffer in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))


def mtp_depth_logits(model, params, ids: np.ndarray) -> list[np.ndarray]:
    """Each MTP depth's logits `[rows, length - k - 1, vocab]` (k from 0) of the flaxlm
    `model` on unpadded rows `ids`: its sown hidden states through its head."""
    import jax.numpy as jnp

    from flaxlm.models import mtp, routing

    def depths(params, ids):
        _, sown = model.module.apply(
            {"params": params}, ids, mutable=[mtp.MTP_COLLECTION, routing.ROUTER_COLLECTION]
        )
        hidden = sown[mtp.MTP_COLLECTION][mtp.HIDDEN]
        return [model.module.head_logits(params, h) for h in hidden]

    length = ids.shape[1]
    logits = jax.jit(depths)(params, jnp.asarray(ids))
    return [np.asarray(x)[:, : length - k - 1] for k, x in enumerate(logits)]


def check_mtp_loss(model, params, ids: np.ndarray, theirs: list[np.ndarray]) -> float:
    """`model`'s MTP loss on rows `ids[:, :-1]` -> `ids[:, 1:]` with `mtp_loss_weight` 0.3:
    its `mtp_loss_sum` is the depths' mean summed cross-entropy of `theirs` (the reference's
    logits of each depth k on `ids[:, :-1]`) on the tokens k + 2 places on, and the loss
    grows by 0.3 x that over the tokens. Returns that cross-entropy."""
    import dataclasses

    import jax.numpy as jnp
    import torch

    from flaxlm.models.base import DecoderOnlyModel

    batch = {
        "decoder_input_tokens": jnp.asarray(ids[:, :-1]),
        "decoder_target_tokens": jnp.asarray(ids[:, 1:]),
        "decoder_loss_weights": jnp.ones(ids[:, 1:].shape, jnp.float32),
    }
    ce = sum(
        torch.nn.functional.cross_entropy(
            torch.tensor(logits).flatten(0, 1), torch.tensor(ids[:, k + 2 :]).flatten(),
            reduction="sum",
        ).item()
        for k, logits in enumerate(theirs)
    ) / len(theirs)  # fmt: skip
    unweighted = DecoderOnlyModel(dataclasses.replace(model.config, mtp_loss_weight=0.0))
    plain, _ = jax.jit(unweighted.loss_fn)(params, batch, None)
    weighted = DecoderOnlyModel(dataclasses.replace(model.config, mtp_loss_weight=0.3))
    loss, sums = jax.jit(weighted.loss_fn)(params, batch, None)
    assert abs(float(sums["mtp_loss_sum"]) - ce) < 1e-4 * ce
    tokens = ids[:, 1:].size
    assert abs(float(loss) - float(plain) - 0.3 * ce / tokens) < 1e-4 * 0.3 * ce / tokens
    return ce

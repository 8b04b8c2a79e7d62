"""DeepSeek-V4 from and to HuggingFace: logits against transformers' `DeepseekV4ForCausalLM`
on two tiny random models, files in DeepSeek's spelling read, export reloaded by
transformers, decoding over the family's cache (the whole rows' logits at every step, HF's
greedy and beam-search tokens; the serving engine's chunk that continues rows' caches, read in
one pass as one token at a time), refusals by name (config.json keys, settings, the paged
engine), the gin files, and the multi-token-prediction layer (read from a release-spelled
file, against transformers' V4 modules composed as DeepSeek's reference `MTPBlock`; its loss
through the tiny gin file).

Two configs, built once each for the file: 'mixed' has each attention kind once (sliding,
compressed sparse with an indexer keeping 3 of up to 12 entries, heavily compressed), a
hash-routed then two top-k routed MoE layers, 2 hyper-connection streams and a tight
`swiglu_limit` (the clamps bite); 'other' has 3 streams, 5 Sinkhorn steps, other windows and
rates, sigmoid scores, a tied head and YaRN on the compress rotary. Params HF starts at
constants (norms, sinks, position biases, hyper-connection bases and scales; the routers'
correction biases and hash tables) are randomised. The indexers have 16 heads, so that no two
entries tie at the top-k boundary (all heads' ReLUs zero).
"""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from flaxlm.checkpoints import hf
from flaxlm.inference import generation
from flaxlm.models import (
    base,
    decoding,
    deepseek_v4,
    deepseek_v4_attention,
    deepseek_v4_cache,
    deepseek_v4_hf,
    hf_spec,
    stacks,
)
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.runs import infer
from flaxlm.training import steps
from tests.helpers import adamw
from tests.hf_helpers import (
    check_mtp_loss,
    check_scanned,
    decoder_batch,
    engine_tokens,
    flaxlm_greedy_batch,
    gin_config,
    hf_greedy_batch,
    max_abs_diff,
    mtp_depth_logits,
    padded_batch,
    paged_engine,
    random_hf_model,
    randomise_params,
    torch_logits,
)
from tests.linear_attention_helpers import packed_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 120
LENGTHS = (24, 13, 24, 6)
GREEDY_TOKENS = 8
S, C, H = deepseek_v4_attention.SLIDING, deepseek_v4_attention.CSA, deepseek_v4_attention.HCA
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    moe_intermediate_size=16,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=16,
    index_head_dim=8,
    index_topk=3,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    "mixed": dict(
        COMMON,
        num_hidden_layers=3,
        layer_types=[S, C, H],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={C: 2, H: 4},
        hc_mult=2,
        sliding_window=4,
        swiglu_limit=0.5,
    ),
    "other": dict(
        COMMON,
        num_hidden_layers=2,
        layer_types=[H, C],
        mlp_layer_types=["moe", "hash_moe"],
        compress_rates={C: 3, H: 8},
        hc_mult=3,
        hc_sinkhorn_iters=5,
        sliding_window=6,
        scoring_func="sigmoid",
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
}
# HF starts these at 1 or 0: made to count.
PERTURB = ("norm.weight", "sinks", "position_bias", ".base", ".scale", "hc_base", "hc_scale")
# float32 logits of 2-3 layers whose values are O(1): rounding in other summation orders is
# ~eps (1.2e-7) x sqrt(width) x depth ~ 1e-6 (1.3e-6 seen); 1e-4 leaves a margin (and is what
# every family meets).
LOGITS_TOL = 1e-4
ONE = Partitioner(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """`name -> (torch model, its save_pretrained directory, flaxlm model, params)`, each
    built once for the file (HF's save_pretrained writes DeepSeek's own names)."""
    built = {}

    def family(name):
        if name not in built:
            torch_model = random_hf_model(
                transformers.DeepseekV4Config,
                transformers.DeepseekV4ForCausalLM,
                PERTURB,
                **CONFIGS[name],
            )
            with torch.no_grad():
                for buffer_name, buffer in torch_model.named_buffers():
                    if buffer_name.endswith("e_score_correction_bias"):
                        buffer.copy_(0.3 * torch.randn_like(buffer))
                    if buffer_name.endswith("tid2eid"):
                        buffer.copy_(torch.randint(0, 8, buffer.shape))
            path = str(tmp_path_factory.mktemp(name))
            torch_model.save_pretrained(path)
            built[name] = (torch_model, path, *hf.from_pretrained(path, ONE))
        return built[name]

    return family


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_are_hf_logits_with_the_indexers_choice(families, name):
    torch_model, _, model, params = families(name)
    assert type(model) is deepseek_v4.DeepseekV4LM
    assert model.config.layer_types == tuple(CONFIGS[name]["layer_types"])
    ids, mask = padded_batch(VOCAB, LENGTHS)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    ours = whole_logits(model, params, ids, mask)
    assert max_abs_diff(ours, theirs, mask) < LOGITS_TOL
    # The indexer's choice matters: HF reading every compressed entry is far from both.
    indexers = [layer.self_attn.compressor.indexer for layer in csa_layers(torch_model)]
    for indexer in indexers:
        indexer.index_topk = 64
    try:
        every = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    finally:
        for indexer in indexers:
            indexer.index_topk = COMMON["index_topk"]
    assert max_abs_diff(ours, every, mask) > 1e-3


# Two hash-routed sliding layers, two cycles of (CSA, HCA) and a CSA layer: scanned, the first
# two and the last stay unrolled around the cycles (`stacks.layout_of`).
CYCLES = dict(layer_types=[S, S, C, H, C, H, C], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 5)


@pytest.mark.slow
def test_layers_scanned_in_cycles_on_an_fsdp_by_tensor_mesh_give_hf_logits_tokens_and_files(
    tmp_path,
):
    """Seven layers scanned as two cycles of (CSA, HCA) between unrolled ones, the params
    split over FSDP x tensor (heads, output groups, the experts' widths, the hash table's
    rows): HF's logits, its greedy tokens (decoding unstacks the cycles; HF's each prompt
    alone, as `test_greedy_over_the_cache_is_hf_generate`) and files HF reloads."""
    kwargs = dict(CONFIGS["mixed"], num_hidden_layers=7, **CYCLES)
    torch_model = random_hf_model(
        transformers.DeepseekV4Config, transformers.DeepseekV4ForCausalLM, PERTURB, **kwargs
    )
    torch_model.save_pretrained(tmp_path / "hf")
    mesh = Partitioner((1, 2, 2), devices=jax.devices()[:4])
    model, params = hf.from_pretrained(tmp_path / "hf", mesh, scan_layers=True)
    assert stacks.scan_layout(model.config) == (2, 2, 1)
    assert {"layers_0", "layers_1", "layers", "layers_6"} <= set(params)
    assert "indexer" in params["layers"]["block_0"]["self_attn"]["compressor"]
    assert params["layers"]["block_1"]["mlp"]["gate"]["kernel"].shape[0] == 2
    check_scanned(torch_model, model, params, VOCAB, tmp_path / "out", alone=True)


def csa_layers(torch_model):
    """The torch model's compressed-sparse-attention layers."""
    return [
        layer
        for layer, kind in zip(torch_model.model.layers, torch_model.config.layer_types)
        if kind == C
    ]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_is_what_transformers_reloads(families, name, tmp_path):
    torch_model, _, model, params = families(name)
    hf.save_pretrained(model, params, tmp_path, dtype="float32")
    hashed = CONFIGS[name]["mlp_layer_types"].index("hash_moe")
    indexed = CONFIGS[name]["layer_types"].index(C)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert f.get_tensor(f"model.layers.{hashed}.mlp.gate.tid2eid").dtype == np.int64
        assert f"model.layers.{indexed}.self_attn.compressor.indexer.q_b_proj.weight" in f.keys()
        assert ("lm_head.weight" in f.keys()) != CONFIGS[name].get("tie_word_embeddings", False)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    exported = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "hc_mult", "index_topk"):
        assert exported[key] == getattr(torch_model.config, key), key
    ids, mask = padded_batch(VOCAB, LENGTHS)
    again = torch_logits(reloaded.eval(), input_ids=ids, attention_mask=mask)
    theirs = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(again, theirs, mask) <= 1e-6 * max(1.0, np.abs(theirs).max())


@pytest.mark.slow
def test_multi_token_prediction_tensors_are_skipped(families, tmp_path):
    """The Hub's files carry `mtp.*` layers after the last; transformers skips them, and so
    does the import (the same params, no error)."""
    _, path, model, params = families("other")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["mtp.0.attn.wq_a.weight"] = np.zeros((24, 32), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    _, again = hf.from_pretrained(str(tmp_path), ONE)
    assert jax.tree.all(jax.tree.map(np.array_equal, again, params))


# ------------------------------------------------------------ multi-token prediction


def release_spelling(name: str) -> str:
    """A tensor name as transformers' save_pretrained writes it -> as DeepSeek's release
    files spell it (no `model.` prefix, `embed`, `hc_head_fn`, the attention's `kv_norm`)."""
    name = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(
        name, name
    )
    name = re.sub(r"^model\.hc_head\.hc_", "hc_head_", name)
    name = re.sub(r"^model\.layers\.", "layers.", name)
    return name.replace(".attn.norm.weight", ".attn.kv_norm.weight")


@pytest.fixture(scope="module")
def with_mtp(families, tmp_path_factory):
    """The 'mixed' checkpoint in the release's spelling with one MTP layer (`mtp.0.*`, as
    DeepSeek's files hold it: a sliding-window, top-k routed block, enorm / hnorm, e_proj /
    h_proj, its own hyper-head and norm; config.json's `compress_ratios` ending in 0 for it).
    The layer's modules are transformers' own (a one-layer `DeepseekV4ForCausalLM`'s layer,
    hyper-head and norm; `DeepseekV4RMSNorm`s and linears), randomised: (main torch model,
    MTP modules, directory)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    torch_model, path, _, _ = families("mixed")
    one = dict(CONFIGS["mixed"], num_hidden_layers=1, layer_types=[S], mlp_layer_types=["moe"])
    block = random_hf_model(
        transformers.DeepseekV4Config, transformers.DeepseekV4ForCausalLM, **one
    )
    width, eps = COMMON["hidden_size"], torch_model.config.rms_norm_eps
    parts = torch.nn.ModuleDict(
        {
            "block": block,
            "enorm": v4.DeepseekV4RMSNorm(width, eps=eps),
            "hnorm": v4.DeepseekV4RMSNorm(width, eps=eps),
            "e_proj": torch.nn.Linear(width, width, bias=False),
            "h_proj": torch.nn.Linear(width, width, bias=False),
        }
    ).eval()
    randomise_params(parts, 7)  # other values than the trunk's (the same seed made both)
    out = tmp_path_factory.mktemp("v4_mtp")
    tensors = {
        release_spelling(k): v
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
    }
    block.save_pretrained(str(out / "block"))
    for name, tensor in load_file(str(out / "block" / "model.safetensors")).items():
        if name in ("model.embed_tokens.weight", "head.weight"):  # the trunk's are read
            continue
        name = release_spelling(name)  # the one layer's, its hyper-head's and norm's
        mtp_name = "mtp.0." + name if not name.startswith("layers.0.") else name
        tensors[mtp_name.replace("layers.0.", "mtp.0.", 1)] = tensor
    for name in ("enorm", "hnorm", "e_proj", "h_proj"):
        tensors[f"mtp.0.{name}.weight"] = parts[name].weight.detach().numpy()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config.update(num_nextn_predict_layers=1, compress_ratios=[0, 4, 128, 0])
    (out / "config.json").write_text(json.dumps(config))
    return torch_model, parts, str(out)


def hf_mtp_logits(main, parts, ids: np.ndarray) -> np.ndarray:
    """The MTP layer's logits `[rows, length - 1, vocab]` from transformers' modules composed
    as DeepSeek's reference `MTPBlock` runs them: the trunk's streams before its hyper-head,
    the next tokens' embeddings, the block at those tokens' positions under the trunk's
    sliding-window mask, the layer's hyper-head and norm, the model's head."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    ids = torch.tensor(ids)
    seen = {}
    hook = main.model.hc_head.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    with torch.no_grad():
        try:
            main(ids)
        finally:
            hook.remove()
        length = ids.shape[1]
        following = ids[:, 1:]
        e = main.model.embed_tokens(following)
        x = parts["e_proj"](parts["enorm"](e)).unsqueeze(2)
        x = x + parts["h_proj"](parts["hnorm"](seen["x"][:, : length - 1]))
        positions = torch.arange(1, length)[None].expand(ids.shape[0], -1)
        inner = parts["block"].model
        mask = create_sliding_window_causal_mask(
            config=inner.config, inputs_embeds=e, attention_mask=None, past_key_values=None,
            position_ids=positions,
        )  # fmt: skip
        rotary = {
            kind: main.model.rotary_emb(e, position_ids=positions, layer_type=kind)
            for kind in ("main", "compress")
        }
        x = inner.layers[0](
            x, position_embeddings=rotary, position_ids=positions, attention_mask=mask,
            input_ids=following, past_key_values=None,
        )  # fmt: skip
        return main.lm_head(inner.norm(inner.hc_head(x))).float().numpy()


@pytest.mark.slow
def test_mtp_layer_loads_predicts_trains_and_exports(with_mtp, tmp_path):
    """A release-spelled file's MTP layer read (`num_mtp_layers=1`; its kind from
    `compress_ratios`' last entry): its logits are the reference composition of transformers'
    modules; the loss adds `mtp_loss_weight` x its cross-entropy on the tokens two on; plain
    logits are the main model's; the export writes `mtp.0.*` back in the release's spelling,
    which reads again to the same params."""
    main, parts, path = with_mtp
    model, params = hf.from_pretrained(path, ONE, num_mtp_layers=1)
    assert model.config.mtp_layer_types == (S,) and sorted(params["mtp_0"]) == [
        "block", "e_proj", "enorm", "h_proj", "hc_head", "hnorm", "norm"
    ]  # fmt: skip
    plain = dataclasses.replace(model.config, num_mtp_layers=0, mtp_layer_types=None)
    extra = [
        t for n, t in parts.state_dict().items() if "embed_tokens" not in n and "lm_head" not in n
    ]
    assert model.config.num_params() - plain.num_params() == sum(t.numel() for t in extra)
    ids = np.random.default_rng(4).integers(1, VOCAB, (2, 17))
    want = hf_mtp_logits(main, parts, ids)
    (got,) = mtp_depth_logits(model, params, ids)
    assert np.abs(got[..., :VOCAB] - want).max() < LOGITS_TOL
    logits = jax.jit(model.compute_logits)(params, decoder_batch(ids, np.ones_like(ids)))
    trunk = torch_logits(main, input_ids=ids)
    assert max_abs_diff(logits, trunk, np.ones_like(ids)) < LOGITS_TOL
    assert np.abs(want - trunk[:, 1:]).max() > 100 * LOGITS_TOL  # another prediction

    check_mtp_loss(model, params, ids, [hf_mtp_logits(main, parts, ids[:, :-1])])

    hf.save_pretrained(model, params, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 1 and exported["mtp_layer_types"] == [S]
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "np") as f:
        written = {k for k in f.keys() if k.startswith("mtp.")}
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    assert written == {k for k in on_disk if k.startswith("mtp.")}
    again, again_params = hf.from_pretrained(tmp_path / "export", ONE, num_mtp_layers=1)
    assert jax.tree.all(jax.tree.map(np.array_equal, again_params, params))


# Prompts of 1 to 17 tokens in one batch, and what follows them: every row crosses the
# compressors' windows (rates 2 and 4, 3 and 8) and its sliding window (4, 6) while decoding.
PROMPT_LENGTHS = (11, 5, 17, 1)
STEPS = 9


def prompts_of(lengths=PROMPT_LENGTHS, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


# The tests read a family's whole rows (right-padded: `LENGTHS`, prompts and the tokens fed
# after them, a chunk's rows) as one shape, 4 rows of 26 positions (the longest: a 17-token
# prompt and 9 tokens fed): one compiled program a config, not one a test.
WHOLE = (4, max(PROMPT_LENGTHS) + STEPS)
_WHOLE_READS = {}


def whole_logits(model, params, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`model.compute_logits` of right-padded rows `ids` (0/1 `mask`) read within `WHOLE`:
    the rows and positions added are padding (segment 0) after every real token and in
    rows of their own, which causal rows never read; cut back to `ids`' shape."""
    rows, length = ids.shape
    padded_ids, padded_mask = np.zeros(WHOLE, np.int64), np.zeros(WHOLE, np.int64)
    padded_ids[:rows, :length], padded_mask[:rows, :length] = ids, mask
    read = _WHOLE_READS.setdefault(model, jax.jit(model.compute_logits))
    logits = read(params, decoder_batch(padded_ids, padded_mask))
    return np.asarray(logits)[:rows, :length]


def cached_logits(model, params, prompts, fed):
    """float32 `[rows, 1 + steps, vocab]`: the logits after each prompt (right-padded, read
    whole into the cache), then after each token of `fed` int32 `[rows, steps]` decoded one
    a step over the cache."""
    inputs = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for row, p in enumerate(prompts):
        inputs[row, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    config = decoding.DecodingConfig(max_new_tokens=fed.shape[1])

    @jax.jit
    def run(params, inputs, lengths, fed):
        params = model.decoding_params(params)
        first, state = model.prefill(params, inputs, lengths, config)

        def step(state, xs):
            t, token = xs
            logits, state = model.decode_step(params, token, t, state, config)
            return state, logits

        steps = jnp.arange(fed.shape[1], dtype=jnp.int32)
        _, logits = jax.lax.scan(step, state, (steps, fed.T))
        return jnp.concatenate([first[:, None], logits.transpose(1, 0, 2)], axis=1)

    return np.asarray(run(params, inputs, lengths, fed))


def assert_cached_logits_are_whole_rows(model, params, prompts, layers):
    """The cached logits after each prompt and each of `STEPS` random tokens fed are the
    logits of the whole rows (prompt and tokens) read at once."""
    fed = np.random.default_rng(4).integers(1, VOCAB, (len(prompts), STEPS)).astype(np.int32)
    ours = cached_logits(model, params, prompts, fed)
    rows = [p + f.tolist() for p, f in zip(prompts, fed, strict=True)]
    ids, mask = padded_batch(VOCAB, [len(r) for r in rows])
    for row, r in enumerate(rows):
        ids[row, : len(r)] = r
    whole = whole_logits(model, params, ids, mask)
    theirs = np.stack([whole[row, len(p) - 1 : len(p) + STEPS] for row, p in enumerate(prompts)])
    ours, theirs = ours[..., :VOCAB], theirs[..., :VOCAB]  # not the ids padded on
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=cached_tolerance(layers, theirs))


def cached_tolerance(layers: int, theirs: np.ndarray) -> float:
    """The same float32 products summed in other orders (keys in a ring, entries pooled one
    window at a time): a few eps x sqrt(width) per layer, at the scale of `theirs`."""
    tol = 8 * np.finfo(np.float32).eps * np.sqrt(COMMON["hidden_size"])
    return tol * layers * max(1.0, float(np.abs(theirs).max()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decoding_logits_are_the_whole_rows_logits_at_each_step(families, name):
    """Prefill then one token a step over the cache (the sliding window's ring, the
    compressors' open windows and entries, the indexer's keys) gives, at every step, the
    logits of reading each row whole: rows of 1 to 17 tokens in one batch, the windows
    closing during the steps at each row's own positions."""
    _, _, model, params = families(name)
    layers = CONFIGS[name]["num_hidden_layers"]
    assert_cached_logits_are_whole_rows(model, params, prompts_of(), layers)


def test_prompts_of_one_token_decode_from_an_empty_cache(families):
    """A batch of 1-token prompts: the prefill is a step over the empty cache it makes."""
    _, _, model, params = families("mixed")
    layers = CONFIGS["mixed"]["num_hidden_layers"]
    assert_cached_logits_are_whole_rows(model, params, prompts_of((1, 1), seed=7), layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_over_the_cache_is_hf_generate(families, name):
    """HF's greedy tokens (its cached compressors, each prompt alone: HF's left padding
    would enter its windows) from flaxlm's `generate` over the cache, prompts of 1 to 17
    tokens in one batch and 9 new ones crossing the compressors' windows."""
    torch_model, _, model, params = families(name)
    prompts = prompts_of()
    tokens = flaxlm_greedy_batch(model, params, prompts, STEPS)
    assert tokens == [hf_greedy_batch(torch_model, [p], STEPS)[0] for p in prompts]
    # Sampling reads the same cache: its most likely token alone is the greedy one.
    sampled = flaxlm_greedy_batch(model, params, prompts, STEPS, temperature=0.7, top_k=1)
    assert sampled == tokens


@pytest.mark.slow
def test_greedy_over_the_cache_on_an_fsdp_by_tensor_mesh_is_hf_generate(families):
    """The cache's rows split over the batch axes, the params over FSDP x tensor."""
    torch_model, path, _, _ = families("mixed")
    partitioner = Partitioner((1, 2, 2), devices=jax.devices()[:4])
    model, params = hf.from_pretrained(path, partitioner)
    prompts = prompts_of()
    tokens = flaxlm_greedy_batch(model, params, prompts, STEPS, partitioner=partitioner)
    assert tokens == [hf_greedy_batch(torch_model, [p], STEPS)[0] for p in prompts]


@pytest.mark.slow
def test_beam_search_over_the_cache_is_hf_beam_search(families):
    """`decoding.gather_rows` reorders every cache leaf's rows (the rings, the open
    windows, the entries): HF's beam search (3 beams, each prompt alone) on 'mixed'."""
    torch_model, _, model, params = families("mixed")
    prompts = prompts_of((11, 5, 1), seed=5)
    ours = flaxlm_greedy_batch(model, params, prompts, STEPS, num_beams=3)
    for row, p in enumerate(prompts):
        with torch.no_grad():
            theirs = torch_model.generate(
                torch.tensor([p]), attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                do_sample=False, num_beams=3, max_new_tokens=STEPS, min_new_tokens=STEPS,
                pad_token_id=0, early_stopping=False, length_penalty=1.0,
            )  # fmt: skip
        assert ours[row] == theirs[0, len(p) :].tolist(), row


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_serving_engine_decodes_as_hf_generate_and_resumes_cached_prefixes(families, name):
    """The serving engine (`paged_engine`: 4 rows, prompts read in chunks of 8 across the
    compressors' windows, each in one pass over the rows' caches, 4 tokens a decode dispatch),
    every layer's cache in state slots: HF's greedy tokens. A prompt that shares 12 tokens
    (3 pages) with an earlier one resumes from the prefix cache's state snapshot after the
    first 8 and still gets HF's tokens."""
    torch_model, _, model, params = families(name)
    prompts = prompts_of()
    shared = prompts[2][:12] + [7, 9, 11]
    with paged_engine(model, params) as engine:
        first = engine_tokens(engine, prompts, STEPS)
        cached = engine.scheduler.cached_tokens
        again = engine_tokens(engine, [shared], STEPS)
        # (a snapshot where a prefill chunk ends on a page: after 8 of the 12)
        assert engine.scheduler.cached_tokens - cached == 8
    want = [hf_greedy_batch(torch_model, [p], STEPS)[0] for p in (*prompts, shared)]
    assert [*first, *again] == want


# A chunk of the serving engine that continues each row's cache, 11 tokens (past both
# sliding windows, 4 and 6, across every compression window, rates 2 and 4, 3 and 8): rows
# resuming at 5 (inside windows) and at 12 (on their edges; 4 tokens, then padding), a fresh
# row at 0 (its state slot holding another sequence), a row of padding only.
CHUNK = 11
RESUMED = ((5, 9), (12, 4), (0, 11), (-1, 0))  # (first position, real tokens); -1: padding
HELD = (5, 12, 6, 7)  # the positions each row's state slot holds before the chunk


def engine_read(model):
    """The engine's read (`paged_logits`), jitted: `(params, cache, tokens, slots)` ->
    (each row's logits after its last real token, the cache), row b in state slot b + 1."""

    @jax.jit
    def read(params, cache, tokens, slots):
        rows = tokens.shape[0]
        last = jnp.maximum((slots >= 0).sum(1) - 1, 0)
        states = jnp.arange(1, rows + 1, dtype=jnp.int32)
        table = jnp.zeros((rows, 1), jnp.int32)
        params = model.decoding_params(params)
        return model.paged_logits(params, cache, tokens, slots, table, last, state_slots=states)

    return read


def one_at_a_time(read, params, cache, tokens, slots):
    """`tokens` int32 `[rows, length]` at `slots` fed one a dispatch: each row's logits after
    its last real token (zeros where none) and the cache after them all."""
    logits = None
    for i in range(tokens.shape[1]):
        out, cache = read(params, cache, tokens[:, i : i + 1], slots[:, i : i + 1])
        logits = np.zeros_like(out) if logits is None else logits
        logits[slots[:, i] >= 0] = np.asarray(out)[slots[:, i] >= 0]
    return logits, cache


def held(config, cache, last):
    """`cache`'s leaves with what no later read sees zeroed (ring slots of no position yet,
    the entries of windows not yet whole), each state slot's last position `last` int32."""

    def keep(path, leaf):
        names = [key.key for key in path]
        kind = config.layer_types[int(names[0].split("_")[1])]
        if names[-1] == "entries":
            ratio = config.csa_compress_rate if kind == C else config.hca_compress_rate
            seen = np.arange(leaf.shape[2])[None] < ((last + 1) // ratio)[:, None]
        else:
            seen = np.asarray(deepseek_v4_cache.ring_positions(last, leaf.shape[2])) >= 0
        return np.where(seen[:, None, :, None], np.asarray(leaf), 0)

    return jax.tree_util.tree_map_with_path(keep, cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_chunk_that_continues_the_cache_reads_as_its_tokens_one_at_a_time(families, name):
    """The serving engine's read of a chunk over rows' caches in one pass (`paged_logits`,
    no loop over the chunk's tokens), rows at different positions (`RESUMED`): each row's
    logits are those of feeding the chunk one token a dispatch and of reading its whole
    sequence at once, the cache is theirs where a later read looks, and the row of padding
    leaves its state slot as it was."""
    _, _, model, params = families(name)
    config, layers = model.config, CONFIGS[name]["num_hidden_layers"]
    rng = np.random.default_rng(6)
    sequences = [rng.integers(1, VOCAB, n + 11).tolist() for n in HELD]
    read = engine_read(model)
    before = np.full((4, max(HELD)), -1, np.int32)
    for row, n in enumerate(HELD):
        before[row, :n] = np.arange(n)
    prefixes = np.array([s[: max(HELD)] for s in sequences], np.int32)
    prefixes[2] = rng.integers(1, VOCAB, max(HELD))  # another sequence than the chunk's
    # The empty cache on the params' device mesh, as the reads return it (one program).
    empty = jax.device_put(model.paged_cache(12, 4, 4, 48), ONE.replicated())
    _, cache = one_at_a_time(read, params, empty, prefixes, before)
    tokens = np.zeros((4, CHUNK), np.int32)
    slots = np.full((4, CHUNK), -1, np.int32)
    for row, (start, n) in enumerate(RESUMED):
        tokens[row, :n] = sequences[row][start : start + n]
        slots[row, :n] = start + np.arange(n)
    # No loop over the chunk's tokens (the hyper-connections' Sinkhorn steps are a scan).
    scans = set(
        re.findall(r"\blength=(\d+)", str(jax.make_jaxpr(read)(params, cache, tokens, slots)))
    )
    assert str(config.hc_sinkhorn_iters - 1) in scans and str(CHUNK) not in scans
    ours, ours_cache = read(params, cache, tokens, slots)
    theirs, theirs_cache = one_at_a_time(read, params, cache, tokens, slots)
    ours, theirs = np.asarray(ours)[:3, :VOCAB], theirs[:3, :VOCAB]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=cached_tolerance(layers, theirs))
    ends = [start + n for start, n in RESUMED[:3]]
    ids, mask = padded_batch(VOCAB, ends)
    for row, end in enumerate(ends):
        ids[row, :end] = sequences[row][:end]
    whole = whole_logits(model, params, ids, mask)
    whole = np.stack([whole[row, end - 1, :VOCAB] for row, end in enumerate(ends)])
    np.testing.assert_allclose(ours, whole, rtol=0, atol=cached_tolerance(layers, whole))
    last = np.array([-1, *(e - 1 for e in ends), HELD[3] - 1])  # each state slot's
    kept = (jax.tree.leaves(held(config, c, last)) for c in (ours_cache, theirs_cache))
    for a, b in zip(*kept, strict=True):
        np.testing.assert_allclose(a[1:4], b[1:4], rtol=0, atol=cached_tolerance(layers, b))
    for a, b in zip(jax.tree.leaves(ours_cache), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(a[4], b[4])  # the padding row's state slot


def test_a_left_padded_or_paged_kv_cache_is_refused_naming_the_model_that_decodes(families):
    """The other families' caches (left-padded rows; keys and values in pages) are refused
    for a DecoderOnlyModel of DeepSeek-V4, naming DeepseekV4LM, whose own caches decode."""
    _, _, model, params = families("mixed")
    assert model.paged_refusal() is None
    plain = base.DecoderOnlyModel(model.config)
    ids, _ = padded_batch(VOCAB, (5, 3))
    with pytest.raises(ValueError, match="generate with deepseek_v4.DeepseekV4LM"):
        generation.generate(plain, params, {"inputs": ids}, max_new_tokens=2)
    assert "DeepseekV4LM" in plain.paged_refusal()
    settings = generation.GenerationSettings(max_new_tokens=2)
    with pytest.raises(ValueError, match="DeepseekV4LM"):
        infer.choose_engine("paged", plain, settings, [5, 3])
    assert infer.choose_engine("paged", model, settings, [5, 3]) == "paged"


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(n_shared_experts=2), "n_shared_experts"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(layer_types=[S, "full_attention", H]), "layer_types"),
        (dict(mlp_layer_types=["moe"]), "mlp_layer_types"),
        (dict(rope_parameters={"main": {"rope_type": "yarn", "factor": 2.0}, "compress": {}}),
         "main"),
    ],
    ids=str,
)  # fmt: skip
def test_config_json_flaxlm_cannot_read_is_refused_naming_the_key(change, key):
    config = {**transformers.DeepseekV4Config(**CONFIGS["mixed"]).to_dict(), **change}
    with pytest.raises(ValueError, match=key):
        deepseek_v4_hf.config_from_hf(config)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(correction_bias_update_rate=1e-3), "correction_bias_update_rate"),
        (dict(moe_impl="capacity"), "moe_impl"),
        (dict(n_group=2, topk_group=1), "n_group"),
        (dict(o_groups=3), "o_groups"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(attention="chunked"), "attention"),
        (dict(dropout_rate=0.1), "dropout_rate"),
    ],
    ids=str,
)
def test_settings_that_cannot_be_are_errors_naming_them(kwargs, field):
    fields = dict(num_layers=3, layer_types=(S, C, H), num_experts=8, num_experts_per_tok=2)
    fields.update(head_dim=16, num_heads=4, qk_rope_head_dim=8, index_head_dim=8)
    with pytest.raises(ValueError, match=field):
        deepseek_v4.DeepseekV4Config(**{**fields, **kwargs})


def test_config_json_round_trips_through_transformers():
    """config_to_hf's dict loads in transformers as the same model, and reads back to the
    same config (YaRN on the compress rotary, hash layers, the legacy-free keys)."""
    config = deepseek_v4_hf.config_from_hf(
        transformers.DeepseekV4Config(**CONFIGS["other"]).to_dict()
    )
    out = deepseek_v4_hf.config_to_hf(config)
    theirs = transformers.DeepseekV4Config(**out)
    assert theirs.rope_parameters["compress"]["rope_type"] == "yarn"
    assert deepseek_v4_hf.config_from_hf(theirs.to_dict()) == config


@pytest.mark.parametrize(
    "kinds, layout",
    [
        (dict(layer_types=(C, C), mlp_layer_types=("moe", "moe")), (0, 1, 0)),
        (CYCLES, (2, 2, 1)),
    ],
    ids=["alike", "cycles"],
)
def test_scanned_layers_have_every_param_in_the_hf_table(kinds, layout):
    """Layers of one kind (every one CSA and top-k routed) scan as one block; `CYCLES` as
    two unrolled, cycles of two blocks and one unrolled: the HF table covers every param
    (one record a tensor for each block's layers)."""
    config = deepseek_v4.DeepseekV4Config(
        num_layers=len(kinds["layer_types"]), num_heads=4, head_dim=16, q_lora_rank=24,
        qk_rope_head_dim=8, index_head_dim=8, num_experts=8, num_experts_per_tok=2,
        hidden_size=32, vocab_size=128, scan_layers=True, **kinds,
    )  # fmt: skip
    assert stacks.scan_layout(config) == layout
    model = deepseek_v4.DeepseekV4LM(config)
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    paths = {
        "/".join(str(k.key) for k in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(shapes)
    }
    table = hf_spec.expand(deepseek_v4_hf.hf_tensors(config), stacks.scan_layout(config))
    assert paths == set(table)
    assert sum(x.size for x in jax.tree.leaves(shapes)) == config.num_params()


def test_gin_sizes_match_the_model_card():
    """DeepSeek-V4-Flash: 284B params, 13B active (outside the embedding and the head),
    scanned as its three hash-routed layers unrolled and 20 cycles of two."""
    cfg = gin_config(REPO, "deepseek_v4_flash", deepseek_v4.DeepseekV4Config)
    assert stacks.scan_layout(cfg) == (3, 2, 0)  # hash-routed 3 unrolled, 20 cycles of 2
    assert abs(cfg.num_params() / 1e9 - 284.0) / 284.0 < 0.01, cfg.num_params()
    active = cfg.active_params() - 2 * cfg.vocab_size * cfg.hidden_size
    assert abs(active / 1e9 - 13.0) / 13.0 < 0.035, active


def test_tiny_gin_model_counts_its_params():
    config = gin_config(REPO, "deepseek_v4_tiny", deepseek_v4.DeepseekV4Config)
    assert set(config.layer_types) == {S, C, H} and "hash_moe" in config.mlp_layer_types
    model = deepseek_v4.DeepseekV4LM(config)
    shapes = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
    )
    assert sum(x.size for x in jax.tree.leaves(shapes)) == config.num_params()


@pytest.mark.slow
def test_tiny_gin_trains_on_packed_rows_with_its_hash_tables_fixed_and_an_mtp_loss():
    """gin/models/deepseek_v4_tiny.gin's model with `num_mtp_layers` and `mtp_loss_weight`
    bound as a user binds them, on packed rows and an FSDP x tensor mesh: the loss and the
    reported `mtp_loss` fall, every param stays finite, and the hash-routing tables
    (`tid2eid`, ids held as float32 params) do not move."""
    mtp = ("num_mtp_layers = 1", "mtp_loss_weight = 0.3")
    bindings = [f"deepseek_v4.DeepseekV4Config.{b}" for b in mtp]
    config = gin_config(REPO, "deepseek_v4_tiny", deepseek_v4.DeepseekV4Config, bindings)
    assert config.num_mtp_layers == 1
    model = base.DecoderOnlyModel(config)
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    batch = packed_batch()
    setup = steps.Setup(model, partitioner, adamw(1e-2), {k: v.shape[1] for k, v in batch.items()})
    state = setup.init_state()

    def tables(state):
        flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
        return {jax.tree_util.keystr(p): v for p, v in flat if "tid2eid" in jax.tree_util.keystr(p)}

    before = tables(state)
    assert before  # the tiny file has hash-routed layers
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 1e-2))
    losses, mtp_losses = [], []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        mtp_losses.append(float(metrics["mtp_loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert mtp_losses[-1] < mtp_losses[0], mtp_losses
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))
    after = tables(state)
    assert after.keys() == before.keys()
    for name, table in before.items():
        np.testing.assert_array_equal(after[name], table, err_msg=name)

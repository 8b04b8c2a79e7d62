"""LoRA: only adapters train, the base stays bit-identical, merge and HF export reproduce the
adapted model."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from flaxlm.checkpoints import checkpointer, hf, run_dir
from flaxlm.data.config import DatasetConfig
from flaxlm.models import gemma, layers, llama, phi3
from flaxlm.models.base import DecoderOnlyModel
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.parallel.pytrees import path_name
from flaxlm.runs import convert, train
from flaxlm.training import lora, steps
from tests.helpers import adamw, feature_lengths, random_batch, tiny_gptj
from tests.hf_helpers import decoder_batch, max_abs_diff, padded_batch, torch_logits
from tests.test_hf_llama import tiny_hf_llama

RULES = ((r"(q|v)_proj/kernel$", 4), (r"o_proj/kernel$", 2), (r"down_proj/kernel$", 4))


def tiny_llama(scan_layers: bool = False) -> DecoderOnlyModel:
    config = llama.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        scan_layers=scan_layers,
    )
    return DecoderOnlyModel(config)


def randomize_b(adapters, seed=1):
    """Nonzero B everywhere, so the adapters change the model."""
    flat = traverse_util.flatten_dict(adapters)
    key = jax.random.PRNGKey(seed)
    for i, (path, x) in enumerate(sorted(flat.items())):
        if path[-1] == "lora_b":
            flat[path] = 0.1 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
    return traverse_util.unflatten_dict(flat)


def reference_logits(model, base, adapters, alpha, batch):
    """The adapted model computed the textbook way, `x W + (alpha/r) (x A) B` at each adapted
    dense layer (base params unmerged), by intercepting the layers' output hook."""
    flat = traverse_util.flatten_dict(adapters)

    def add_lora(next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        module = context.module
        key = tuple(module.path) + ("lora_a",)
        if isinstance(module, layers.DenseGeneral) and context.method_name == "adapt":
            if key not in flat:
                return y
            a, b = flat[key], flat[tuple(module.path) + ("lora_b",)]
            x, n_in = args[0], a.ndim - 1
            xa = jnp.tensordot(x, a, axes=(list(range(x.ndim - n_in, x.ndim)), list(range(n_in))))
            y = y + (alpha / a.shape[-1]) * jnp.tensordot(xa, b, axes=1)
        return y

    def forward(base, batch):
        with nn.intercept_methods(add_lora):
            return model.compute_logits(base, batch)

    return np.asarray(jax.jit(forward)(base, batch))


def leaf_names(tree):
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize(
    "mesh_shape, scan_layers",
    [
        pytest.param((1, 8, 1), False, id="fsdp"),
        pytest.param((2, 2, 2), True, id="2x2x2_scan", marks=pytest.mark.slow),
    ],
)
def test_only_adapters_train_and_base_stays_bit_identical(mesh_shape, scan_layers):
    model = tiny_llama(scan_layers)
    partitioner = Partitioner(mesh_shape=mesh_shape)
    cfg = lora.LoraConfig(rules=RULES, alpha=8.0)
    setup = steps.Setup(model, partitioner, adamw(3e-2), feature_lengths(), lora=cfg)
    base = setup.init_base()
    before = jax.device_get(base)
    state = setup.init_state()

    # The state holds adapters only, and the optimizer has moments for them alone.
    names = leaf_names(state.params)
    assert names and all(n.endswith(("/lora_a", "/lora_b")) for n in names)
    adapter_size = sum(x.size for x in jax.tree.leaves(state.params))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * adapter_size  # AdamW's mu and nu
    base_size = sum(x.size for x in jax.tree.leaves(base))
    assert adapter_size < base_size / 10
    # Adapters are sharded like their kernels (heads over `tensor`, embed over `fsdp`).
    q = "layers/block/q_proj" if scan_layers else "layers_0/q_proj"
    q_ad = traverse_util.flatten_dict(state.params, sep="/")
    spec_b = q_ad[f"{q}/lora_b"].sharding.spec
    assert spec_b == partitioner.mesh_axes(
        P(*(("layers",) if scan_layers else ()), None, "heads", "head_dim")
    )
    if mesh_shape[2] > 1:
        assert "tensor" in tuple(spec_b)

    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 3e-2, lora=cfg))
    b0 = jax.device_get(state.params)
    losses = []
    for i in range(4):
        state, metrics = step(state, random_batch(seed=i % 2), base)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    after = jax.device_get(base)
    for name, x, y in zip(leaf_names(before), jax.tree.leaves(before), jax.tree.leaves(after)):
        assert np.array_equal(x, y), name  # bit-identical
    b1 = jax.device_get(state.params)
    changed = [
        n
        for n, x, y in zip(leaf_names(b0), jax.tree.leaves(b0), jax.tree.leaves(b1))
        if not np.array_equal(x, y)
    ]
    assert sorted(changed) == sorted(leaf_names(b0))  # every A and B moved

    # Eval on the merged params equals eval through the adapters.
    merged = setup.partition_merge()(base, state.params)
    eval_step = setup.partition_eval_step(steps.make_eval_step(model, cfg))
    via_adapters = eval_step(state.params, random_batch(seed=5), base)
    via_merged = jax.jit(steps.make_eval_step(model))(merged, random_batch(seed=5))
    np.testing.assert_allclose(via_adapters["loss_sum"], via_merged["loss_sum"], rtol=1e-6)


NEW_FAMILIES = {
    # Soft-capped scores and logits, a window every other layer, pre- and post-norms.
    "gemma2": lambda: gemma.GemmaConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        query_pre_attn_scalar=16,
        sliding_window=4,
    ),
    # LongRoPE past its original context of 4 positions, rotary over 3/4 of each head.
    "phi3_longrope": lambda: phi3.Phi3Config(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        original_max_position_embeddings=4,
        partial_rotary_factor=0.75,
        rope_scaling_type="longrope",
        rope_short_factor=(1.0, 1.5, 2.0),
        rope_long_factor=(2.0, 3.0, 4.0),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_lora_trains_the_new_families_scanned_and_rematerialised(family):
    """A bf16 LoRA run on a (2, 2, 2) mesh with scanned layers and full remat: the families'
    features (traced per-layer windows, soft-capping, LongRoPE's switch) differentiate."""
    config = dataclasses.replace(
        NEW_FAMILIES[family](), scan_layers=True, remat_policy="full", dtype="bfloat16"
    )
    model = DecoderOnlyModel(config)
    partitioner = Partitioner(mesh_shape=(2, 2, 2))
    cfg = lora.LoraConfig(rules=RULES, alpha=8.0)
    setup = steps.Setup(model, partitioner, adamw(3e-2), feature_lengths(), lora=cfg)
    base, state = setup.init_base(), setup.init_state()
    step = setup.partition_train_step(steps.make_train_step(model, partitioner, 3e-2, lora=cfg))
    losses = []
    for i in range(4):
        state, metrics = step(state, random_batch(seed=i % 2), base)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gptj"])
def test_merge_matches_textbook_lora_forward(family):
    if family == "llama":
        model = tiny_llama()
        cfg = lora.LoraConfig(rules=RULES, alpha=8.0)
        modules = ("q_proj", "v_proj", "o_proj", "down_proj")
        expected = [f"layers_{i}/{m}/kernel" for i in range(2) for m in modules]
    else:
        model = tiny_gptj()
        cfg = lora.LoraConfig(rules=((r"(q|v|out)_proj", 4), (r"fc_in", 2)), alpha=4.0)
        modules = ("q_proj", "v_proj", "out_proj", "fc_in")
        expected = [f"h_{i}/{m}/kernel" for i in range(2) for m in modules]
    shapes = model.example_batch_shapes()
    base = model.init_params(jax.random.PRNGKey(0), shapes)
    kernels = lora.plan(cfg, model, shapes)
    assert sorted(kernels) == sorted(expected)
    if family == "llama":
        assert kernels["layers_0/o_proj/kernel"].a_shape == (4, 8, 2)  # in = (heads, head_dim)
    adapters = lora.init_adapters(jax.random.PRNGKey(1), kernels)
    batch = decoder_batch(*padded_batch(128, (12, 7, 12, 3)))
    logits = jax.jit(model.compute_logits)

    # B starts at zero: the adapted model starts as the base.
    start = np.asarray(logits(lora.merge(base, adapters, cfg), batch))
    np.testing.assert_array_equal(start, np.asarray(logits(base, batch)))

    adapters = randomize_b(adapters)
    merged_logits = np.asarray(logits(lora.merge(base, adapters, cfg), batch))
    reference = reference_logits(model, base, adapters, cfg.alpha, batch)
    assert np.abs(reference - start).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(merged_logits, reference, atol=1e-5)
    # Training's unmerged path (adapters beside the kernels) computes the same model.
    unmerged = np.asarray(logits(lora.with_adapters(base, adapters, cfg.alpha), batch))
    np.testing.assert_allclose(unmerged, reference, atol=1e-5)


@pytest.mark.slow
def test_lora_dropout_acts_on_the_low_rank_path_only_in_training():
    model = tiny_llama(scan_layers=True)
    shapes = model.example_batch_shapes()
    base = model.init_params(jax.random.PRNGKey(0), shapes)
    batch = random_batch(seed=3)
    losses = {}
    for name, dropout in (("none", 0.0), ("half", 0.5)):
        cfg = lora.LoraConfig(rules=RULES, alpha=8.0, dropout=dropout)
        adapters = lora.init_adapters(jax.random.PRNGKey(1), lora.plan(cfg, model, shapes))
        loss_fn = jax.jit(lora.LoraModel(model, cfg, base).loss_fn)  # one compile per rng kind
        for b_name, ad in (("zero_b", adapters), ("random_b", randomize_b(adapters))):
            for rng_name, rng in (
                ("eval", None),
                ("rng0", jax.random.PRNGKey(0)),
                ("rng1", jax.random.PRNGKey(1)),
            ):
                losses[name, b_name, rng_name] = float(loss_fn(ad, batch, rng)[0])
    # B = 0: the low-rank path adds nothing, dropped or not (the base path is never dropped).
    zero_b = {v for k, v in losses.items() if k[1] == "zero_b"}
    assert len(zero_b) == 1
    # Without dropout, the rng changes nothing; with it, the loss depends on the rng in
    # training and equals the no-dropout loss in evaluation (rng None).
    assert losses["none", "random_b", "rng0"] == losses["none", "random_b", "eval"]
    assert losses["half", "random_b", "eval"] == losses["none", "random_b", "eval"]
    assert losses["half", "random_b", "rng0"] != losses["half", "random_b", "rng1"]
    assert losses["half", "random_b", "rng0"] != losses["none", "random_b", "rng0"]
    with pytest.raises(ValueError, match="dropout"):
        lora.LoraConfig(dropout=1.0)


def test_bad_rules_fail_clearly():
    model, shapes = tiny_llama(), tiny_llama().example_batch_shapes()
    with pytest.raises(ValueError, match=r"match no dense kernel.*layers_0/q_proj/kernel"):
        lora.plan(lora.LoraConfig(rules=((r"query/kernel", 4),)), model, shapes)
    with pytest.raises(ValueError, match="rank 64 is larger than kernel"):
        lora.plan(lora.LoraConfig(rules=((r"q_proj", 64),)), model, shapes)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        lora.LoraConfig(rules=((r"q_proj", 0),))
    with pytest.raises(ValueError, match="not a valid regex"):
        lora.LoraConfig(rules=((r"q_proj(", 4),))


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_and_exports_merged_to_hf(tmp_path):
    """train(lora=...) from an HF Llama: the checkpoint holds only adapters; export_hf and
    infer's loader merge them; transformers reproduces the adapted logits."""
    import tasks  # noqa: F401 - registers stdlib_py

    torch_model, hf_path = tiny_hf_llama(tmp_path, vocab_size=384)
    partitioner = Partitioner(mesh_shape=(1, 4, 2))
    model = run_dir.model_from_record(os.path.join(hf_path, "config.json"), partitioner)
    cfg = lora.LoraConfig(rules=RULES, alpha=8.0)
    model_dir = str(tmp_path / "run")
    dataset = DatasetConfig(
        mixture_or_task_name="stdlib_py", task_feature_lengths={"targets": 32}, batch_size=8
    )
    train.train(
        model=model,
        partitioner=partitioner,
        train_dataset_cfg=dataset,
        learning_rate=3e-2,
        model_dir=model_dir,
        total_steps=3,
        checkpoint_period=3,
        log_period=1,
        init_from_hf=hf_path,
        lora=cfg,
    )
    record = json.loads((tmp_path / "run" / "lora.json").read_text())
    assert record["base"] == {"hf": os.path.abspath(hf_path)}
    ckpt = checkpointer.Checkpointer(model_dir)
    saved = ckpt.saved_param_shapes(3)
    ckpt.close()
    assert saved and all(n.endswith(("/lora_a", "/lora_b")) for n in saved)
    assert saved["layers_0/q_proj/lora_b"] == (4, 4, 8)

    out = tmp_path / "exported"
    convert.export_hf(model_dir=model_dir, out_dir=str(out), partitioner=partitioner)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids, mask = padded_batch(250, (12, 7, 12, 3))
    theirs = torch_logits(reloaded, input_ids=ids, attention_mask=mask)

    # The adapted model, computed unmerged from the HF base and the saved adapters.
    base = hf.load_params(model, hf_path, partitioner)
    kernels = lora.plan(cfg, model, model.example_batch_shapes())
    abstract = jax.eval_shape(lambda: lora.init_adapters(jax.random.PRNGKey(0), kernels))
    ckpt = checkpointer.Checkpointer(model_dir)
    adapters = ckpt.restore_params(3, abstract)
    ckpt.close()
    assert float(jnp.abs(adapters["layers_0"]["q_proj"]["lora_b"]).max()) > 0
    adapted = reference_logits(model, base, adapters, cfg.alpha, decoder_batch(ids, mask))
    base_torch = torch_logits(torch_model, input_ids=ids, attention_mask=mask)
    assert max_abs_diff(adapted, base_torch, mask) > 1e-3  # training changed the model
    assert max_abs_diff(adapted, theirs, mask) < 1e-4

    # infer/eval's loader sees the merged model too.
    _, merged, step, _ = run_dir.load_model_and_params(model_dir, partitioner)
    assert step == 3
    ours = np.asarray(jax.jit(model.compute_logits)(merged, decoder_batch(ids, mask)))
    assert max_abs_diff(ours, theirs, mask) < 1e-4

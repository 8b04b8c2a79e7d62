"""Model options keep the math: remat, scan, packing, dtypes, the chunked loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxlm.models import layers
from flaxlm.models.base import DecoderOnlyModel, EncoderDecoderModel
from flaxlm.models.gemma import GemmaConfig
from flaxlm.models.llama import LlamaConfig
from flaxlm.models.t5 import T5Config
from flaxlm.parallel.partitioning import Partitioner
from flaxlm.training import steps as train_steps
from flaxlm.training.steps import Setup
from tests.helpers import (
    adamw,
    feature_lengths,
    jaxpr_equations,
    load_benchmark,
    random_batch,
    tiny_gptj,
)


def _params_and_batch(model):
    batch = {k: jnp.asarray(v) for k, v in random_batch(batch_size=2).items()}
    params = model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)})
    return params, batch


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize(
    "policy", ["full", "dots_saveable", "dots_with_no_batch_dims_saveable", "minimal"]
)
def test_remat_policy_gives_the_same_loss_and_gradients(policy, scan_layers):
    base = tiny_gptj(scan_layers=scan_layers)
    remat = tiny_gptj(remat_policy=policy, scan_layers=scan_layers)
    params, batch = _params_and_batch(base)

    def grads(model):
        return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0]))(params)

    (l0, g0), (l1, g1) = grads(base), grads(remat)
    assert abs(float(l0) - float(l1)) < 1e-5
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_scanned_layers_compute_what_unrolled_layers_compute():
    unrolled, scanned = tiny_gptj(), tiny_gptj(scan_layers=True)
    params, batch = _params_and_batch(unrolled)
    blocks = [params["h_0"], params["h_1"]]
    stacked = {k: v for k, v in params.items() if not k.startswith("h_")}
    stacked["h"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
    np.testing.assert_allclose(
        jax.jit(unrolled.compute_logits)(params, batch),
        jax.jit(scanned.compute_logits)(stacked, batch),
        atol=1e-5,
    )


def test_packed_segments_do_not_attend_across_and_positions_restart():
    model = tiny_gptj()
    params, batch = _params_and_batch(model)
    packed = jax.jit(model.compute_logits)(params, batch)
    # The second segment alone, as its own unpacked row.
    second = {
        "decoder_input_tokens": batch["decoder_input_tokens"][:, 8:14],
        "decoder_target_tokens": batch["decoder_target_tokens"][:, 8:14],
    }
    alone = jax.jit(model.compute_logits)(params, second)
    np.testing.assert_allclose(packed[:, 8:14], alone, atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    model = tiny_gptj(dtype="bfloat16")
    params, batch = _params_and_batch(model)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    logits = jax.jit(model.compute_logits)(params, batch)
    assert logits.dtype == jnp.float32
    ref = jax.jit(tiny_gptj().compute_logits)(params, batch)
    assert float(jnp.mean(jnp.abs(logits - ref))) < 0.05


def _dots(jaxpr) -> list:
    """Every dot_general of a jaxpr, nested jaxprs (custom_vjp, pjit, remat) included."""
    return [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "dot_general"]


def test_wide_dot_gives_float32_results_and_bfloat16_gradients():
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(2), (40, 16)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.PRNGKey(3), (3, 5, 40))
    dims = (((2,), (1,)), ((), ()))
    y = layers.dot_general(x, w, dims, jnp.float32)
    wide = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, wide)
    # The gradients are autodiff's of the plain bfloat16 dot, fed the rounded cotangent.
    _, vjp = jax.vjp(lambda a, b: layers.dot_general(a, b, dims, jnp.float32), x, w)
    _, plain = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), x, w)
    for got, want in zip(vjp(g), plain(g.astype(jnp.bfloat16)), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want)
    # Same dtype in and out: the plain dot, autodiff's own gradient.
    assert layers.dot_general(x, w, dims).dtype == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_bfloat16_head_multiplies_bfloat16_forward_and_backward(tied):
    """A bfloat16 model's head (the largest matmul of a big-vocabulary model) is a bfloat16
    product in the forward and both gradients, with float32 logits; float32 models keep
    float32 heads."""
    vocab = 136
    for dtype in ("bfloat16", "float32"):
        model = DecoderOnlyModel(
            LlamaConfig(
                vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1,
                num_heads=4, num_kv_heads=2, max_position_embeddings=64,
                tie_word_embeddings=tied, dtype=dtype,
            )
        )  # fmt: skip
        params, batch = _params_and_batch(model)
        assert jax.jit(model.compute_logits)(params, batch).dtype == jnp.float32
        loss = functools.partial(lambda p, m, b: m.loss_fn(p, b, None)[0], m=model, b=batch)
        grad = jax.make_jaxpr(jax.grad(loss))(params)
        head = [e for e in _dots(grad.jaxpr) if vocab in e.outvars[0].aval.shape
                or any(vocab in v.aval.shape for v in e.invars)]  # fmt: skip
        assert len(head) == 3  # the logits, the hidden states' and the weights' gradients
        for eqn in head:
            assert [v.aval.dtype for v in eqn.invars] == [jnp.dtype(dtype)] * 2, eqn


def test_feature_longer_than_positions_is_an_error():
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        tiny_gptj().check_lengths({"targets": 128})


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="num_heads"):
        tiny_gptj(hidden_size=30)


# ------------------------------------------------------------------ the chunked loss

# Widths that a (1, 2, 4) mesh splits; 160 ids of which 128 are real (targets stay below).
TINY = dict(
    vocab_size=160,
    real_vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama_untied": lambda: LlamaConfig(**TINY),
    "llama_tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "gemma2_softcapped": lambda: GemmaConfig(
        **TINY, model_type="gemma2", head_dim=8, query_pre_attn_scalar=8, tie_word_embeddings=True
    ),
}
CHUNK = 5  # does not divide SEQ_LEN = 16: the last block is padded


def _random_params(family):
    """Random params of the family's shapes (no init program to compile)."""
    model = DecoderOnlyModel(FAMILIES[family]())
    shapes = model.example_batch_shapes()
    abstract = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), shapes))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: rng.normal(0.0, 0.1, a.shape).astype(a.dtype), abstract)


def _loss_and_grads(family, mesh_shape):
    """Metric sums and gradients of a packed batch (padding at weight 0) through the
    partitioned gradient step, of the full loss and the chunked one (one program), and the
    compiled program's text."""
    config = FAMILIES[family]()
    models = [DecoderOnlyModel(config, z_loss=1e-2, loss_chunk_size=c) for c in (None, CHUNK)]
    partitioner = Partitioner(mesh_shape=mesh_shape, devices=jax.devices()[: np.prod(mesh_shape)])
    setup = Setup(models[0], partitioner, adamw(), feature_lengths())
    rng = jax.random.PRNGKey(0)

    def grads_fn(params, batch):
        return [
            train_steps.accumulate_gradients(m, partitioner, params, batch, rng) for m in models
        ]

    fn = partitioner.partition(grads_fn, (setup.state_shardings.params, setup.batch_axes), None)
    args = (_random_params(family), random_batch())
    compiled = fn.lower(*args).compile()
    return jax.device_get(compiled(*args)), compiled.as_text()


# One compile each: the untied, tied and soft-capped heads unsharded; the untied and tied
# heads with the vocabulary split on `tensor` (and the rows on `fsdp`).
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, mesh_shape",
    [
        ("llama_untied", (1, 1, 1)),
        ("gemma2_softcapped", (1, 1, 1)),
        ("llama_untied", (1, 2, 4)),
        ("llama_tied", (1, 2, 4)),
    ],
    ids=["llama_untied", "gemma2_softcapped", "llama_untied_tp4_fsdp2", "llama_tied_tp4_fsdp2"],
)
def test_chunked_loss_gives_the_same_loss_metrics_and_gradients(family, mesh_shape):
    [(grads, sums), (chunked_grads, chunked_sums)], hlo = _loss_and_grads(family, mesh_shape)
    assert sums["z_loss_sum"] > 0 and sums["correct_sum"] >= 0
    for name in ("loss_sum", "z_loss_sum", "correct_sum", "weight_sum"):
        np.testing.assert_allclose(chunked_sums[name], sums[name], rtol=1e-6, err_msg=name)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    if mesh_shape == (1, 2, 4):
        # A device's block of logits: its 4 of the 8 rows, 5 positions, 40 of 160 ids.
        assert "f32[4,5,40]" in hlo


def test_chunked_loss_gathers_the_head_and_sums_its_gradient_once_not_per_block():
    """Compiled gradients of the tied head (vocabulary on `tensor`, rows on `fsdp`): the
    collectives move as many bytes with 8 blocks of positions as with 1 (the head is
    gathered whole once and its gradient summed once, outside the loop over blocks)."""
    parse_hlo = load_benchmark("collectives").parse_hlo
    partitioner = Partitioner(mesh_shape=(1, 2, 4))

    def collective_bytes(chunk):
        model = DecoderOnlyModel(FAMILIES["llama_tied"](), loss_chunk_size=chunk)
        setup = Setup(model, partitioner, adamw(), feature_lengths())
        rng = jax.random.PRNGKey(0)
        fn = partitioner.partition(
            lambda p, b: train_steps.accumulate_gradients(model, partitioner, p, b, rng),
            (setup.state_shardings.params, setup.batch_axes),
            None,
        )
        params = jax.eval_shape(lambda: model.init_params(rng, model.example_batch_shapes()))
        hlo = fn.lower(params, random_batch()).compile().as_text()
        by_kind = parse_hlo(hlo, 8)["by_kind"]
        return {k: by_kind[k]["array_bytes"] for k in ("all-gather", "all-reduce")}

    assert collective_bytes(2) == collective_bytes(16)


def test_chunked_loss_keeps_the_logits_of_the_whole_batch_out_of_memory():
    """Compiled loss + gradients of a 32k vocabulary over 2 x 256 positions: the float32
    logits (64 MiB) dominate the temporaries unless computed 32 positions at a time."""
    config = LlamaConfig(**{**TINY, "vocab_size": 32768, "real_vocab_size": None})
    batch = {
        k: jax.ShapeDtypeStruct((2, 256), jnp.int32)
        for k in ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
    }

    def temp_bytes(loss_chunk_size):
        model = DecoderOnlyModel(config, loss_chunk_size=loss_chunk_size)
        params = jax.eval_shape(
            lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 8)})
        )
        grad_fn = jax.jit(jax.grad(lambda p, b: model.loss_fn(p, b, None)[0]))
        compiled = grad_fn.lower(params, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, chunked = temp_bytes(None), temp_bytes(32)
    assert full > 2 * 256 * 32768 * 4  # at least the logits
    assert chunked < 0.25 * full, (chunked, full)


def test_loss_chunk_size_on_a_model_that_cannot_chunk_is_an_error():
    with pytest.raises(ValueError, match="loss_chunk_size=64: EncoderDecoderModel with T5"):
        EncoderDecoderModel(T5Config(), loss_chunk_size=64)
    with pytest.raises(ValueError, match="loss_chunk_size must be positive"):
        DecoderOnlyModel(LlamaConfig(**TINY), loss_chunk_size=0)


def test_unpacked_features_are_what_the_converters_give():
    """`example_batch_shapes` names what each model's converter gives unpacked, without
    importing seqio (the compute core imports without TensorFlow: the accelerator
    benchmark's test in test_benchmarks.py runs its flaxlm side with both unimportable)."""
    from flaxlm.models.base import EncoderOnlyModel

    for model_class in (DecoderOnlyModel, EncoderDecoderModel, EncoderOnlyModel):
        converter = model_class.FEATURE_CONVERTER_CLS(pack=False)
        lengths = converter.get_model_feature_lengths({k: 8 for k in model_class.TASK_FEATURES})
        assert set(lengths) == set(model_class.UNPACKED_FEATURES), model_class
        assert set(lengths.values()) == {8}

"""The attention implementations agree: XLA einsums, jax.nn.dot_product_attention and the
blockwise (chunked) one, under every kind of mask; the chunked one stays linear in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxlm.inference import generation
from flaxlm.models import attention, masks
from tests.helpers import random_batch, tiny_gptj

IMPLEMENTATIONS = ("jax", "chunked")


def qkv(batch=2, q_len=13, kv_len=13, heads=4, kv_heads=2, head_dim=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim))
    return q, k, v


def segments(batch, length, cuts, pad):
    """Packed segment ids 1, 2, ... cut at `cuts`, the last `pad` positions padding (0)."""
    ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        ids[row, : length - pad] = 1 + np.searchsorted(cuts, np.arange(length - pad), "right")
    return jnp.asarray(ids)


def all_masks():
    seg = segments(2, 13, [4, 9], pad=2)
    kv_seg = segments(2, 11, [5], pad=3)
    return {
        "causal": (masks.attention_mask(None, 2, 13), 13, None),
        "causal_packed": (masks.attention_mask(seg, 2, 13), 13, None),
        "bidirectional_packed": (masks.attention_mask(seg, 2, 13, causal=False), 13, None),
        "sliding_window": (masks.attention_mask(seg, 2, 13, sliding_window=3), 13, None),
        "sliding_window_unpacked": (
            masks.attention_mask(None, 2, 13, sliding_window=3),
            13,
            None,
        ),
        "cross_padded": (
            masks.attention_mask(
                segments(2, 13, [6], pad=0),
                2,
                13,
                causal=False,
                kv_segment_ids=kv_seg,
                kv_length=11,
            ),
            11,
            None,
        ),
        "decoding_left_padded": (
            masks.causal_mask(
                None,
                2,
                3,
                masks.Decoding(jnp.int32(5), jnp.asarray([0, 4]), 13),
                sliding_window=4,
            ),
            13,
            None,
        ),
        "relative_bias": (
            masks.attention_mask(None, 2, 13, causal=False),
            13,
            jax.random.normal(jax.random.PRNGKey(9), (1, 4, 13, 13)),
        ),
        "no_mask": (None, 13, None),
    }


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(all_masks()))
def test_implementations_agree_under_every_mask(implementation, name):
    mask, kv_len, bias = all_masks()[name]
    q_len = mask.q_len if mask is not None else 13
    q, k, v = qkv(q_len=q_len, kv_len=kv_len)
    expected = attention.dot_product_attention(q, k, v, mask, bias=bias, implementation="xla")
    got = attention.dot_product_attention(
        q, k, v, mask, bias=bias, implementation=implementation, chunk_size=4
    )
    # Rows with no visible key (padding queries of a cross mask) are undefined anyway.
    if mask is not None:
        seen = np.asarray(mask.dense()).any(-1)[:, 0]  # [batch, q_len]
    else:
        seen = np.ones((2, q_len), bool)
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(expected)[seen], atol=2e-5)


def textbook_attention(q, k, v, mask, bias, softcap):
    """Softmax attention as a textbook writes it, key and value heads repeated per group:
    what autodiff differentiates to check the 'xla' attention's own backward."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def masks_with_hidden_rows():
    """all_masks(), and a cross mask whose padding queries see no key at all."""
    padded = masks.attention_mask(
        segments(2, 13, [6], pad=3),
        2,
        13,
        causal=False,
        kv_segment_ids=segments(2, 11, [5], pad=3),
        kv_length=11,
    )
    assert not np.asarray(padded.dense()).any(-1).all()
    return {**all_masks(), "padded_queries": (padded, 11, None)}


@pytest.mark.parametrize("kv_heads,softcap", [(4, None), (2, 3.0)])
@pytest.mark.parametrize("name", sorted(masks_with_hidden_rows()))
def test_xla_backward_equals_autodiff_of_textbook_attention(name, kv_heads, softcap):
    """The 'xla' attention's hand-written (flash-style) backward: query, key, value and
    bias gradients equal autodiff's, with one or two query heads per key head, soft-capped
    or not, rows with no visible key included (their scores get no gradient)."""
    mask, kv_len, bias = masks_with_hidden_rows()[name]
    q_len = mask.q_len if mask is not None else 13
    q, k, v = qkv(q_len=q_len, kv_len=kv_len, kv_heads=kv_heads)
    dense = None if mask is None else mask.dense()
    d_out = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)

    def grads(attend):
        return jax.grad(lambda *a: jnp.sum(attend(*a) * d_out), argnums)(q, k, v, bias)

    got = grads(
        lambda q, k, v, b: attention.dot_product_attention(q, k, v, mask, bias=b, softcap=softcap)
    )
    want = grads(lambda q, k, v, b: textbook_attention(q, k, v, dense, b, softcap))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4)


def test_a_dense_bool_mask_works_in_every_implementation():
    q, k, v = qkv()
    dense = masks.attention_mask(segments(2, 13, [5], pad=1), 2, 13).dense()
    expected = attention.dot_product_attention(q, k, v, dense)
    for implementation in IMPLEMENTATIONS:
        got = attention.dot_product_attention(
            q, k, v, dense, implementation=implementation, chunk_size=5
        )
        np.testing.assert_allclose(got[:, :12], expected[:, :12], atol=2e-5)


def test_plain_causal_attention_reaches_jax_as_is_causal_not_a_mask_tensor():
    """cuDNN skips the hidden blocks only when told `is_causal`; packed or offset masks
    (decoding) stay dense."""
    how = attention.jax_attention_mask
    assert how(masks.attention_mask(None, 2, 13)) == {
        "is_causal": True,
        "local_window_size": None,
    }
    window = how(masks.attention_mask(None, 2, 13, sliding_window=3))
    assert window == {"is_causal": True, "local_window_size": (2, 0)}
    for name in ("causal_packed", "bidirectional_packed", "decoding_left_padded", "cross_padded"):
        mask = all_masks()[name][0]
        assert set(how(mask)) == {"mask"}, name
        assert how(mask)["mask"].shape == mask.dense().shape
    assert how(None) == {"mask": None}


def test_auto_takes_cudnn_on_a_gpu_for_whole_sequence_half_precision_only(monkeypatch):
    causal = masks.attention_mask(None, 2, 13)
    choice = attention.auto_choice
    assert choice(causal, None, None, jnp.bfloat16) == "xla"  # CPU
    # Compiled for an H100 from here (the planner): cuDNN cannot be built, 'chunked' stands in.
    from flaxlm.plan import aot

    decoding = all_masks()["decoding_left_padded"][0]
    with jax.set_mesh(jax.sharding.Mesh(aot.gpu_devices("h100", 1), ("x",))):
        assert choice(causal, None, None, jnp.bfloat16) == "chunked"
        assert choice(causal, None, None, jnp.float32) == "xla"
        assert choice(decoding, None, None, jnp.bfloat16) == "xla"
        # and only for heads cuDNN takes on Hopper (Gemma 4's 512-wide global heads: XLA's)
        assert attention.cudnn_head_dim(256) and not attention.cudnn_head_dim(512)
    assert not attention.cudnn_head_dim(256)  # this host's: not a Hopper GPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert choice(causal, None, None, jnp.bfloat16) == "jax"
    assert choice(causal, None, None, "float16") == "jax"
    assert choice(causal, None, None, jnp.float32) == "xla"  # cuDNN takes half precision
    assert choice(causal, None, 50.0, jnp.bfloat16) == "xla"  # a soft cap (Gemma 2)
    assert choice(causal, jnp.zeros((1, 2, 13, 13)), None, jnp.bfloat16) == "xla"  # T5's bias
    for name in ("causal_packed", "bidirectional_packed", "sliding_window"):
        assert choice(all_masks()[name][0], None, None, jnp.bfloat16) == "jax", name  # dense
    for name in ("cross_padded", "decoding_left_padded"):
        assert choice(all_masks()[name][0], None, None, jnp.bfloat16) == "xla", name


@pytest.mark.parametrize("remat", ["none", "dots_with_no_batch_dims_saveable"])
def test_a_remat_scanned_model_still_takes_cudnn_on_a_gpu(monkeypatch, remat):
    """nn.remat and nn.scan trace every leaf of the mask they are handed: a `q_offset` of 0
    came back a tracer, so every remat'd model's plain causal mask looked like an offset one
    and 'auto' took 'xla' (1203 ms against 525 on one H200, benchmarks/HISTORY.md)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    chosen, plain = [], []
    choose = attention.auto_choice

    def spy(mask, bias, softcap, dtype):
        plain.append(masks.plain_causal(mask))
        chosen.append(choose(mask, bias, softcap, dtype))
        return chosen[-1]

    monkeypatch.setattr(attention, "auto_choice", spy)
    model = tiny_gptj(dtype="bfloat16", remat_policy=remat, scan_layers=True)
    unpacked = ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")
    batch = {k: jnp.asarray(random_batch(batch_size=2)[k]) for k in unpacked}
    params = jax.eval_shape(
        lambda: model.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)})
    )
    plain.clear()
    chosen.clear()
    jax.eval_shape(jax.grad(lambda p: model.loss_fn(p, batch, None)[0]), params)
    assert plain and all(plain) and set(chosen) == {"jax"}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_model_logits_and_gradients_agree_across_implementations(implementation):
    batch = {k: jnp.asarray(v) for k, v in random_batch(batch_size=2).items()}
    xla = tiny_gptj()
    other = tiny_gptj(attention=implementation, attention_chunk_size=5)
    params = xla.init_params(jax.random.PRNGKey(0), {"decoder_input_tokens": (1, 16)})

    def loss_and_grads(model):
        return jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0]))(params)

    (l0, g0), (l1, g1) = loss_and_grads(xla), loss_and_grads(other)
    assert abs(float(l0) - float(l1)) < 1e-5
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_chunked_attention_memory_grows_linearly_with_length_in_training_too():
    def temp_bytes(implementation, length, grad):
        q, k, v = qkv(batch=1, q_len=length, kv_len=length, heads=4, kv_heads=4, head_dim=16)
        mask = masks.attention_mask(segments(1, length, [length // 3], 0), 1, length)

        def attend(q, k, v):
            out = attention.dot_product_attention(
                q, k, v, mask, implementation=implementation, chunk_size=256
            )
            return jnp.sum(out * v)

        fn = jax.jit(jax.grad(attend, argnums=(0, 1, 2)) if grad else attend)
        return fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    for grad in (False, True):
        xla = [temp_bytes("xla", n, grad) for n in (1024, 4096)]
        chunked = [temp_bytes("chunked", n, grad) for n in (1024, 4096)]
        assert xla[1] > 10 * xla[0], (grad, xla)  # the scores grow with length squared
        assert chunked[1] < 6 * chunked[0], (grad, chunked)  # blocks: linear in length
        assert chunked[1] < xla[1] / 8, (grad, chunked, xla)


def test_unknown_attention_is_named():
    with pytest.raises(ValueError, match="attention 'flash'"):
        tiny_gptj(attention="flash")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_decoding_gives_the_same_tokens_with_every_implementation(implementation):
    xla = tiny_gptj()
    other = tiny_gptj(attention=implementation, attention_chunk_size=4)
    params = xla.init_params(jax.random.PRNGKey(1), {"decoder_input_tokens": (1, 16)})
    prompts = {"inputs": np.asarray([[5, 9, 33, 2, 7, 0, 0], [8, 1, 4, 4, 4, 4, 9]], np.int32)}
    np.testing.assert_array_equal(
        generation.generate(other, params, prompts, max_new_tokens=10, eos_id=None),
        generation.generate(xla, params, prompts, max_new_tokens=10, eos_id=None),
    )

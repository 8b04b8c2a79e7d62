"""GPT-J module options keep the math: remat, scan, packing, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import random_batch, tiny_gptj


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


def test_scanned_layers_compute_what_unrolled_layers_compute():
    unrolled, scanned = tiny_gptj(), tiny_gptj(scan_layers=True)
    params, batch = _params_and_batch(unrolled)
    blocks = [params["h_0"], params["h_1"]]
    stacked = {k: v for k, v in params.items() if not k.startswith("h_")}
    stacked["h"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
    np.testing.assert_allclose(
        unrolled.compute_logits(params, batch), scanned.compute_logits(stacked, batch), atol=1e-5
    )


def test_packed_segments_do_not_attend_across_and_positions_restart():
    model = tiny_gptj()
    params, batch = _params_and_batch(model)
    packed = model.compute_logits(params, batch)
    # The second segment alone, as its own unpacked row.
    second = {
        "decoder_input_tokens": batch["decoder_input_tokens"][:, 8:14],
        "decoder_target_tokens": batch["decoder_target_tokens"][:, 8:14],
    }
    alone = model.compute_logits(params, second)
    np.testing.assert_allclose(packed[:, 8:14], alone, atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    model = tiny_gptj(dtype="bfloat16")
    params, batch = _params_and_batch(model)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    logits = model.compute_logits(params, batch)
    assert logits.dtype == jnp.float32
    ref = tiny_gptj().compute_logits(params, batch)
    assert float(jnp.mean(jnp.abs(logits - ref))) < 0.05


def test_feature_longer_than_positions_is_an_error():
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        tiny_gptj().check_lengths({"targets": 128})


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="num_heads"):
        tiny_gptj(hidden_size=30)

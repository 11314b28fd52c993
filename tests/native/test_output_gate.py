"""The fused attention step with Qwen3.5's output gate (and its per-head q/k norms and partial
rotary) against a plain float64 numpy reference, on every kernel level and thread count: the
attention output times sigmoid(h wg^T) before the output product."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

D, H, K, HD, HR = 64, 4, 2, 16, 4  # GQA 2:1, RoPE on the leading 4 dims of each head
EPS = 1e-6


def gaussian(shape, seed, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _rms(x, w):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + EPS) * w


def _reference(x, c, cos, sin, keys, values, n_past, gated):
    """transformers' Qwen3_5MoeAttention in float64, the KV cache appended."""
    x64 = x.astype(np.float64)
    h = _rms(x64, c["norm"])
    T = x.shape[0]
    q, k, v = ((h @ c[n].T.astype(np.float64)).reshape(T, -1, HD) for n in ("q", "k", "v"))
    q, k = _rms(q, c["q_norm"]), _rms(k, c["k_norm"])

    def rope(t):
        rot, rest = t[..., :HR], t[..., HR:]
        turned = np.concatenate([-rot[..., HR // 2:], rot[..., :HR // 2]], -1)
        return np.concatenate([rot * cos[:, None] + turned * sin[:, None], rest], -1)

    q, k = rope(q), rope(k)
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    keys[n_past:n_past + T], values[n_past:n_past + T] = k, v
    out = np.zeros((T, H, HD))
    for t in range(T):
        for head in range(H):
            kh = head // (H // K)
            logits = keys[: n_past + t + 1, kh] @ q[t, head] * HD ** -0.5
            p = np.exp(logits - logits.max())
            out[t, head] = (p / p.sum()) @ values[: n_past + t + 1, kh]
    out = out.reshape(T, H * HD)
    if gated:
        out = out / (1.0 + np.exp(-(h @ c["gate"].T.astype(np.float64))))
    return x64 + out @ c["o"].T.astype(np.float64)


@pytest.fixture(scope="module")
def case():
    c = {"q": gaussian((H * HD, D), 1, 0.3), "k": gaussian((K * HD, D), 2, 0.3), "v": gaussian((K * HD, D), 3, 0.3),
         "o": gaussian((D, H * HD), 4, 0.3), "gate": gaussian((H * HD, D), 5, 0.5)}
    c.update(norm=1.0 + gaussian((D,), 6, 0.1), q_norm=1.0 + gaussian((HD,), 7, 0.2), k_norm=1.0 + gaussian((HD,), 8, 0.2))
    return c


def _layer(c, gated):
    return native.attention_layer(D, H, K, HD, c["norm"], TensorType.F32, c["q"], c["k"], c["v"], TensorType.F32, c["o"],
                                  eps=EPS, scale=HD ** -0.5, qk_norm="head", q_norm=c["q_norm"], k_norm=c["k_norm"],
                                  rotary_dim=HR, wg=c["gate"] if gated else None)


@pytest.mark.parametrize("n_tok", [1, 7])
def test_gated_attention_block_matches_the_reference(n_tok, case, kernel_level, pools):
    n_past, capacity = 3, 12
    x = gaussian((n_tok, D), 20)
    angles = gaussian((n_tok, HR), 21)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    past_keys, past_values = gaussian((capacity, K, HD), 22), gaussian((capacity, K, HD), 23)
    want = _reference(x, case, cos, sin, past_keys, past_values, n_past, gated=True)
    ungated = _reference(x, case, cos, sin, past_keys, past_values, n_past, gated=False)
    assert np.abs(want - ungated).max() > 1e-2  # the gate matters at this size
    layer = _layer(case, gated=True)
    for level in native.supported_kernels():
        kernel_level(level)
        results = []
        for n in (1, 2, 3):
            got = x.copy()
            native.attention_block(layer, got, cos, sin, past_keys.copy(), past_values.copy(), n_past, pool=pools[n])
            results.append(got)
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0], err_msg=level)
        np.testing.assert_allclose(results[0], want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=level)


@pytest.mark.parametrize("type_", [TensorType.Q8_0, TensorType.Q4_G64])
def test_quantized_gate_is_read_as_its_type(type_, case):
    """The gate shares q/k/v's type and activation quantization: a quantized layer's result is
    its dequantized weights' result up to the activation rounding."""
    x = gaussian((3, D), 30)
    angles = gaussian((3, HR), 31)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    enc = {n: native.quantize(type_, case[n]) for n in ("q", "k", "v", "gate")}
    dec = {n: native.dequantize(type_, enc[n], *case[n].shape) for n in enc}
    layer = native.attention_layer(D, H, K, HD, case["norm"], type_, enc["q"], enc["k"], enc["v"], TensorType.F32,
                                   case["o"], eps=EPS, scale=HD ** -0.5, qk_norm="head", q_norm=case["q_norm"],
                                   k_norm=case["k_norm"], rotary_dim=HR, wg=enc["gate"])
    got = x.copy()
    native.attention_block(layer, got, cos, sin, np.zeros((4, K, HD), np.float32), np.zeros((4, K, HD), np.float32), 0)
    want = _reference(x, {**case, **dec}, cos, sin, np.zeros((4, K, HD)), np.zeros((4, K, HD)), 0, gated=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_attention_layer_checks_the_gate_size(case):
    with pytest.raises(native.InvalidArgumentError):
        native.attention_layer(D, H, K, HD, case["norm"], TensorType.F32, case["q"], case["k"], case["v"],
                               TensorType.F32, case["o"], eps=EPS, scale=HD ** -0.5, wg=case["gate"][:-1])

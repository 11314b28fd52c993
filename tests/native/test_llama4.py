"""libcolibri's Llama 4 steps against plain float64 numpy references (and transformers' own
modules where they exist), on every kernel level and thread count: the top-k-then-sigmoid
router, experts whose routing weight scales their input, and the attention step's RoPE on
interleaved pairs, NoPE layers, the unweighted q/k norm after RoPE and attention temperature
tuning."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

QUANT_TYPES = [TensorType.Q8_0, TensorType.Q4_G64, TensorType.MXFP4]


def gaussian(shape, seed, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# --- router: top-k logits, then sigmoid -------------------------------------------------------

E = 16


def test_topk_sigmoid_route_chooses_and_weighs_as_transformers(kernel_level, pools):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    for top_k in (1, 2):
        module = Llama4Router(transformers.Llama4TextConfig(hidden_size=64, num_local_experts=E,
                                                             num_experts_per_tok=top_k))
        gen = torch.Generator().manual_seed(top_k)
        with torch.no_grad():
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
            x = torch.randn((40, 64), generator=gen)
            scores, _ = module(x)  # (T, E): sigmoid of the chosen logits, 0 elsewhere
        want_experts = torch.topk(scores, top_k, dim=1).indices.numpy()
        want_weights = np.take_along_axis(scores.numpy(), want_experts, 1)
        router = native.moe_router(TensorType.F32, module.weight.detach().numpy(), E, 64, top_k, normalize=False,
                                   scoring="topk_sigmoid")
        for level in native.supported_kernels():
            kernel_level(level)
            for n in (1, 2):
                experts, weights = native.moe_router_route(router, x.numpy(), pool=pools[n])
                np.testing.assert_array_equal(experts, want_experts, err_msg=level)
                np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7, err_msg=level)


def test_topk_sigmoid_chooses_by_logit_where_sigmoid_scores_tie():
    """sigmoid(20) and sigmoid(30) are both 1.0 in float32: choosing by the sigmoid would take
    the lower index, Llama 4 takes the larger logit."""
    logits = np.zeros((1, E), np.float32)
    logits[0, [3, 9]] = [20.0, 30.0]
    identity = np.eye(E, dtype=np.float32)
    by_logit = native.moe_router(TensorType.F32, identity, E, E, 1, normalize=False, scoring="topk_sigmoid")
    by_score = native.moe_router(TensorType.F32, identity, E, E, 1, normalize=False, scoring="sigmoid")
    assert native.moe_router_route(by_logit, logits)[0].tolist() == [[9]]
    assert native.moe_router_route(by_score, logits)[0].tolist() == [[3]]
    np.testing.assert_array_equal(native.moe_router_route(by_logit, logits)[1], [[1.0]])


# --- experts: the routing weight on the input -------------------------------------------------


def _experts(type_, n_experts, dim, ffn, seed):
    return [tuple(native.quantize(type_, m) for m in (gaussian((ffn, dim), seed + 3 * e, 0.12),
                                                      gaussian((ffn, dim), seed + 3 * e + 1, 0.12),
                                                      gaussian((dim, ffn), seed + 3 * e + 2, 0.1)))
            for e in range(n_experts)]


def _reference(type_, experts, dim, ffn, x, expert_of, weight, on_input):
    out = np.zeros(x.shape, np.float64)
    for e, (g, u, d) in enumerate(experts):
        gd, ud, dd = (native.dequantize(type_, m, *s).astype(np.float64)
                      for m, s in ((g, (ffn, dim)), (u, (ffn, dim)), (d, (dim, ffn))))
        for t, a in zip(*np.nonzero(expert_of == e)):
            xin = x[t] * np.float64(weight[t, a]) if on_input else x[t].astype(np.float64)
            gate, up = xin @ gd.T, xin @ ud.T
            y = (gate / (1 + np.exp(-gate)) * up) @ dd.T
            out[t] += y if on_input else weight[t, a] * y
    return out


@pytest.mark.parametrize("type_", [TensorType.F32, TensorType.BF16, *QUANT_TYPES], ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("n_tok", [1, 6])
def test_weight_on_input_matches_the_reference(type_, n_tok, kernel_level, pools):
    n_experts, dim, ffn, top_k = 5, 128, 64, 2
    experts = _experts(type_, n_experts, dim, ffn, 90)
    rng = np.random.default_rng(n_tok)
    x = gaussian((n_tok, dim), 91)
    expert_of = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tok)]).astype(np.int32)
    expert_of[0, -1] = -1
    weight = (0.2 + rng.random((n_tok, top_k))).astype(np.float32)
    want = _reference(type_, experts, dim, ffn, x, expert_of, weight, on_input=True)
    on_output = _reference(type_, experts, dim, ffn, x, expert_of, weight, on_input=False)
    assert np.abs(want - on_output).max() > 0.05 * np.abs(want).max()  # SwiGLU is not linear: it matters where
    for level in native.supported_kernels():
        kernel_level(level)
        results = []
        for n in (1, 2, 3):
            out = np.full((n_tok, dim), 0.5, np.float32)
            native.moe_experts(type_, *zip(*experts), dim, ffn, x, expert_of, weight, out, pool=pools[n],
                               weight_on_input=True)
            results.append(out - np.float32(0.5))
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0], err_msg=level)
        quantized_activations = level != "portable" and type_ in QUANT_TYPES
        bound = 4e-2 if quantized_activations else 1e-4
        assert np.abs(results[0] - want).max() <= bound * np.abs(want).max() + 1e-6, level


def test_weight_on_input_runs_the_expert_on_the_scaled_row_bit_for_bit(kernel_level):
    """One expert, weight w: the same bits as the plain call on the row w * x with weight 1."""
    experts = _experts(TensorType.Q8_0, 2, 64, 64, 95)
    x = gaussian((3, 64), 96)
    expert_of = np.array([[1], [0], [1]], np.int32)
    weight = np.array([[0.75], [0.3], [1.5]], np.float32)
    for level in native.supported_kernels():
        kernel_level(level)
        scaled, plain = np.zeros((3, 64), np.float32), np.zeros((3, 64), np.float32)
        native.moe_experts(TensorType.Q8_0, *zip(*experts), 64, 64, x, expert_of, weight, scaled, weight_on_input=True)
        native.moe_experts(TensorType.Q8_0, *zip(*experts), 64, 64, x * weight, expert_of, np.ones_like(weight), plain)
        np.testing.assert_array_equal(scaled, plain, err_msg=level)


def test_expert_ffn_refuses_a_weight_on_input_flag_other_than_0_or_1():
    experts = _experts(TensorType.F32, 1, 64, 64, 97)
    buffers = [native.ExpertBuffers(TensorType.F32, *experts[0], 64, 64)]
    kind = native.ExpertFfn(activation=0, weight_on_input=2)
    ptrs = (native.ctypes.c_void_p * 3)(*[getattr(buffers[0], f) for f in ("gate", "up", "down")])
    base, size = native.ctypes.addressof(ptrs), native.ctypes.sizeof(native.ctypes.c_void_p)
    x, out = gaussian((1, 64), 98), np.zeros((1, 64), np.float32)
    expert_of, weight = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    status = native._lib().col_moe_experts_ffn(None, native.ctypes.addressof(kind), int(TensorType.F32), 1, base,
                                               base + size, base + 2 * size, 64, 64, x.ctypes.data, 1,
                                               expert_of.ctypes.data, weight.ctypes.data, 1, out.ctypes.data)
    assert status == 1 and not out.any()  # COL_EINVAL, nothing written


# --- attention: pairs, NoPE, the q/k norm after RoPE, temperature ----------------------------

D, H, K, HD = 64, 4, 2, 16
EPS = 1e-5


def _rope_pairs(t, cos, sin):
    """Llama 4's complex rotary: pair (x_2i, x_2i+1) times e^(i angle_i), cos/sin (T, HD) with
    the angle of pair i in columns i and i + HD / 2."""
    half = HD // 2
    a, b = t[..., 0::2], t[..., 1::2]
    c, s = cos[:, None, :half], sin[:, None, :half]
    out = np.empty_like(t)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def _attention_reference(x, norm, w, cos, sin, keys, values, n_past, no_rope, l2, temperature):
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS) * norm
    T = x.shape[0]
    q, k, v = ((h @ w[n].T.astype(np.float64)).reshape(T, -1, HD) for n in ("q", "k", "v"))
    if not no_rope:
        q, k = _rope_pairs(q, cos, sin), _rope_pairs(k, cos, sin)
    if l2:
        q, k = (t / np.sqrt((t ** 2).mean(-1, keepdims=True) + EPS) for t in (q, k))
    if temperature:
        floor, scale = temperature
        p = n_past + np.arange(T)
        q = q * (np.log1p(np.floor((p + 1) / floor)) * scale + 1)[:, None, None]
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    keys[n_past:n_past + T], values[n_past:n_past + T] = k, v
    out = np.zeros((T, H, HD))
    for t in range(T):
        for head in range(H):
            kh = head // (H // K)
            logits = keys[:n_past + t + 1, kh] @ q[t, head] * HD ** -0.5
            p = np.exp(logits - logits.max())
            out[t, head] = (p / p.sum()) @ values[:n_past + t + 1, kh]
    return x64 + out.reshape(T, H * HD) @ w["o"].T.astype(np.float64)


CASES = {  # (no_rope, l2 norm after rope, temperature (floor, scale))
    "pairs": (False, False, None),
    "pairs+l2": (False, True, None),
    "nope+temperature": (True, False, (3, 0.5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n_tok", [1, 6])
def test_attention_block_llama4_features_match_the_reference(case, n_tok, kernel_level, pools):
    no_rope, l2, temperature = CASES[case]
    w = {"q": gaussian((H * HD, D), 1, 0.3), "k": gaussian((K * HD, D), 2, 0.3), "v": gaussian((K * HD, D), 3, 0.3),
         "o": gaussian((D, H * HD), 4, 0.3)}
    norm = 1.0 + gaussian((D,), 9, 0.1)
    ones = np.ones(HD, np.float32)
    layer = native.attention_layer(D, H, K, HD, norm, TensorType.F32, w["q"], w["k"], w["v"], TensorType.F32, w["o"],
                                   eps=EPS, scale=HD ** -0.5, qk_norm="head_after_rope" if l2 else "none",
                                   q_norm=ones if l2 else None, k_norm=ones if l2 else None, rope_interleaved=True,
                                   no_rope=no_rope, temperature=temperature)
    n_past, capacity = 5, 12
    x = gaussian((n_tok, D), 20)
    half_angles = gaussian((n_tok, HD // 2), 21)
    angles = np.concatenate([half_angles, half_angles], axis=1)  # as Rotary.cos_sin lays them out
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    past_keys, past_values = gaussian((capacity, K, HD), 22), gaussian((capacity, K, HD), 23)
    want = _attention_reference(x, norm, w, cos, sin, past_keys, past_values, n_past, no_rope, l2, temperature)
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


def test_each_llama4_attention_feature_changes_the_result():
    """Guards the reference cases above against testing a feature that does nothing."""
    w = {n: gaussian(s, i, 0.3) for i, (n, s) in enumerate((("q", (H * HD, D)), ("k", (K * HD, D)),
                                                             ("v", (K * HD, D)), ("o", (D, H * HD))))}
    x, norm = gaussian((6, D), 20), 1.0 + gaussian((D,), 9, 0.1)
    half = gaussian((6, HD // 2), 21)
    cos, sin = np.cos(np.concatenate([half, half], 1)), np.sin(np.concatenate([half, half], 1))
    keys, values = gaussian((12, K, HD), 22), gaussian((12, K, HD), 23)
    run = lambda *flags: _attention_reference(x, norm, w, cos, sin, keys, values, 5, *flags)  # noqa: E731
    base = run(False, False, None)
    for other in (run(True, False, None), run(False, True, None), run(True, False, (3, 0.5))):
        assert np.abs(other - base).max() > 1e-3
    assert np.abs(run(True, False, (3, 0.5)) - run(True, False, None)).max() > 1e-3


def test_attention_layer_refuses_a_bad_temperature():
    w = gaussian((H * HD, D), 1)
    for temperature in ((0, 0.1), (8, float("nan"))):
        with pytest.raises(native.InvalidArgumentError):
            native.attention_layer(D, H, K, HD, np.ones(D, np.float32), TensorType.F32, w, w[:K * HD], w[:K * HD],
                                   TensorType.F32, w.T.copy(), eps=EPS, scale=0.25, temperature=temperature)


def test_attention_layer_struct_matches_c():
    assert native.ctypes.sizeof(native.AttentionLayer) == native._lib().col_attention_layer_size()

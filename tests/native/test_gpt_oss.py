"""libcolibri's gpt-oss steps against plain float64 numpy references, on every kernel level
and thread count: attention sinks in the fused attention step, the top-k-then-softmax router
with a logit bias (also against transformers' GptOssTopKRouter), and the fused experts with
per-expert biases and the clamped SwiGLU."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

QUANT_TYPES = [TensorType.Q8_0, TensorType.Q4_G64, TensorType.MXFP4]


@pytest.fixture
def kernel_level():
    before = native.kernels()
    yield native.set_kernels
    native.set_kernels(before)


def gaussian(shape, seed, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# --- attention sinks ------------------------------------------------------------------------

D, H, K, HD = 64, 4, 2, 16  # GQA 2:1


def _attention_reference(x, norm, w, b, sinks, cos, sin, keys, values, n_past, window):
    """gpt-oss's attention step in float64 (transformers' eager_attention_forward with s_aux):
    the sink joins each head's logits, the softmax runs over both, the sink's share is dropped."""
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * norm
    T = x.shape[0]
    q, k, v = ((h @ w[n].T.astype(np.float64) + b[n]).reshape(T, -1, HD) for n in ("q", "k", "v"))

    def rope(t):
        half = HD // 2
        turned = np.concatenate([-t[..., half:], t[..., :half]], -1)
        return t * cos[:, None] + turned * sin[:, None]

    q, k = rope(q), rope(k)
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    keys[n_past:n_past + T], values[n_past:n_past + T] = k, v
    out = np.zeros((T, H, HD))
    for t in range(T):
        pos = n_past + t
        lo = max(0, pos - window + 1) if window else 0
        for head in range(H):
            kh = head // (H // K)
            logits = keys[lo:pos + 1, kh] @ q[t, head] * HD ** -0.5
            both = np.append(logits, sinks[head]) if sinks is not None else logits
            p = np.exp(both - both.max())
            p = p[:len(logits)] / p.sum()
            out[t, head] = p @ values[lo:pos + 1, kh]
    return x64 + out.reshape(T, H * HD) @ w["o"].T.astype(np.float64) + b["o"]


@pytest.fixture(scope="module")
def attention_case():
    w = {"q": gaussian((H * HD, D), 1, 0.3), "k": gaussian((K * HD, D), 2, 0.3), "v": gaussian((K * HD, D), 3, 0.3),
         "o": gaussian((D, H * HD), 4, 0.3)}
    b = {n: gaussian((m.shape[0],), 5 + i, 0.1) for i, (n, m) in enumerate(w.items())}
    norm = 1.0 + gaussian((D,), 9, 0.1)
    sinks = gaussian((H,), 10, 1.5)  # the size of a trained model's sinks
    return norm, w, b, sinks


def _layer(attention_case, window, sinks):
    norm, w, b, _ = attention_case
    return native.attention_layer(D, H, K, HD, norm, TensorType.F32, w["q"], w["k"], w["v"], TensorType.F32, w["o"],
                                  eps=1e-5, scale=HD ** -0.5, window=window, bq=b["q"], bk=b["k"], bv=b["v"], bo=b["o"],
                                  sinks=sinks)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_tok", [1, 6])
def test_attention_block_with_sinks_matches_the_reference(window, n_tok, attention_case, kernel_level, pools):
    norm, w, b, sinks = attention_case
    layer = _layer(attention_case, window, sinks)
    n_past, capacity = 4, 12
    x = gaussian((n_tok, D), 20)
    angles = gaussian((n_tok, HD), 21)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    past_keys, past_values = gaussian((capacity, K, HD), 22), gaussian((capacity, K, HD), 23)
    want = _attention_reference(x, norm, w, b, sinks, cos, sin, past_keys, past_values, n_past, window)
    without_sinks = _attention_reference(x, norm, w, b, None, cos, sin, past_keys, past_values, n_past, window)
    assert np.abs(want - without_sinks).max() > 1e-2  # the sinks matter at this size
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


def test_a_sink_of_minus_infinity_is_no_sink(attention_case, kernel_level):
    """exp(-inf) adds exactly 0 to the denominator: the same bits as a layer without sinks."""
    x = gaussian((5, D), 30)
    angles = gaussian((5, HD), 31)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    for level in native.supported_kernels():
        kernel_level(level)
        outs = []
        for sinks in (None, np.full(H, -np.inf, np.float32)):
            got = x.copy()
            native.attention_block(_layer(attention_case, 2, sinks), got, cos, sin, np.zeros((8, K, HD), np.float32),
                                   np.zeros((8, K, HD), np.float32), 0)
            outs.append(got)
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=level)


def test_attention_layer_checks_the_sinks_length(attention_case):
    with pytest.raises(native.InvalidArgumentError):
        _layer(attention_case, None, np.zeros(H + 1, np.float32))


# --- router: top-k logits, then softmax ------------------------------------------------------

E, TOP_K = 32, 4


def _reference_topk_softmax(logits: np.ndarray, bias: np.ndarray | None, top_k: int):
    z = logits.astype(np.float64) + (0 if bias is None else bias)
    order = np.argsort(-z, axis=1, kind="stable")[:, :top_k]  # the lower index first on ties
    chosen = np.take_along_axis(z, order, 1)
    p = np.exp(chosen - chosen[:, :1])
    return order, p / p.sum(1, keepdims=True)


@pytest.mark.parametrize("biased", [False, True])
def test_topk_softmax_route_matches_numpy(biased, kernel_level, pools):
    """An identity router (E = D) over x = logits: every dot product is exact on every level."""
    logits = gaussian((50, E), 40, 2.0)
    bias = gaussian((E,), 41, 1.0) if biased else None
    router = native.moe_router(TensorType.F32, np.eye(E, dtype=np.float32), E, E, TOP_K, normalize=False,
                               scoring="topk_softmax", logit_bias=bias)
    want_experts, want_weights = _reference_topk_softmax(logits, bias, TOP_K)
    for level in native.supported_kernels():
        kernel_level(level)
        for n in (1, 2):
            experts, weights = native.moe_router_route(router, logits, pool=pools[n])
            np.testing.assert_array_equal(experts, want_experts, err_msg=level)
            np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7, err_msg=level)
            np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-6)


def test_the_logit_bias_both_chooses_and_weighs():
    """Unlike the choice bias, gpt-oss's router bias moves the logits the softmax sees."""
    logits = np.zeros((1, E), np.float32)
    bias = np.zeros(E, np.float32)
    bias[[5, 9]] = [3.0, 1.0]
    router = native.moe_router(TensorType.F32, np.eye(E, dtype=np.float32), E, E, 2, normalize=False,
                               scoring="topk_softmax", logit_bias=bias)
    experts, weights = native.moe_router_route(router, logits)
    assert experts.tolist() == [[5, 9]]
    np.testing.assert_allclose(weights, [[1 / (1 + np.exp(-2.0)), 1 / (1 + np.exp(2.0))]], rtol=1e-6)


def test_router_rejects_a_logit_bias_of_the_wrong_length():
    with pytest.raises(native.InvalidArgumentError):
        native.moe_router(TensorType.F32, np.eye(E, dtype=np.float32), E, E, 2, normalize=False, scoring="topk_softmax",
                          logit_bias=np.zeros(E - 1, np.float32))


def test_topk_softmax_route_chooses_and_weighs_as_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    module = GptOssTopKRouter(transformers.GptOssConfig(hidden_size=64, num_local_experts=E, num_experts_per_tok=TOP_K))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
        module.bias.copy_(torch.randn(E, generator=gen) * 0.5)
        x = torch.randn((40, 64), generator=gen)
        _, want_weights, want_experts = module(x)
    router = native.moe_router(TensorType.F32, module.weight.detach().numpy(), E, 64, TOP_K, normalize=False,
                               scoring="topk_softmax", logit_bias=module.bias.detach().numpy())
    experts, weights = native.moe_router_route(router, x.numpy())
    np.testing.assert_array_equal(experts, want_experts.numpy())  # torch.topk is sorted, best first
    np.testing.assert_allclose(weights, want_weights.numpy(), rtol=1e-5, atol=1e-7)


# --- experts with biases and the clamped SwiGLU -----------------------------------------------

ALPHA = 1.702


def _experts(type_, n_experts, dim, ffn, seed):
    """(gate, up, down encoded, (gate_bias, up_bias, down_bias) float32) per expert; the gate
    and up large enough that a clamp of 0.5 bites on about a third of them."""
    made = []
    for e in range(n_experts):
        s = seed + 10 * e
        mats = gaussian((ffn, dim), s, 0.12), gaussian((ffn, dim), s + 1, 0.12), gaussian((dim, ffn), s + 2, 0.1)
        biases = gaussian((ffn,), s + 3, 0.2), gaussian((ffn,), s + 4, 0.2), gaussian((dim,), s + 5, 0.2)
        made.append((tuple(native.quantize(type_, m) for m in mats), biases))
    return made


def _clamped_swiglu(g, u, limit):
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1) * (g / (1 + np.exp(-ALPHA * g)))


def _reference(type_, experts, dim, ffn, x, expert_of, weight, limit):
    out = np.zeros(x.shape, np.float64)
    for e, ((g, u, d), (bg, bu, bd)) in enumerate(experts):
        gd, ud, dd = (native.dequantize(type_, m, *s).astype(np.float64) for m, s in ((g, (ffn, dim)), (u, (ffn, dim)), (d, (dim, ffn))))
        for t, a in zip(*np.nonzero(expert_of == e)):
            h = _clamped_swiglu(x[t] @ gd.T + bg, x[t] @ ud.T + bu, limit)
            out[t] += weight[t, a] * (h @ dd.T + bd)
    return out


@pytest.mark.parametrize("type_", [TensorType.F32, TensorType.BF16, *QUANT_TYPES], ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("n_tok", [1, 5])
def test_experts_with_biases_and_the_clamped_swiglu_match_the_reference(type_, n_tok, kernel_level, pools):
    n_experts, dim, ffn, top_k, limit = 5, 192, 128, 3, 0.5
    experts = _experts(type_, n_experts, dim, ffn, 50)
    rng = np.random.default_rng(n_tok)
    x = gaussian((n_tok, dim), 60)
    expert_of = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tok)]).astype(np.int32)
    expert_of[0, -1] = -1
    weight = rng.random((n_tok, top_k)).astype(np.float32)
    want = _reference(type_, experts, dim, ffn, x, expert_of, weight, limit)
    unclamped = _reference(type_, experts, dim, ffn, x, expert_of, weight, 1e9)
    assert np.abs(want - unclamped).max() > 0.05 * np.abs(want).max()  # the clamp bites
    mats, biases = zip(*experts)
    for level in native.supported_kernels():
        kernel_level(level)
        results = []
        for n in (1, 2, 3):
            out = np.full((n_tok, dim), 0.5, np.float32)
            native.moe_experts(type_, *zip(*mats), dim, ffn, x, expert_of, weight, out, pool=pools[n], biases=biases,
                               activation="clamped_swiglu", alpha=ALPHA, limit=limit)
            results.append(out - np.float32(0.5))
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0], err_msg=level)
        quantized_activations = level != "portable" and type_ in QUANT_TYPES
        bound = 4e-2 if quantized_activations else 1e-4
        assert np.abs(results[0] - want).max() <= bound * np.abs(want).max() + 1e-6, level


def test_plain_swiglu_without_biases_is_col_moe_experts(kernel_level):
    """col_moe_experts_ffn with SwiGLU and no biases computes what col_moe_experts does, bit for bit."""
    experts = _experts(TensorType.Q8_0, 3, 64, 64, 70)
    mats = [m for m, _ in experts]
    x = gaussian((4, 64), 71)
    expert_of = np.array([[0, 1], [2, 0], [1, 2], [0, -1]], np.int32)
    weight = np.random.default_rng(0).random((4, 2)).astype(np.float32)
    for level in native.supported_kernels():
        kernel_level(level)
        plain, via_ffn = np.zeros((4, 64), np.float32), np.zeros((4, 64), np.float32)
        native.moe_experts(TensorType.Q8_0, *zip(*mats), 64, 64, x, expert_of, weight, plain)
        buffers = [native.ExpertBuffers(TensorType.Q8_0, *m, 64, 64) for m in mats]
        kind = native.ExpertFfn(activation=0)
        ptrs = (native.ctypes.c_void_p * 9)(*[getattr(b, f) for f in ("gate", "up", "down") for b in buffers])
        base, size = native.ctypes.addressof(ptrs), native.ctypes.sizeof(native.ctypes.c_void_p) * 3
        status = native._lib().col_moe_experts_ffn(None, native.ctypes.addressof(kind), int(TensorType.Q8_0), 3, base,
                                                   base + size, base + 2 * size, 64, 64, x.ctypes.data, 4,
                                                   expert_of.ctypes.data, weight.ctypes.data, 2, via_ffn.ctypes.data)
        assert status == 0
        np.testing.assert_array_equal(via_ffn, plain, err_msg=level)


def test_experts_refuse_a_bad_activation_or_partial_biases():
    experts = _experts(TensorType.Q8_0, 2, 64, 64, 80)
    mats, biases = zip(*experts)
    x, out = gaussian((1, 64), 81), np.zeros((1, 64), np.float32)
    route = np.array([[0, 1]], np.int32), np.ones((1, 2), np.float32)
    with pytest.raises(native.InvalidArgumentError):  # some experts with biases, some without
        native.moe_experts(TensorType.Q8_0, *zip(*mats), 64, 64, x, *route, out, biases=[biases[0], None])
    with pytest.raises(native.InvalidArgumentError):
        native.moe_experts(TensorType.Q8_0, *zip(*mats), 64, 64, x, *route, out, activation="gelu")
    with pytest.raises(native.InvalidArgumentError):  # a clamp must be > 0: refused by libcolibri
        native.moe_experts(TensorType.Q8_0, *zip(*mats), 64, 64, x, *route, out, activation="clamped_swiglu", limit=0.0)
    with pytest.raises(native.InvalidArgumentError):  # a bias of the wrong length
        native.moe_experts(TensorType.Q8_0, *zip(*mats), 64, 64, x, *route, out,
                           biases=[(b[0][:-1], b[1], b[2]) for b in biases])
    assert not out.any()  # nothing was written


def test_expert_ffn_struct_matches_c():
    assert native.ctypes.sizeof(native.ExpertFfn) == native._lib().col_expert_ffn_size()

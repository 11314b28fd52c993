"""col_deltanet_block, the one-call Gated DeltaNet step (Qwen3.5-MoE / Qwen3-Next linear
attention), against two oracles:

- transformers itself: Qwen3_5MoeGatedDeltaNet (a fresh prompt through the module), and for
  carried states the module's own pieces (causal_conv1d_fn, torch_recurrent_gated_delta_rule,
  torch_chunk_gated_delta_rule, Qwen3_5MoeRMSNormGated) fed the same projections;
- `reference`, a float64 numpy transcription of the whole layer step, token by token, with
  the conv state and the recurrent state in and out.

Tolerances, relative to the largest |value| compared: float32 weights on any level 1e-4
(the chunked form sums in another order than the recurrence, and SIMD levels fuse
multiply-adds). q8_0 / q4_g64 weights on SIMD levels quantize the activations of the input
and output products to int8, as every integer kernel does: against the reference that does
the same (`int8_activations`): states within 1e-3, outputs within 1e-2 (an activation on a
rounding boundary may round the other way, which moves its product by one step, max|block| /
127, times a weight); against the plain reference within 6e-2 (the rounding of every token's
input feeds the state, and the gated RMSNorm rescales each head's output). The thread count
never changes a bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

D, HK, HV, DK, DV, KC = 128, 2, 4, 32, 32, 4
EPS, NORM_EPS = 1e-6, 1e-6
FLOAT_TOL, INT8_TOL = 1e-4, 6e-2
INT8_SIM_STATE_TOL, INT8_SIM_OUT_TOL = 1e-3, 1e-2  # against int8_activations


def _gauss(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


class Layer:
    """Random weights of one layer: the native layer, and float64 copies of what it computes with."""

    def __init__(self, type_=TensorType.F32, seed=0, hk=HK, hv=HV, dk=DK, dv=DV, kc=KC, conv_bias=False):
        self.hk, self.hv, self.dk, self.dv, self.kc = hk, hv, dk, dv, kc
        self.C, self.Z = 2 * hk * dk + hv * dv, hv * dv
        shapes = {"qkv": (self.C, D), "z": (self.Z, D), "b": (hv, D), "a": (hv, D), "o": (D, self.Z)}
        self.packed, self.f64 = {}, {}
        for i, (name, (rows, cols)) in enumerate(shapes.items()):
            w = _gauss((rows, cols), seed + i, 1.0 / np.sqrt(cols))
            self.packed[name] = (type_, native.quantize(type_, w))
            self.f64[name] = native.dequantize(type_, self.packed[name][1], rows, cols).astype(np.float64)
        rng = np.random.default_rng(seed + 10)
        self.vectors = {
            "conv": _gauss((self.C, kc), seed + 11, 0.5),
            # decays from mild to strong (A up to 8): states that carry across chunks, and heads
            # whose exp(cumulative decay) underflows inside a chunk
            "A_log": np.log(np.linspace(0.02, 8.0, hv)).astype(np.float32)[rng.permutation(hv)],
            "dt_bias": _gauss((hv,), seed + 12, 0.5),
            "norm": (1 + 0.2 * _gauss((dv,), seed + 13)).astype(np.float32),
        }
        if conv_bias:
            self.vectors["conv_bias"] = _gauss((self.C,), seed + 14, 0.2)
        self.input_norm = (1 + 0.2 * _gauss((D,), seed + 15)).astype(np.float32)
        self.native = native.deltanet_layer(D, hk, hv, dk, dv, kc, self.input_norm, {**self.packed, **self.vectors},
                                            eps=EPS, norm_eps=NORM_EPS)

    def new_states(self):
        return np.zeros((self.kc - 1, self.C), np.float32), np.zeros((self.hv, self.dk, self.dv), np.float32)

    def run(self, x, conv_state, state, pool=None):
        """The native step on a copy of x; the states are updated in place."""
        out = x.copy()
        native.deltanet_block(self.native, out, conv_state, state, pool=pool)
        return out


def _rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def _silu(v):
    return v / (1 + np.exp(-v))


def int8_activations(type_: TensorType):
    """What a SIMD level does to the activations of a product with `type_` weights: blocks of
    the weight's block size (64 for q4_g64, else 32) rounded to int8 steps of max|block| / 127
    (half to even), in float32. None for float weights (no rounding)."""
    if type_ is TensorType.F32:
        return None
    block = 64 if type_ is TensorType.Q4_G64 else 32

    def rounded(v):
        b = np.asarray(v, np.float32).reshape(-1, block)
        amax = np.abs(b).max(1, keepdims=True)
        inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.clip(np.round(b * inverse), -127, 127)
        return (q * (amax / np.float32(127))).reshape(np.shape(v)).astype(np.float64)

    return rounded


def reference(layer: Layer, x, conv_state, state, activations=None):
    """(x + the layer's output, new conv state, new recurrent state), float64, the recurrence
    token by token as torch_recurrent_gated_delta_rule writes it. `activations` (see
    int8_activations), if given, rounds the inputs of the input and output products."""
    L, f = layer, layer.f64
    T, hk, hv, dk, dv = x.shape[0], L.hk, L.hv, L.dk, L.dv
    rounded = activations or (lambda v: v)
    h = rounded(_rms(x.astype(np.float64), L.input_norm.astype(np.float64), EPS))
    qkv, z, b, a = h @ f["qkv"].T, h @ f["z"].T, h @ f["b"].T, h @ f["a"].T
    inputs = np.concatenate([conv_state.astype(np.float64), qkv])  # (Kc - 1 + T, C)
    conv = L.vectors["conv"].astype(np.float64)
    mixed = sum(conv[:, i] * inputs[i:i + T] for i in range(L.kc)) + L.vectors.get("conv_bias", 0.0)
    mixed = _silu(mixed)
    q = mixed[:, :hk * dk].reshape(T, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].reshape(T, hk, dk)
    v = mixed[:, 2 * hk * dk:].reshape(T, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(L.vectors["A_log"].astype(np.float64)) * np.logaddexp(0, a + L.vectors["dt_bias"])
    S = state.astype(np.float64).copy()
    o = np.zeros((T, hv, dv))
    for t in range(T):
        for head in range(hv):
            kh = head // (hv // hk)  # repeat_interleave: consecutive value heads share a key head
            S[head] *= np.exp(g[t, head])
            delta = (v[t, head] - k[t, kh] @ S[head]) * beta[t, head]
            S[head] += np.outer(k[t, kh], delta)
            o[t, head] = q[t, kh] @ S[head]
    o = _rms(o, L.vectors["norm"].astype(np.float64), NORM_EPS) * _silu(z.reshape(T, hv, dv))
    new_conv = inputs[inputs.shape[0] - (L.kc - 1):] if L.kc > 1 else inputs[:0]
    return x + rounded(o.reshape(T, L.Z)) @ f["o"].T, new_conv, S


def transformers_layer(layer: Layer, x, rule: str, conv_state=None, state=None):
    """(x + output, final recurrent state) by transformers' own functions in float32, the
    steps of Qwen3_5MoeGatedDeltaNet.forward; `rule` "chunk" or "recurrent"; a conv state is
    prepended to the conv's input as the module's cache does."""
    torch = pytest.importorskip("torch")
    M = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    L = layer
    T = x.shape[0]
    t32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    xt = t32(x)
    h = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + EPS) * t32(L.input_norm)
    w = {name: t32(value) for name, value in L.f64.items()}
    mixed = (h @ w["qkv"].T).T[None]  # (1, C, T)
    if conv_state is not None:
        mixed = torch.cat([t32(conv_state).T[None], mixed], dim=-1)
    bias = t32(L.vectors["conv_bias"]) if "conv_bias" in L.vectors else None
    mixed = M.causal_conv1d_fn(mixed, t32(L.vectors["conv"]), bias, activation="silu")[:, :, -T:]
    mixed = mixed.transpose(1, 2)
    q, k, v = torch.split(mixed, [L.hk * L.dk, L.hk * L.dk, L.Z], dim=-1)
    q, k, v = q.reshape(1, T, L.hk, L.dk), k.reshape(1, T, L.hk, L.dk), v.reshape(1, T, L.hv, L.dv)
    beta = (h @ w["b"].T)[None].sigmoid()
    g = -t32(L.vectors["A_log"]).exp() * torch.nn.functional.softplus((h @ w["a"].T)[None] + t32(L.vectors["dt_bias"]))
    fn = M.torch_chunk_gated_delta_rule if rule == "chunk" else M.torch_recurrent_gated_delta_rule
    initial = None if state is None else t32(state)[None]
    core, final = fn(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    norm = M.Qwen3_5MoeRMSNormGated(L.dv, eps=NORM_EPS)
    with torch.no_grad():
        norm.weight.copy_(t32(L.vectors["norm"]))
        gated = norm(core.reshape(-1, L.dv), (h @ w["z"].T).reshape(-1, L.dv)).reshape(T, L.Z)
    return (xt + gated @ w["o"].T).numpy(), final[0].numpy()


def _assert_close(got, want, tol, what):
    scale = np.abs(want).max()
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _assert_step_close(got, want, x, tol, what):
    """The layer's contribution (out - x) within tol of the reference's."""
    _assert_close(np.asarray(got, np.float64) - x, np.asarray(want, np.float64) - x, tol, what)


def _integer(level, type_):
    """Whether products with `type_` weights quantize their activations on `level`."""
    return level != "portable" and type_ is not TensorType.F32


def _tol(level, type_):
    return INT8_TOL if _integer(level, type_) else FLOAT_TOL


def _assert_matches_reference(layer, type_, level, x, start, got, conv_state, state, what):
    """The native results of a run from `start` (conv state, recurrent state) against the
    reference; on integer levels also against the reference with int8 activations."""
    want, want_conv, want_state = reference(layer, x, *start)
    tol = _tol(level, type_)
    _assert_step_close(got, want, x, tol, what)
    _assert_close(state, want_state, tol, f"{what}: recurrent state")
    _assert_close(conv_state, want_conv, tol, f"{what}: conv state")
    if _integer(level, type_):
        want, want_conv, want_state = reference(layer, x, *start, activations=int8_activations(type_))
        _assert_step_close(got, want, x, INT8_SIM_OUT_TOL, f"{what}, int8 activations")
        _assert_close(state, want_state, INT8_SIM_STATE_TOL, f"{what}, int8 activations: recurrent state")
        _assert_close(conv_state, want_conv, INT8_SIM_STATE_TOL, f"{what}, int8 activations: conv state")


def test_deltanet_layer_struct_matches_c():
    assert native.ctypes.sizeof(native.DeltaNetLayer) == native._lib().col_deltanet_layer_size()


def test_the_transformers_oracle_is_the_module():
    """transformers_layer (chunk rule) is what Qwen3_5MoeGatedDeltaNet.forward computes."""
    torch = pytest.importorskip("torch")
    M = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    layer = Layer(seed=1)
    config = Qwen3_5MoeTextConfig(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
                                  linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KC,
                                  rms_norm_eps=NORM_EPS, num_hidden_layers=1, layer_types=["linear_attention"])
    module = M.Qwen3_5MoeGatedDeltaNet(config, 0).eval()
    t32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    with torch.no_grad():
        for name, proj in (("qkv", module.in_proj_qkv), ("z", module.in_proj_z), ("b", module.in_proj_b),
                           ("a", module.in_proj_a), ("o", module.out_proj)):
            proj.weight.copy_(t32(layer.f64[name]))
        module.conv1d.weight.copy_(t32(layer.vectors["conv"])[:, None, :])
        module.A_log.copy_(t32(layer.vectors["A_log"]))
        module.dt_bias.copy_(t32(layer.vectors["dt_bias"]))
        module.norm.weight.copy_(t32(layer.vectors["norm"]))
        x = _gauss((150, D), 30)
        xt = t32(x)
        h = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + EPS) * t32(layer.input_norm)
        want = (xt + module(h[None])[0]).numpy()
    got, _ = transformers_layer(layer, x, "chunk")
    _assert_step_close(got, want, x, 1e-6, "helper vs module")


def test_decode_steps_equal_the_recurrent_rule(kernel_level):
    """(a) T = 1 calls, one after the other from zero states, against transformers' recurrent
    rule over the same tokens; the final states too."""
    layer = Layer(seed=2)
    x = _gauss((20, D), 31)
    want, want_state = transformers_layer(layer, x, "recurrent")
    want_ref, want_conv, want_state_ref = reference(layer, x, *layer.new_states())
    _assert_step_close(want, want_ref, x, FLOAT_TOL, "transformers vs numpy reference")
    for level in native.supported_kernels():
        kernel_level(level)
        conv_state, state = layer.new_states()
        got = np.concatenate([layer.run(x[t:t + 1], conv_state, state) for t in range(len(x))])
        _assert_step_close(got, want, x, FLOAT_TOL, level)
        _assert_close(state, want_state, FLOAT_TOL, f"{level} recurrent state")
        _assert_close(conv_state, want_conv, FLOAT_TOL, f"{level} conv state")


def test_a_prefill_equals_the_chunked_rule_and_token_by_token_decode(kernel_level):
    """(b) 150 tokens (two full chunks of 64 and one of 22) in one call: transformers' chunked
    rule, and the same tokens one call each (chunked prefill == recurrent decode)."""
    layer = Layer(seed=3)
    x = _gauss((150, D), 32)
    want, want_state = transformers_layer(layer, x, "chunk")
    for level in native.supported_kernels():
        kernel_level(level)
        conv_state, state = layer.new_states()
        got = layer.run(x, conv_state, state)
        _assert_step_close(got, want, x, FLOAT_TOL, f"{level} prefill vs transformers")
        _assert_close(state, want_state, FLOAT_TOL, f"{level} state vs transformers")
        conv_steps, state_steps = layer.new_states()
        steps = np.concatenate([layer.run(x[t:t + 1], conv_steps, state_steps) for t in range(len(x))])
        _assert_step_close(got, steps, x, FLOAT_TOL, f"{level} prefill vs decode")
        _assert_close(state, state_steps, FLOAT_TOL, f"{level} state: prefill vs decode")
        np.testing.assert_array_equal(conv_state, conv_steps)  # the same projections, stored


@pytest.mark.parametrize("split", [(100, 50), (64, 86), (1, 149), (149, 1), (2, 148)])
def test_a_prefill_in_two_calls_equals_one(split):
    """(c) the states carry a prompt across calls: two calls == one call == the reference."""
    layer = Layer(seed=4)
    x = _gauss((sum(split), D), 33)
    want, want_conv, want_state = reference(layer, x, *layer.new_states())
    conv_one, state_one = layer.new_states()
    one = layer.run(x, conv_one, state_one)
    conv_two, state_two = layer.new_states()
    two = np.concatenate([layer.run(x[:split[0]], conv_two, state_two), layer.run(x[split[0]:], conv_two, state_two)])
    for got, conv, state, what in ((one, conv_one, state_one, "one call"), (two, conv_two, state_two, "two calls")):
        _assert_step_close(got, want, x, FLOAT_TOL, what)
        _assert_close(state, want_state, FLOAT_TOL, f"{what}: recurrent state")
        _assert_close(conv, want_conv, FLOAT_TOL, f"{what}: conv state")
    _assert_step_close(two, one, x, FLOAT_TOL, "two calls vs one")


def test_the_conv_state_is_carried_across_calls():
    """(d) calls shorter than the conv's Kc - 1 = 3 rows of history (the state shifts), then a
    prompt, then decode; and a sequence that starts from a non-zero state. A state that were
    ignored, or kept in the wrong order, would change every first token of a call."""
    layer = Layer(seed=5, conv_bias=True)
    x = _gauss((12, D), 34)
    conv_state, state = layer.new_states()
    conv_state[:] = _gauss(conv_state.shape, 35)  # a history before this sequence's first token
    start_conv = conv_state.copy()
    want, want_conv, want_state = reference(layer, x, start_conv, state)
    parts, t = [], 0
    for n in (2, 1, 1, 5, 1, 2):
        parts.append(layer.run(x[t:t + n], conv_state, state))
        _, want_part_conv, _ = reference(layer, x[:t + n], start_conv, np.zeros_like(state))
        _assert_close(conv_state, want_part_conv, FLOAT_TOL, f"conv state after {t + n} tokens")
        t += n
    got = np.concatenate(parts)
    _assert_step_close(got, want, x, FLOAT_TOL, "outputs")
    _assert_close(state, want_state, FLOAT_TOL, "recurrent state")
    # the oracle with the same history: transformers' conv over [state; inputs]
    want_hf, _ = transformers_layer(layer, x, "recurrent", conv_state=start_conv)
    _assert_step_close(got, want_hf, x, FLOAT_TOL, "outputs vs transformers")


@pytest.mark.parametrize("hk, hv", [(1, 1), (2, 2), (2, 4), (1, 3), (2, 6)])
def test_value_heads_share_key_heads_as_transformers_maps_them(hk, hv):
    """(e) Hv / Hk consecutive value heads read one q/k head (repeat_interleave), in the
    chunked and the recurrent form, against transformers and the reference."""
    layer = Layer(seed=6, hk=hk, hv=hv, dk=32, dv=32)
    x = _gauss((70, D), 36)
    want, want_state = transformers_layer(layer, x, "chunk")
    conv_state, state = layer.new_states()
    got = layer.run(x[:67], conv_state, state)
    got = np.concatenate([got] + [layer.run(x[t:t + 1], conv_state, state) for t in range(67, 70)])
    _assert_step_close(got, want, x, FLOAT_TOL, "outputs")
    _assert_close(state, want_state, FLOAT_TOL, "state")
    want_ref, _, _ = reference(layer, x, *layer.new_states())
    _assert_step_close(got, want_ref, x, FLOAT_TOL, "outputs vs reference")


@pytest.mark.parametrize("T", [1, 3, 150])
def test_every_level_and_thread_count(T, kernel_level, pools):
    """(f) 1, 2 and 3 threads give the same bits on every level; the levels agree within
    float tolerance (q8_0 weights: within the int8-activation tolerance of portable)."""
    for type_ in (TensorType.F32, TensorType.Q8_0):
        layer = Layer(type_, seed=7)
        x = _gauss((T, D), 37)
        start_conv = _gauss((KC - 1, layer.C), 38)
        start_state = _gauss((HV, DK, DV), 39, 0.3)
        by_level = {}
        for level in native.supported_kernels():
            kernel_level(level)
            results = []
            for n in (1, 2, 3):
                conv_state, state = start_conv.copy(), start_state.copy()
                results.append((layer.run(x, conv_state, state, pool=pools[n]), conv_state, state))
            for got in results[1:]:
                for a, b in zip(got, results[0]):
                    np.testing.assert_array_equal(a, b, err_msg=f"{level} {type_.name_in_pack} T={T}")
            by_level[level] = results[0]
        for level, (got, conv_state, state) in by_level.items():
            _assert_matches_reference(layer, type_, level, x, (start_conv, start_state), got, conv_state, state,
                                      f"{level} {type_.name_in_pack} T={T}")
            _assert_step_close(got, by_level["portable"][0], x, _tol(level, type_), f"{level} vs portable")


@pytest.mark.parametrize("type_", [TensorType.F32, TensorType.Q8_0, TensorType.Q4_G64], ids=lambda t: t.name_in_pack)
def test_weight_types(type_, kernel_level):
    """(g) f32, q8_0 and q4_g64 weights, prefill and decode, against the reference computed
    with the dequantized weights."""
    layer = Layer(type_, seed=8)
    x = _gauss((80, D), 40)
    for level in native.supported_kernels():
        kernel_level(level)
        conv_state, state = layer.new_states()
        got = np.concatenate([layer.run(x[:77], conv_state, state)] + [layer.run(x[t:t + 1], conv_state, state)
                                                                       for t in range(77, 80)])
        _assert_matches_reference(layer, type_, level, x, layer.new_states(), got, conv_state, state,
                                  f"{level} {type_.name_in_pack}")


def test_bad_shapes_raise_value_error():
    """(h) every size is checked before C runs."""
    layer = Layer(seed=9)
    weights = {**layer.packed, **layer.vectors}

    def build(**changes):
        args = dict(dim=D, n_k_heads=HK, n_v_heads=HV, k_head_dim=DK, v_head_dim=DV, conv_kernel=KC,
                    input_norm=layer.input_norm, weights=weights, eps=EPS, norm_eps=NORM_EPS)
        args.update(changes)
        return native.deltanet_layer(**args)

    bad_layers = [
        dict(n_v_heads=3),                                                     # not a multiple of Hk
        dict(k_head_dim=16),                                                   # qkv's rows no longer match
        dict(conv_kernel=0),
        dict(input_norm=layer.input_norm[:-1]),
        dict(weights={k: v for k, v in weights.items() if k != "A_log"}),      # missing
        dict(weights={**weights, "qkv": (TensorType.F32, layer.packed["qkv"][1][:-1])}),
        dict(weights={**weights, "z": (TensorType.Q8_0, native.quantize("q8_0", layer.f64["z"].astype(np.float32)))}),
        dict(weights={**weights, "conv": layer.vectors["conv"][:, :3].copy()}),
        dict(weights={**weights, "conv": layer.vectors["conv"].astype(np.float64)}),
        dict(weights={**weights, "norm": np.ones(DV + 1, np.float32)}),
        dict(weights={**weights, "dt_bias": np.ones(HV - 1, np.float32)}),
        dict(weights={**weights, "conv_bias": np.ones(layer.C - 1, np.float32)}),
    ]
    for changes in bad_layers:
        with pytest.raises(ValueError):
            build(**changes)
    conv_state, state = layer.new_states()
    x = _gauss((3, D), 41)
    bad_calls = [
        (x[:, :-1].copy(), conv_state, state),
        (x.astype(np.float64), conv_state, state),
        (x[0], conv_state, state),
        (x, conv_state[:-1].copy(), state),
        (x, conv_state, state[:-1].copy()),
        (x, conv_state, state.reshape(HV, DV, DK)[:, :, :-1].copy()),
        (x, conv_state.astype(np.float64), state),
        (x, conv_state, np.swapaxes(state, 1, 2)),  # the right shape, not C-contiguous
    ]
    for args in bad_calls:
        with pytest.raises(ValueError):
            native.deltanet_block(layer.native, *args)
    with pytest.raises(ValueError):
        native.deltanet_block(object(), x, conv_state, state)
    np.testing.assert_array_equal(state, 0)  # nothing was written by the refused calls
    np.testing.assert_array_equal(conv_state, 0)

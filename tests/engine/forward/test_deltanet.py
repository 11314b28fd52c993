"""The Gated DeltaNet step (colibrid/engine/forward/deltanet.py) is transformers' Qwen3_5MoeGatedDeltaNet:
chunked for a prompt longer than one chunk, token by token after it, with more value heads
than key heads; prefill in chunks then decode equals one long prefill; the state a sequence
keeps is the same size however long the sequence."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibrid import native  # noqa: E402
from colibrid.engine.forward.deltanet import CHUNK, DeltaNet, DeltaNetState, chunked_delta_rule, recurrent_delta_rule  # noqa: E402
from colibrid.models.model_config import DeltaNetConfig, ModelConfig, RopeConfig  # noqa: E402
from colibrid.pack.tensor import PackedTensor  # noqa: E402

D, HK, HV, DK, DV, KC = 64, 2, 4, 16, 8, 4
EPS = 1e-6


def _config() -> ModelConfig:
    return ModelConfig(architecture="test", vocab_size=10, hidden_size=D, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=16, rms_norm_eps=EPS, max_position_embeddings=1024, rope=RopeConfig(),
                       tie_word_embeddings=False, sliding_window=(None,), moe_layers=(False,), dense_ffn=64,
                       layer_mixers=("deltanet",), deltanet=DeltaNetConfig(HK, HV, DK, DV, KC))


def _text_config():
    return transformers.Qwen3_5MoeTextConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, linear_num_key_heads=HK,
                                             linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                                             linear_conv_kernel_dim=KC, rms_norm_eps=EPS, layer_types=["linear_attention"])


def _reference_module():
    module = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet(_text_config(), 0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name == "norm.weight" else 0.3 * noise if p.ndim > 1 else 0.5 * noise)
    return module


def _mixer(module) -> DeltaNet:
    f32 = lambda t: PackedTensor(native.TensorType.F32, tuple(t.shape), t.detach().numpy().astype(np.float32))  # noqa: E731
    m = module
    weights = {"qkv": f32(m.in_proj_qkv.weight), "z": f32(m.in_proj_z.weight), "b": f32(m.in_proj_b.weight),
               "a": f32(m.in_proj_a.weight), "conv": f32(m.conv1d.weight[:, 0, :]), "A_log": f32(m.A_log),
               "dt_bias": f32(m.dt_bias), "norm": f32(m.norm.weight), "o": f32(m.out_proj.weight)}
    ones = PackedTensor(native.TensorType.F32, (D,), np.ones(D, np.float32))
    mixer = DeltaNet(_config(), 0, weights, ones)
    mixer.fused = None  # the numpy reference
    return mixer


def _inputs(tokens: int) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((tokens, D)).astype(np.float32)


def test_prefill_longer_than_a_chunk_matches_transformers():
    module = _reference_module()
    mixer = _mixer(module)
    h = _inputs(CHUNK + 37)
    with torch.no_grad():
        expected = module(torch.from_numpy(h)[None])[0].numpy()
    actual = mixer(h, mixer.new_state(4096, 512))
    assert np.abs(actual - expected).max() <= 1e-5 * np.abs(expected).max()


def test_decode_after_prefill_matches_transformers_with_its_cache():
    """transformers' own cache: chunked prefill, then its recurrent single-token step."""
    module = _reference_module()
    mixer = _mixer(module)
    h = _inputs(CHUNK + 13)
    prompt, rest = h[:CHUNK + 5], h[CHUNK + 5:]
    cache = transformers.DynamicCache(config=_text_config())
    state = mixer.new_state(4096, 512)
    with torch.no_grad():
        expected = [module(torch.from_numpy(prompt)[None], cache=cache)[0].numpy()]
        expected += [module(torch.from_numpy(row)[None, None], cache=cache)[0].numpy() for row in rest]
    actual = [mixer(prompt, state)] + [mixer(row[None], state) for row in rest]
    for a, e in zip(actual, expected):
        assert np.abs(a - e).max() <= 1e-5 * np.abs(e).max()


@pytest.mark.parametrize("split", [1, CHUNK - 1, CHUNK, CHUNK + 1])
def test_chunked_prefill_equals_token_by_token_decode(split):
    """The same tokens as one prefill, or a prefill of ``split`` tokens and then one token at a
    time: the outputs and the final states agree to float32 rounding."""
    mixer = _mixer(_reference_module())
    h = _inputs(CHUNK + 20)
    whole_state, stepped_state = mixer.new_state(4096, 512), mixer.new_state(4096, 512)
    whole = mixer(h, whole_state)
    stepped = [mixer(h[:split], stepped_state)] + [mixer(h[t : t + 1], stepped_state) for t in range(split, len(h))]
    stepped = np.concatenate(stepped)
    assert np.abs(stepped - whole).max() <= 1e-5 * np.abs(whole).max()
    assert np.abs(stepped_state.recurrent - whole_state.recurrent).max() <= 1e-5 * np.abs(whole_state.recurrent).max()
    np.testing.assert_array_equal(stepped_state.conv, whole_state.conv)  # the last inputs, copied


def test_chunked_and_recurrent_forms_agree_from_a_nonzero_state():
    rng = np.random.default_rng(5)
    T = 2 * CHUNK + 9
    q, k = (rng.standard_normal((T, HV, DK)).astype(np.float32) * 0.3 for _ in range(2))
    v = rng.standard_normal((T, HV, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (T, HV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, HV)).astype(np.float32)
    start = rng.standard_normal((HV, DK, DV)).astype(np.float32)
    s1, s2 = start.copy(), start.copy()
    chunked, recurrent = chunked_delta_rule(q, k, v, g, beta, s1), recurrent_delta_rule(q, k, v, g, beta, s2)
    assert np.abs(chunked - recurrent).max() <= 1e-4 * np.abs(recurrent).max()
    assert np.abs(s1 - s2).max() <= 1e-4 * np.abs(s2).max()


def test_state_is_fixed_size():
    c = _config()
    small, large = DeltaNetState(c.deltanet), _mixer(_reference_module()).new_state(1 << 20, 512)
    assert small.nbytes == large.nbytes == 4 * ((KC - 1) * (2 * HK * DK + HV * DV) + HV * DK * DV)


@pytest.mark.skipif(not hasattr(native, "deltanet_block"), reason="libcolibri without col_deltanet_block")
@pytest.mark.parametrize("type_", [native.TensorType.F32, native.TensorType.Q8_0])
def test_the_fused_step_gives_the_numpy_reference(type_):
    """The mixer's libcolibri step (what the engine runs) and its numpy reference, on the same
    packed weights: a prompt longer than a chunk, then decode steps, states carried along."""
    module = _reference_module()
    reference = _mixer(module)
    if type_ is not native.TensorType.F32:
        for name in ("qkv", "z", "b", "a", "o"):
            t = reference.w[name]
            reference.w[name] = PackedTensor(type_, t.shape, native.quantize(type_, t.data))
    fused = DeltaNet(reference.c, 0, reference.w, reference.input_norm)
    assert fused.fused is not None
    x = _inputs(CHUNK + 9)
    states = fused.new_state(4096, 512), reference.new_state(4096, 512)
    for step in (x[:CHUNK + 3], *(x[t : t + 1] for t in range(CHUNK + 3, len(x)))):
        got = fused.residual(step.copy(), None, None, None, states[0], 0)
        want = reference.residual(step.copy(), None, None, None, states[1], 0)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(states[0].recurrent - states[1].recurrent).max() <= 1e-5 * np.abs(states[1].recurrent).max()
    np.testing.assert_allclose(states[0].conv, states[1].conv, rtol=0, atol=1e-6 * np.abs(states[1].conv).max())

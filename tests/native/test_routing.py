"""libcolibri's MoE routing (col_moe_router_route) against a plain numpy reference of each
mode, on every kernel level and thread count, and against transformers' own router modules.

Modes: softmax top-k (Mixtral, Qwen, OLMoE; DeepSeek-V2 "greedy"), softmax with groups scored
by their best expert (DeepSeek-V2 "group_limited_greedy"), sigmoid with a choice-only bias
and groups scored by their best two (DeepSeek-V3, GLM-4.5), each with and without
renormalisation and with a scaling factor.

The reference works in float64 on the very logits the C call sees: an identity router over
x = logits makes every dot product exact (the other terms are zeros), whatever the level;
quantized routers take their logits from native.matmul on the same level.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

# (scoring, biased, n_groups, groups_kept, group_score): each family's routing
MODES = {
    "softmax": ("softmax", False, 1, 1, "max"),
    "softmax-groups-max": ("softmax", False, 4, 2, "max"),
    "sigmoid": ("sigmoid", True, 1, 1, "top2_sum"),
    "sigmoid-groups-top2": ("sigmoid", True, 4, 2, "top2_sum"),
    "sigmoid-unbiased-groups": ("sigmoid", False, 8, 3, "top2_sum"),
}
E, TOP_K = 32, 4


def reference_scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    z = logits.astype(np.float64)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def reference_group_scores(choice: np.ndarray, n_groups: int, group_score: str) -> np.ndarray:
    grouped = -np.sort(-choice.reshape(choice.shape[0], n_groups, -1), axis=2)  # (T, G, E/G) best first
    return grouped[:, :, 0] if group_score == "max" else grouped[:, :, 0] + grouped[:, :, 1]


def reference_route(logits, top_k, scoring, bias, n_groups, groups_kept, group_score, normalize, scaling):
    """The routing as transformers writes it, with ties broken toward the lower index."""
    scores = reference_scores(logits, scoring)  # (T, E)
    choice = scores + (bias if bias is not None else 0.0)
    if groups_kept < n_groups:
        groups = reference_group_scores(choice, n_groups, group_score)  # (T, G)
        kept = np.argsort(-groups, axis=1, kind="stable")[:, :groups_kept]
        allowed = np.zeros_like(groups, dtype=bool)
        np.put_along_axis(allowed, kept, True, axis=1)
        choice = np.where(np.repeat(allowed, logits.shape[1] // n_groups, axis=1), choice, -np.inf)
    experts = np.argsort(-choice, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, experts, axis=1)
    if normalize:
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return experts, weights * scaling


def _router(data, type_, dim, mode, bias, normalize, scaling, top_k=TOP_K):
    scoring, _, n_groups, kept, group_score = MODES[mode]
    return native.moe_router(type_, data, E, dim, top_k, normalize=normalize, scoring=scoring, choice_bias=bias,
                             n_groups=n_groups, groups_kept=kept, group_score=group_score, scaling=scaling)


def _check(router, x, logits, mode, bias, normalize, scaling, pools, top_k=TOP_K):
    scoring, _, n_groups, kept, group_score = MODES[mode]
    want_experts, want_weights = reference_route(logits, top_k, scoring, bias, n_groups, kept, group_score, normalize, scaling)
    for n, pool in pools.items():
        experts, weights = native.moe_router_route(router, x, pool=pool)
        np.testing.assert_array_equal(experts, want_experts, err_msg=f"{mode}, {native.kernels()}, {n} threads")
        np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("normalize, scaling", [(False, 1.0), (True, 1.0), (True, 2.5), (False, 16.0)])
def test_route_matches_numpy_on_random_logits(mode, normalize, scaling, kernel_level, pools):
    rng = np.random.default_rng(len(mode) * 7 + int(scaling))
    logits = rng.standard_normal((64, E)).astype(np.float32) * 2
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32) if MODES[mode][1] else None
    router = _router(np.eye(E, dtype=np.float32), TensorType.F32, E, mode, bias, normalize, scaling)
    for level in native.supported_kernels():
        kernel_level(level)
        _check(router, logits, logits, mode, bias, normalize, scaling, pools)


def _distinct_values_are_apart(values: np.ndarray, gap: float) -> bool:
    """Within each token's row, values that differ differ by more than ``gap`` x the row's largest."""
    return all(np.all(np.diff(np.unique(row)) > gap * np.abs(row).max()) for row in values)


@pytest.mark.parametrize("mode", MODES)
def test_route_breaks_every_tie_toward_the_lower_index(mode, kernel_level, pools):
    """Logits from {0, 1, 3} and biases constant per group: many exact ties among experts and
    among groups, while values that differ differ by far more than float32 rounding (checked
    below), so the reference's choices are the only right ones."""
    rng = np.random.default_rng(5)
    scoring, biased, n_groups, _, group_score = MODES[mode]
    logits = rng.choice(np.array([0.0, 1.0, 3.0], np.float32), size=(48, E))
    bias = np.repeat(rng.choice([0.0, 0.0625], size=n_groups), E // n_groups).astype(np.float32) if biased else None
    choice = reference_scores(logits, scoring) + (bias if bias is not None else 0.0)
    assert _distinct_values_are_apart(choice, 1e-4)
    if n_groups > 1:
        assert _distinct_values_are_apart(reference_group_scores(choice, n_groups, group_score), 1e-4)
    router = _router(np.eye(E, dtype=np.float32), TensorType.F32, E, mode, bias, True, 1.0)
    for level in native.supported_kernels():
        kernel_level(level)
        _check(router, logits, logits, mode, bias, True, 1.0, pools)
    all_zero = np.zeros((2, E), np.float32)  # every expert and every group tied: the lowest ones win
    unbiased = _router(np.eye(E, dtype=np.float32), TensorType.F32, E, mode, None, True, 1.0)
    experts, _ = native.moe_router_route(unbiased, all_zero)
    np.testing.assert_array_equal(experts, [list(range(TOP_K))] * 2)


@pytest.mark.parametrize("type_", [TensorType.BF16, TensorType.Q8_0], ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("mode", ["softmax-groups-max", "sigmoid-groups-top2"])
def test_route_of_a_quantized_router_uses_its_matmul_logits(type_, mode, kernel_level, pools):
    dim = 64
    rng = np.random.default_rng(11)
    data = native.quantize(type_, (rng.standard_normal((E, dim)) * 0.3).astype(np.float32))
    x = rng.standard_normal((9, dim)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.2).astype(np.float32) if MODES[mode][1] else None
    router = _router(data, type_, dim, mode, bias, True, 2.0)
    for level in native.supported_kernels():
        kernel_level(level)
        logits = native.matmul(type_, data, E, dim, x)
        _check(router, x, logits, mode, bias, True, 2.0, pools)


def test_the_bias_chooses_but_does_not_weigh():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 5.0, 0.0], np.float32)
    router = native.moe_router(TensorType.F32, np.eye(4, dtype=np.float32), 4, 4, 2, normalize=False, scoring="sigmoid",
                               choice_bias=bias, scaling=3.0)
    experts, weights = native.moe_router_route(router, logits)
    np.testing.assert_array_equal(experts, [[2, 0]])  # expert 2 only through its bias
    sigmoid = 1.0 / (1.0 + np.exp(-logits[0, [2, 0]].astype(np.float64)))
    np.testing.assert_allclose(weights[0], 3.0 * sigmoid, rtol=1e-6)


def test_col_moe_route_is_the_softmax_router():
    rng = np.random.default_rng(2)
    data = (rng.standard_normal((E, 64)) * 0.3).astype(np.float32)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    for normalize in (False, True):
        router = native.moe_router(TensorType.F32, data, E, 64, TOP_K, normalize=normalize)
        old = native.moe_route(TensorType.F32, data, E, 64, x, TOP_K, normalize)
        new = native.moe_router_route(router, x)
        np.testing.assert_array_equal(old[0], new[0])
        np.testing.assert_array_equal(old[1], new[1])


def test_router_rejects_bad_arguments():
    eye = np.eye(E, dtype=np.float32)
    bad = [
        dict(n_groups=5),  # does not divide 32 experts
        dict(n_groups=4, groups_kept=5),
        dict(n_groups=4, groups_kept=1, top_k=9),  # one group of 8 cannot give 9 experts
        dict(n_groups=32, groups_kept=4, group_score="top2_sum"),  # groups of one expert have no second best
        dict(scoring="relu"),
        dict(scaling=float("inf")),
        dict(choice_bias=np.zeros(E - 1, np.float32)),
    ]
    for kwargs in bad:
        args = dict(normalize=True, top_k=TOP_K) | kwargs
        with pytest.raises(native.InvalidArgumentError):
            native.moe_router(TensorType.F32, eye, E, E, **args)
    router = native.moe_router(TensorType.F32, eye, E, E, TOP_K, normalize=True, n_groups=4, groups_kept=2)
    with pytest.raises(native.InvalidArgumentError):  # x of the wrong width
        native.moe_router_route(router, np.zeros((2, E + 1), np.float32))
    broken = native.MoeRouter.from_buffer_copy(router)
    broken.group_score = 7
    experts = np.full((1, TOP_K), -5, np.int32)
    x = np.zeros((1, E), np.float32)
    assert native._lib().col_moe_router_route(None, native.ctypes.addressof(broken), x.ctypes.data, 1, experts.ctypes.data,
                                              np.zeros((1, TOP_K), np.float32).ctypes.data) == 1
    assert (experts == -5).all()  # outputs untouched


# ---------------------------------------------------------------------------------------
# Against transformers' routers
# ---------------------------------------------------------------------------------------


def _torch_router(kind: str, n_groups: int, groups_kept: int, normalize: bool, scaling: float, seed: int):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, num_experts_per_tok=TOP_K, n_group=n_groups, topk_group=groups_kept,
                  routed_scaling_factor=scaling)
    if kind == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        module = Glm4MoeTopkRouter(transformers.Glm4MoeConfig(n_routed_experts=E, norm_topk_prob=normalize, **common))
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        method = "group_limited_greedy" if groups_kept < n_groups else "greedy"
        module = DeepseekV2TopkRouter(transformers.DeepseekV2Config(n_routed_experts=E, topk_method=method, **common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
    return torch, module


@pytest.mark.parametrize("kind, n_groups, groups_kept, normalize, scaling", [
    ("glm4_moe", 1, 1, True, 1.0),  # GLM-4.5-Air
    ("glm4_moe", 8, 4, True, 2.5),  # DeepSeek-V3's shape of groups
    ("glm4_moe", 4, 1, False, 1.0),
    ("deepseek_v2", 1, 1, False, 1.0),  # greedy
    ("deepseek_v2", 8, 3, False, 16.0),  # group_limited_greedy
])
def test_route_chooses_and_weighs_as_transformers(kind, n_groups, groups_kept, normalize, scaling):
    torch, module = _torch_router(kind, n_groups, groups_kept, normalize, scaling, seed=n_groups + groups_kept)
    x = torch.randn((40, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, want_weights, want_experts = module(x)
    bias = module.e_score_correction_bias.numpy() if hasattr(module, "e_score_correction_bias") else None
    router = native.moe_router(
        TensorType.F32, module.weight.detach().numpy(), E, 64, TOP_K, normalize=normalize if kind == "glm4_moe" else False,
        scoring="sigmoid" if kind == "glm4_moe" else "softmax", choice_bias=bias, n_groups=n_groups,
        groups_kept=groups_kept, group_score="top2_sum" if kind == "glm4_moe" else "max", scaling=scaling)
    experts, weights = native.moe_router_route(router, x.numpy())
    order = np.argsort(want_experts.numpy(), axis=1)  # transformers returns its top-k unsorted
    ours = np.argsort(experts, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(experts, ours, 1), np.take_along_axis(want_experts.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(weights, ours, 1), np.take_along_axis(want_weights.numpy(), order, 1),
                               rtol=1e-5, atol=1e-7)


def test_the_expert_scale_weighs_after_renormalising_as_gemma4(kernel_level, pools):
    """Gemma 4's router: softmax over all experts, top-k, renormalised, then each weight times
    its expert's learned scale (which never changes the choice); against transformers'
    Gemma4TextRouter on the same (normed, scaled) input, on every level and thread count."""
    import torch
    import transformers

    D = 64
    config = transformers.Gemma4TextConfig(hidden_size=D, num_experts=E, top_k_experts=TOP_K, rms_norm_eps=1e-6)
    module = transformers.models.gemma4.modeling_gemma4.Gemma4TextRouter(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        module.proj.weight.copy_(torch.randn(E, D, generator=gen))
        module.per_expert_scale.copy_(torch.rand(E, generator=gen) * 2 - 0.5)  # some negative
    x = np.random.default_rng(6).standard_normal((9, D)).astype(np.float32)
    with torch.no_grad():
        routed_input = module.norm(torch.from_numpy(x)) * module.scale * module.scalar_root_size
        _, want_weights, want_experts = module(torch.from_numpy(x))
    scale = module.per_expert_scale.detach().numpy().copy()
    router = native.moe_router(TensorType.F32, module.proj.weight.detach().numpy().copy(), E, D, TOP_K, normalize=True,
                               expert_scale=scale)
    for level in native.supported_kernels():
        kernel_level(level)
        for n, pool in pools.items():
            experts, weights = native.moe_router_route(router, routed_input.numpy(), pool=pool)
            np.testing.assert_array_equal(experts, want_experts.numpy(), err_msg=f"{level}, {n} threads")
            np.testing.assert_allclose(weights, want_weights.numpy(), rtol=2e-6, atol=1e-7)

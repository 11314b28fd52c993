"""Per-layer input embeddings (Gemma's PLE, ModelConfig.per_layer_input = P > 0).

Besides the residual stream, every layer reads a small input of its own for each token,
computed once per step before the first layer:
    token part    per_layer_embed[id] * sqrt(P)                     (T, L, P)  a table lookup
    context part  rms_norm(x0 @ per_layer_model_proj^T * D^-0.5)    (T, L, P)  x0: the scaled embeddings
    inputs        (context part + token part) * 2^-0.5
and each layer l adds, after its feed-forward:
    x += rms_norm(per_layer.proj(gelu_tanh(per_layer.gate(x)) * inputs[:, l])) * per_layer.norm
Nothing here outlives a step: a batch of sequences is T rows like any other.
"""

from __future__ import annotations

import numpy as np

from colibrid import native
from colibrid.engine.forward.ops import linear, rms_norm
from colibrid.models.model_config import ModelConfig
from colibrid.pack.tensor import PackedTensor


class PerLayerInputs:
    """The model-level half: every layer's input for the tokens of a step."""

    def __init__(self, config: ModelConfig, embed: PackedTensor, model_proj: PackedTensor, proj_norm: PackedTensor) -> None:
        self.c = config
        self.embed = embed  # (V, L * P)
        self.model_proj = model_proj  # (L * P, D)
        self.proj_norm = proj_norm  # (P)
        P, D = config.per_layer_input, config.hidden_size
        self.embed_scale, self.proj_scale = np.float32(P ** 0.5), np.float32(D ** -0.5)
        self.mix_scale = np.float32(2.0 ** -0.5)

    def __call__(self, token_ids: np.ndarray, x0: np.ndarray) -> np.ndarray:
        """(T, L, P) inputs for tokens ``token_ids`` (T,) whose scaled embeddings are ``x0`` (T, D)."""
        c, T = self.c, token_ids.shape[0]
        shape = (T, c.num_layers, c.per_layer_input)
        if self.embed.type is native.TensorType.F32:
            rows = self.embed.data[token_ids]
        else:
            rows = native.get_rows(self.embed.type, self.embed.data, self.embed.shape[1], token_ids.astype(np.int32))
        token_part = rows.astype(np.float32, copy=False).reshape(shape) * self.embed_scale
        context = (linear(x0, self.model_proj) * self.proj_scale).reshape(shape)
        context = rms_norm(context, self.proj_norm, c.rms_norm_eps)
        return (context + token_part) * self.mix_scale


class LayerInput:
    """The layer-level half: a gated projection of the layer's input into the residual stream."""

    def __init__(self, config: ModelConfig, weights: dict[str, PackedTensor]) -> None:
        self.eps = config.rms_norm_eps
        self.gate, self.proj, self.norm = weights["per_layer.gate"], weights["per_layer.proj"], weights["per_layer.norm"]

    def residual(self, x: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        """What the layer adds to x (T, D) for its inputs (T, P)."""
        gated = native.gelu_tanh_mul(linear(x, self.gate), np.ascontiguousarray(inputs))  # (T, P)
        return rms_norm(linear(gated, self.proj), self.norm, self.eps)

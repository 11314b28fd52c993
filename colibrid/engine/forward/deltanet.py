"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5-MoE and Qwen3-Next.

A layer step, for T new tokens (see DeltaNetConfig for the letters):
    h            = rms_norm(x) * attn_norm
    mixed        = h qkv^T                          (T, C)  q | k | v of every head
    z, b, a      = h z^T, h b^T, h a^T              (T, Hv * Dv), (T, Hv), (T, Hv)
    mixed        = silu(causal depthwise conv over the last Kc inputs, per channel)
    q, k         = l2_norm(q), l2_norm(k) per head; q *= Dk^-0.5; value head j reads key head j // (Hv / Hk)
    beta         = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)   (T, Hv): a log decay <= 0
    per value head, token by token (S the (Dk, Dv) state):
        S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q
    out          = rms_norm(out per head) * norm * silu(z)
    x           += out o^T
Prefill (T > 1) computes the recurrence in chunks of CHUNK tokens (the WY/UT form: a
triangular solve per chunk, then one state update per chunk), decode (T == 1) token by token,
both as transformers does; the two agree to float32 rounding.

Per sequence the layer keeps a DeltaNetState: the last Kc - 1 conv inputs and the (Hv, Dk, Dv)
recurrent state, a fixed size whatever the context length. libcolibri's col_deltanet_block runs
the whole step in one call when the library has it; the numpy code below is its reference.
"""

from __future__ import annotations

import logging

import numpy as np

from colibrid import native
from colibrid.engine.forward.ops import linear, rms_norm, silu
from colibrid.engine.forward.sequence_state import LayerPrefix, LayerState
from colibrid.engine.forward.token_mixer import TokenMixer
from colibrid.models.model_config import DeltaNetConfig, ModelConfig
from colibrid.pack.tensor import PackedTensor

log = logging.getLogger(__name__)

CHUNK = 64  # tokens per chunk of the chunked (prefill) form, as transformers
L2_NORM_EPS = 1e-6  # inside the square root of q's and k's L2 norms, as transformers (and FLA)
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it, as torch


class DeltaNetState(LayerState):
    """One sequence's state of one Gated DeltaNet layer: fixed size, float32.

    A recurrent state cannot be cut back to an earlier length, and a fresh prefill reaches the
    same bits only where it cuts the prompt the same way (the chunked form rounds by its cuts,
    and decode steps use the token-by-token form). So a ``resumable`` state also remembers
    itself at the end of each whole prompt chunk (note_prefill_chunk), twice the memory: prefix
    reuse resumes a later sequence from there, the last such point of the prompt."""

    def __init__(self, d: DeltaNetConfig, resumable: bool = False) -> None:
        self.conv = np.zeros((d.conv_kernel - 1, d.conv_channels), np.float32)  # (Kc - 1, C) last inputs, oldest first
        self.recurrent = np.zeros((d.num_value_heads, d.key_head_dim, d.value_head_dim), np.float32)  # (Hv, Dk, Dv)
        # (length, conv, recurrent) at the last prompt chunk's end; length 0: none yet
        self._remembered = (0, np.zeros_like(self.conv), np.zeros_like(self.recurrent)) if resumable else None

    @property
    def nbytes(self) -> int:
        copies = 1 if self._remembered is None else 2
        return copies * (self.conv.nbytes + self.recurrent.nbytes)

    def note_prefill_chunk(self, length: int) -> None:
        if self._remembered is not None:
            _, conv, recurrent = self._remembered
            conv[...], recurrent[...] = self.conv, self.recurrent
            self._remembered = (length, conv, recurrent)

    def kept_nbytes(self, length: int) -> int:
        return 0 if self._remembered is None or self._remembered[0] == 0 else self.conv.nbytes + self.recurrent.nbytes

    def keep(self, length: int) -> "DeltaNetPrefix | None":
        if self._remembered is None or self._remembered[0] == 0:
            return None
        at, conv, recurrent = self._remembered
        return DeltaNetPrefix(at, conv.copy(), recurrent.copy())


class DeltaNetPrefix(LayerPrefix):
    """A DeltaNet state as it was at the end of a whole prompt chunk, ``length`` tokens in:
    the one length a sequence can resume at."""

    def __init__(self, length: int, conv: np.ndarray, recurrent: np.ndarray) -> None:
        self.resume_from = self.resume_to = length
        self.conv, self.recurrent = conv, recurrent

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def restore(self, into: LayerState, length: int) -> None:
        if length != self.resume_to:
            raise ValueError(f"this DeltaNet state resumes at {self.resume_to} tokens, not {length}")
        into.conv[...], into.recurrent[...] = self.conv, self.recurrent
        into.note_prefill_chunk(length)  # the resumed sequence's own prompt chunks start here


class DeltaNet(TokenMixer):
    """One layer's Gated DeltaNet weights (with the input norm before it) and its step."""

    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], input_norm: PackedTensor) -> None:
        self.c = config
        self.d = config.deltanet
        self.layer = layer
        self.w = weights  # pack names without the "layers.{l}.attn." prefix
        self.input_norm = input_norm  # (D)
        self.fused = self._fused_layer()

    def _fused_layer(self):
        """The whole step as one libcolibri call, or None where projections have different types
        (the converter writes one type; the numpy path below then runs)."""
        w, d = self.w, self.d
        if len({w[name].type for name in ("qkv", "z", "b", "a")}) != 1:
            log.info("layer %d: DeltaNet projections of different types; the step runs in numpy", self.layer)
            return None
        weights = {name: (w[name].type, w[name].data) for name in ("qkv", "z", "b", "a", "o")}
        weights.update({name: w[name].data for name in ("conv", "A_log", "dt_bias", "norm")})
        return native.deltanet_layer(self.c.hidden_size, d.num_key_heads, d.num_value_heads, d.key_head_dim,
                                     d.value_head_dim, d.conv_kernel, self.input_norm.data, weights,
                                     eps=self.c.rms_norm_eps, norm_eps=self.c.rms_norm_eps)

    def new_state(self, max_tokens: int, max_step_tokens: int, resumable: bool = False,
                  kv_dtype: type = np.float32) -> DeltaNetState:
        """A fresh sequence's state; its size depends on neither the context nor the step."""
        return DeltaNetState(self.d, resumable)

    def residual(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 state: DeltaNetState, start: int) -> np.ndarray:
        """x + deltanet(rms_norm(x)) for the next T tokens of the sequence ``state`` belongs to
        (positions and RoPE tables are not used: the recurrence carries the order); ``x`` (T, D)
        is updated in place on the fused path."""
        if self.fused is not None:
            native.deltanet_block(self.fused, x, state.conv, state.recurrent)
            return x
        return x + self(rms_norm(x, self.input_norm, self.c.rms_norm_eps), state)

    def __call__(self, h: np.ndarray, state: DeltaNetState) -> np.ndarray:
        """The mixer's output (T, D) for normed inputs ``h`` (T, D); advances ``state``."""
        d, w = self.d, self.w
        T, Hk, Hv, Dk, Dv = h.shape[0], d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim
        mixed = self._conv(linear(h, w["qkv"]), state)  # (T, C)
        q = mixed[:, : Hk * Dk].reshape(T, Hk, Dk)
        k = mixed[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk)
        v = mixed[:, 2 * Hk * Dk :].reshape(T, Hv, Dv)
        group = Hv // Hk  # value heads per key head
        q = np.repeat(_l2_norm(q), group, axis=1)  # (T, Hv, Dk)
        k = np.repeat(_l2_norm(k), group, axis=1)  # (T, Hv, Dk)
        beta = _sigmoid(linear(h, w["b"]))  # (T, Hv)
        a = linear(h, w["a"])  # (T, Hv)
        g = (-np.exp(w["A_log"].data) * _softplus(a + w["dt_bias"].data)).astype(np.float32)  # (T, Hv) log decay
        if T > 1:
            out = chunked_delta_rule(q * np.float32(Dk ** -0.5), k, v, g, beta, state.recurrent)
        else:
            out = recurrent_delta_rule(q / np.float32(Dk ** 0.5), k, v, g, beta, state.recurrent)
        z = linear(h, w["z"]).reshape(T, Hv, Dv)
        out = _gated_rms_norm(out, w["norm"].data, z, self.c.rms_norm_eps)  # (T, Hv, Dv)
        return linear(out.reshape(T, Hv * Dv), w["o"])

    def _conv(self, mixed: np.ndarray, state: DeltaNetState) -> np.ndarray:
        """silu of the causal depthwise conv of ``mixed`` (T, C) after the state's last Kc - 1
        inputs (torch's conv1d: out[t] = sum_j weight[:, j] * input[t + j - (Kc - 1)]); the
        state keeps the last Kc - 1 inputs for the next step."""
        Kc, T = self.d.conv_kernel, mixed.shape[0]
        weight = self.w["conv"].data  # (C, Kc)
        window = np.concatenate([state.conv, mixed], axis=0)  # (Kc - 1 + T, C)
        out = np.zeros_like(mixed)
        for j in range(Kc):
            out += window[j : j + T] * weight[:, j]
        state.conv[...] = window[window.shape[0] - (Kc - 1) :]
        return silu(out)


def recurrent_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         state: np.ndarray) -> np.ndarray:
    """The gated delta rule token by token (transformers' torch_recurrent_gated_delta_rule):
    q, k (T, Hv, Dk) (q already scaled), v (T, Hv, Dv), g, beta (T, Hv); ``state`` (Hv, Dk, Dv)
    is updated in place. Returns (T, Hv, Dv)."""
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        state *= np.exp(g[t])[:, None, None]
        remembered = np.einsum("hkv,hk->hv", state, k[t])  # (Hv, Dv) what the state predicts for k
        delta = (v[t] - remembered) * beta[t][:, None]
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out


def chunked_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       state: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """The same recurrence in chunks (transformers' torch_chunk_gated_delta_rule): inside a
    chunk, the delta-rule updates are one unit-lower-triangular solve (the UT transform);
    between chunks, one state update. Shapes as recurrent_delta_rule; ``state`` updated in place."""
    T, Hv, Dk = q.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    n = (T + pad) // chunk  # chunks

    def heads_first(x: np.ndarray) -> np.ndarray:  # (T, Hv, ...) -> (Hv, n, chunk, ...), zero-padded
        x = np.moveaxis(x, 1, 0)
        x = np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(Hv, n, chunk, *x.shape[2:]).astype(np.float32)

    q, k, v, g, beta = (heads_first(x) for x in (q, k, v, g, beta))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    decay = np.cumsum(g, axis=-1, dtype=np.float32)  # (Hv, n, chunk) log decay from the chunk's start
    causal = np.tril(np.ones((chunk, chunk), dtype=bool))  # j <= i
    with np.errstate(over="ignore"):  # the masked (j > i) differences may overflow; they become 0
        pair_decay = np.where(causal, np.exp(np.where(causal, decay[..., :, None] - decay[..., None, :], 0)), 0)
    pair_decay = pair_decay.astype(np.float32)  # (Hv, n, chunk, chunk): decay from token j to token i
    ut = (k_beta @ np.swapaxes(k, -1, -2)) * pair_decay
    intra = (q @ np.swapaxes(k, -1, -2)) * pair_decay  # (Hv, n, chunk, chunk) attention inside a chunk
    solved = _solve_unit_lower(ut, np.concatenate([v_beta, k_beta * np.exp(decay)[..., None]], axis=-1))
    new_values, k_cumdecay = solved[..., :Dv], solved[..., Dv:]
    q = q * np.exp(decay)[..., None]
    k = k * np.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = np.exp(decay[..., -1])  # (Hv, n)
    out = np.empty((Hv, n, chunk, Dv), np.float32)
    s = state.astype(np.float32)
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s  # (Hv, chunk, Dv)
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + np.swapaxes(k[:, i], -1, -2) @ v_new
    state[...] = s
    return np.moveaxis(out.reshape(Hv, n * chunk, Dv)[:, :T], 0, 1)


def _solve_unit_lower(lower: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """X with (I + strictly_lower(lower)) X = rhs by forward substitution, for every leading
    index: lower (..., C, C), rhs (..., C, W). The diagonal of ``lower`` is not read."""
    x = np.empty_like(rhs)
    for i in range(lower.shape[-1]):
        x[..., i, :] = rhs[..., i, :] - np.einsum("...j,...jw->...w", lower[..., i, :i], x[..., :i, :])
    return x


def _l2_norm(x: np.ndarray) -> np.ndarray:
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_NORM_EPS))).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def _softplus(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(x))).astype(np.float32)


def _gated_rms_norm(x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of ``x`` times ``weight``, times silu(gate) (transformers'
    RMSNormGated: the norm before the gate)."""
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (weight * normed * silu(gate)).astype(np.float32)

"""The fused decoder layer steps: one libcolibri call per layer for attention
(col_attention_block), latent attention (col_mla_block) and Gated DeltaNet
(col_deltanet_block). Each *_layer() builds the C structure once, checking every size, and
keeps the arrays it points into alive; each *_block() runs one step."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from colibrid.native.arguments import _as_count, _f32_out, _f32_vector, _ptr
from colibrid.native.errors import InvalidArgumentError
from colibrid.native.library import _lib, check, mirrors_c_struct
from colibrid.native.pool import ThreadPool, _pool_handle
from colibrid.native.tensor_type import TensorType, _as_type, _matrix_bytes


# --------------------------------------------------------------------------------------------
# Fused decoder steps
# --------------------------------------------------------------------------------------------

QK_NORM_CODES = {"none": 0, "full": 1, "head": 2, "head_after_rope": 3}  # enum col_qk_norm


@mirrors_c_struct("col_attention_layer_size")
class AttentionLayer(ctypes.Structure):
    """Mirror of col_attention_layer (colibri.h); its size is checked against C at load.
    Build it with attention_layer(), which checks every size once and keeps the arrays it
    points into alive for as long as the structure lives."""

    _fields_ = [
        ("dim", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("n_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("window", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("clip_qkv", ctypes.c_float),
        ("qk_norm", ctypes.c_int32), ("qkv_type", ctypes.c_int32), ("o_type", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")),
        ("rotary_dim", ctypes.c_int64), ("sinks", ctypes.c_void_p), ("chunk", ctypes.c_int64), ("wg", ctypes.c_void_p),
        ("rope_interleaved", ctypes.c_int32), ("no_rope", ctypes.c_int32),
        ("temp_floor", ctypes.c_float), ("temp_scale", ctypes.c_float),
        ("v_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
    ]


def attention_layer(dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm: np.ndarray,
                    qkv_type: TensorType | int | str, wq, wk, wv, o_type: TensorType | int | str, wo, *,
                    eps: float, scale: float, window: int | None = None, clip_qkv: float | None = None,
                    qk_norm: str = "none", q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None,
                    bq: np.ndarray | None = None, bk: np.ndarray | None = None, bv: np.ndarray | None = None,
                    bo: np.ndarray | None = None, rotary_dim: int = 0, sinks: np.ndarray | None = None,
                    chunk: int | None = None, wg=None, rope_interleaved: bool = False, no_rope: bool = False,
                    temperature: tuple[float, float] | None = None, v_norm: np.ndarray | None = None,
                    post_norm: np.ndarray | None = None) -> AttentionLayer:
    """One layer's attention for attention_block(): ``wq`` (H*Hd, D), ``wk``/``wv`` (K*Hd, D)
    encoded as ``qkv_type``, ``wo`` (D, H*Hd) as ``o_type`` (contiguous buffers, read in place);
    ``norm`` (D) the input RMSNorm; biases and q/k norm weights float32 or None; ``rotary_dim``
    the leading dims of each head RoPE rotates (0: all); ``sinks`` (H) float32 per-head sink
    logits or None; ``chunk`` the chunked-local attention span (None: none); ``wg`` (H*Hd, D) as
    ``qkv_type``: an output gate, the attention output times sigmoid(h wg^T) (Qwen3.5,
    Qwen3-Next), or None; ``rope_interleaved``: RoPE turns pairs (x0, x1), (x2, x3) ...;
    ``no_rope``: none at all; ``temperature`` (floor, scale): queries scaled by attention
    temperature tuning (see col_attention_layer), or None; ``v_norm`` (Hd) the RMSNorm weight
    of each value head, ``post_norm`` (D) that of the attention output before the residual
    add, or None."""
    dim, n_heads, n_kv_heads, head_dim = (_as_count(v, n) for v, n in (
        (dim, "dim"), (n_heads, "n_heads"), (n_kv_heads, "n_kv_heads"), (head_dim, "head_dim")))
    if min(dim, n_heads, n_kv_heads, head_dim) == 0 or n_heads % n_kv_heads or head_dim % 2:
        raise InvalidArgumentError("attention needs dim, heads > 0, n_heads % n_kv_heads == 0 and an even head_dim")
    rotary_dim = _as_count(rotary_dim, "rotary_dim")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise InvalidArgumentError(f"rotary_dim must be even and at most head_dim {head_dim}, got {rotary_dim}")
    if qk_norm not in QK_NORM_CODES:
        raise InvalidArgumentError(f"qk_norm must be one of {', '.join(QK_NORM_CODES)}, got {qk_norm!r}")
    t_qkv, t_o = _as_type(qkv_type), _as_type(o_type)
    Q, KV = n_heads * head_dim, n_kv_heads * head_dim
    keep = [_f32_vector(norm, "norm", dim)]
    layer = AttentionLayer(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, window=int(window or 0),
                           eps=float(eps), scale=float(scale), clip_qkv=float(clip_qkv or 0.0),
                           qk_norm=QK_NORM_CODES[qk_norm], qkv_type=int(t_qkv), o_type=int(t_o), norm=_ptr(norm),
                           rotary_dim=rotary_dim, chunk=_as_count(chunk or 0, "chunk"),
                           rope_interleaved=int(bool(rope_interleaved)),
                           no_rope=int(bool(no_rope)))
    if temperature is not None:
        floor, scale_ = (float(v) for v in temperature)
        if not (np.isfinite(floor) and floor > 0 and np.isfinite(scale_)):
            raise InvalidArgumentError(f"temperature needs a floor > 0 and a finite scale, got {temperature}")
        layer.temp_floor, layer.temp_scale = floor, scale_
    matrices = [("wq", wq, t_qkv, Q, dim), ("wk", wk, t_qkv, KV, dim), ("wv", wv, t_qkv, KV, dim), ("wo", wo, t_o, dim, Q)]
    for field, data, t, rows, cols in matrices + ([("wg", wg, t_qkv, Q, dim)] if wg is not None else []):
        raw = _matrix_bytes(data, field, t, rows, cols)
        keep.append(raw)
        setattr(layer, field, _ptr(raw))
    norm_width = {"none": None, "full": (Q, KV), "head": (head_dim, head_dim), "head_after_rope": (head_dim, head_dim)}[qk_norm]
    vectors = [("bq", bq, Q), ("bk", bk, KV), ("bv", bv, KV), ("bo", bo, dim), ("sinks", sinks, n_heads),
               ("v_norm", v_norm, head_dim), ("post_norm", post_norm, dim)]
    if norm_width is not None:
        if q_norm is None or k_norm is None:
            raise InvalidArgumentError(f"qk_norm {qk_norm!r} needs q_norm and k_norm")
        vectors += [("q_norm", q_norm, norm_width[0]), ("k_norm", k_norm, norm_width[1])]
    return _with_vectors(layer, vectors, keep)


def _check_rope_tables(cos: np.ndarray, sin: np.ndarray, T: int, width: int) -> None:
    """cos and sin of T positions for `width` rotated dims, as the attention calls read them."""
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, np.ndarray) or table.dtype != np.float32 or table.shape != (T, width) or not table.flags.c_contiguous:
            raise InvalidArgumentError(f"{name} must be a C-contiguous float32 ({T}, {width}) array")


def _with_vectors(layer: ctypes.Structure, vectors: list, keep: list) -> ctypes.Structure:
    """Points the layer's float vector fields at ``vectors`` ((field, array or None, length),
    each checked), and keeps every buffer its pointers point into alive with the layer."""
    for field, vector, n in vectors:
        if vector is not None:
            keep.append(_f32_vector(vector, field, n))
            setattr(layer, field, _ptr(vector))
    layer._keep = keep
    return layer


@mirrors_c_struct("col_attention_seq_size")
class AttentionSeq(ctypes.Structure):
    """Mirror of col_attention_seq: one sequence's cache and rows in a batched attention step."""

    _fields_ = [("keys", ctypes.c_void_p), ("vals", ctypes.c_void_p), ("n_past", ctypes.c_int64),
                ("n_tok", ctypes.c_int64), ("ring_rows", ctypes.c_int64), ("kv_type", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


# The element types a KV cache may have, and their col_type codes (colibri.h); a float16
# cache's heads are at most COL_ATTEND_MAX_HEAD_DIM wide.
KV_CACHE_TYPES = {np.dtype(np.float32): int(TensorType.F32), np.dtype(np.float16): int(TensorType.F16)}
MAX_F16_HEAD_DIM = 1024


def attention_block(layer: AttentionLayer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                    values: np.ndarray, n_past: int, pool: "ThreadPool | None" = None, *, ring: bool = False) -> None:
    """x += attention(rms_norm(x)) for T new tokens at positions n_past .., in place (see
    col_attention_block): ``x`` (T, D), ``cos``/``sin`` (T, Hr) (Hr = the layer's rotary_dim or Hd), ``keys``/``values`` the
    layer's whole cache buffers, float32 or float16 (both the same): (capacity >= n_past + T,
    K, Hd), rows n_past .. n_past + T - 1 written; or with ``ring`` a ring buffer of (rows, K,
    Hd) holding key position p in row p % rows, rows >= the layer's window or chunk + T - 1. A
    float16 cache stores each new key and value rounded to nearest even and gives the bits a
    float32 cache holding those rounded values gives."""
    n_tok = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
    attention_block_batch(layer, x, cos, sin, [(keys, values, n_past, n_tok, ring)], pool)


def attention_block_batch(layer: AttentionLayer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                          caches: "Sequence[tuple[np.ndarray, np.ndarray, int, int, bool]]",
                          pool: "ThreadPool | None" = None) -> None:
    """attention_block over the rows of several sequences, in one call (col_attention_block_batch):
    ``caches`` holds each sequence's (keys, values, n_past, n_tok, ring) as attention_block's
    arguments, its n_tok rows of x (T, D) following the previous sequence's; cos/sin (T, Hr)."""
    if not isinstance(layer, AttentionLayer) or not hasattr(layer, "_keep"):
        raise InvalidArgumentError("layer must come from attention_layer()")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InvalidArgumentError("x must be a (T, D) float32 array")
    T, Hd = x.shape[0], layer.head_dim
    _f32_out(x, "x", (T, layer.dim))
    _check_rope_tables(cos, sin, T, layer.rotary_dim or Hd)
    seqs = (AttentionSeq * max(len(caches), 1))()
    rows = 0
    for seq, (keys, values, n_past, n_tok, ring) in zip(seqs, caches):
        n_past, n_tok = _as_count(n_past, "n_past"), _as_count(n_tok, "n_tok")
        capacity = _attention_cache(layer, keys, values, n_past, n_tok, ring)
        seq.keys, seq.vals = keys.ctypes.data, values.ctypes.data
        seq.n_past, seq.n_tok, seq.ring_rows = n_past, n_tok, capacity if ring else 0
        seq.kv_type = KV_CACHE_TYPES[keys.dtype]
        rows += n_tok
    if rows != T:
        raise InvalidArgumentError(f"the sequences' n_tok add up to {rows}, but x has {T} rows")
    check(_lib().col_attention_block_batch(_pool_handle(pool), ctypes.addressof(layer), _ptr(x), _ptr(cos), _ptr(sin),
                                           ctypes.addressof(seqs), len(caches)), "attention_block_batch")


def _attention_cache(layer: AttentionLayer, keys: np.ndarray, values: np.ndarray, n_past: int, n_tok: int,
                     ring: bool) -> int:
    """The rows of a sequence's cache buffers, after checking they hold its n_tok new keys."""
    Hd = layer.head_dim
    capacity = keys.shape[0] if isinstance(keys, np.ndarray) and keys.ndim == 3 else -1
    spans = [s for s in (layer.window, layer.chunk) if s > 0]
    needed = min(spans) + n_tok - 1 if ring and spans else n_past + n_tok
    if ring and not spans:
        raise InvalidArgumentError("a ring-buffer cache needs a layer with a window or a chunk")
    if capacity < needed:
        raise InvalidArgumentError(f"keys must be a (>= {needed}, K, Hd) array")
    shape = (capacity, layer.n_kv_heads, Hd)
    for a, name in ((keys, "keys"), (values, "values")):
        if not isinstance(a, np.ndarray) or a.dtype not in KV_CACHE_TYPES or a.dtype != keys.dtype or not a.flags.c_contiguous \
                or not a.flags.writeable or a.shape != shape:
            raise InvalidArgumentError(f"{name} must be a writable C-contiguous float32 or float16 array of shape "
                                       f"{shape}, keys and values of one type")
    if keys.dtype == np.float16 and Hd > MAX_F16_HEAD_DIM:
        raise InvalidArgumentError(f"a float16 cache takes heads of at most {MAX_F16_HEAD_DIM} values, not {Hd}")
    return capacity


@mirrors_c_struct("col_mla_layer_size")
class MlaLayer(ctypes.Structure):
    """Mirror of col_mla_layer (colibri.h); its size is checked against C at load. Build it
    with mla_layer(), which checks every size once and keeps the arrays it points into alive."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("dim", "n_heads", "q_rank", "kv_rank", "nope_dim", "rope_dim", "v_dim")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *((name, ctypes.c_int32) for name in ("rope_interleaved", "in_type", "qb_type", "kvb_type", "o_type", "reserved")),
        *((name, ctypes.c_void_p) for name in ("norm", "wq_a", "q_a_norm", "wq_b", "wq", "wkv_a", "kv_a_norm", "wkv_b",
                                               "wo", "bo")),
    ]


def mla_layer(dim: int, n_heads: int, q_rank: int, kv_rank: int, nope_dim: int, rope_dim: int, v_dim: int,
              norm: np.ndarray, weights: dict, *, eps: float, scale: float, rope_interleaved: bool,
              bo: np.ndarray | None = None) -> MlaLayer:
    """One layer's latent attention for mla_block() (see col_mla_layer): ``weights`` maps
    "q_a", "q_b" (q_rank > 0) or "q", and "kv_a", "kv_b", "o" to (type, encoded bytes), read
    in place; ``norm`` (D) and the float32 vectors "q_a_norm" (Cq), "kv_a_norm" (C) in
    ``weights`` as plain arrays."""
    dims = [_as_count(v, n) for v, n in ((dim, "dim"), (n_heads, "n_heads"), (q_rank, "q_rank"), (kv_rank, "kv_rank"),
                                         (nope_dim, "nope_dim"), (rope_dim, "rope_dim"), (v_dim, "v_dim"))]
    dim, H, Cq, C, N, R, Vd = dims
    if min(dim, H, C, R, Vd) == 0 or R % 2:
        raise InvalidArgumentError("latent attention needs dim, heads, kv_rank, v_dim > 0 and an even rope_dim > 0")
    QH = H * (N + R)
    matrices = {"kv_a": (C + R, dim), "kv_b": (H * (N + Vd), C), "o": (dim, H * Vd)}
    matrices.update({"q_a": (Cq, dim), "q_b": (QH, Cq)} if Cq else {"q": (QH, dim)})
    if Cq and weights["q_a"][0] != weights["kv_a"][0] or not Cq and weights["q"][0] != weights["kv_a"][0]:
        raise InvalidArgumentError("q_a (or q) and kv_a must have one type")
    keep = [_f32_vector(norm, "norm", dim)]
    layer = MlaLayer(dim=dim, n_heads=H, q_rank=Cq, kv_rank=C, nope_dim=N, rope_dim=R, v_dim=Vd, eps=float(eps),
                     scale=float(scale), rope_interleaved=int(bool(rope_interleaved)), norm=_ptr(norm))
    fields = {"q_a": "wq_a", "q_b": "wq_b", "q": "wq", "kv_a": "wkv_a", "kv_b": "wkv_b", "o": "wo"}
    for name, (rows, cols) in matrices.items():
        type_, data = weights[name]
        raw = _matrix_bytes(data, name, _as_type(type_), rows, cols)
        keep.append(raw)
        setattr(layer, fields[name], _ptr(raw))
    layer.in_type = int(_as_type(weights["kv_a"][0]))
    layer.qb_type = int(_as_type(weights["q_b"][0])) if Cq else 0
    layer.kvb_type = int(_as_type(weights["kv_b"][0]))
    layer.o_type = int(_as_type(weights["o"][0]))
    vectors = [("kv_a_norm", weights["kv_a_norm"], C), ("bo", bo, dim)] + ([("q_a_norm", weights["q_a_norm"], Cq)] if Cq else [])
    return _with_vectors(layer, vectors, keep)


def mla_block(layer: MlaLayer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache: np.ndarray, n_past: int,
              pool: "ThreadPool | None" = None) -> None:
    """x += latent attention(rms_norm(x)) for T new tokens at positions n_past .., in place
    (see col_mla_block): ``x`` (T, D), ``cos``/``sin`` (T, R), ``cache`` the layer's whole
    latent cache (capacity >= n_past + T, C + R), float32; rows n_past .. n_past + T - 1 of the
    cache are written."""
    if not isinstance(layer, MlaLayer) or not hasattr(layer, "_keep"):
        raise InvalidArgumentError("layer must come from mla_layer()")
    n_past = _as_count(n_past, "n_past")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InvalidArgumentError("x must be a (T, D) float32 array")
    T, R, L = x.shape[0], layer.rope_dim, layer.kv_rank + layer.rope_dim
    _f32_out(x, "x", (T, layer.dim))
    _check_rope_tables(cos, sin, T, R)
    capacity = cache.shape[0] if isinstance(cache, np.ndarray) and cache.ndim == 2 else -1
    if capacity < n_past + T:
        raise InvalidArgumentError(f"cache must be a (>= {n_past + T}, {L}) array")
    _f32_out(cache, "cache", (capacity, L))
    check(_lib().col_mla_block(_pool_handle(pool), ctypes.addressof(layer), _ptr(x), T, _ptr(cos), _ptr(sin),
                               _ptr(cache), n_past), "mla_block")


@mirrors_c_struct("col_deltanet_layer_size")
class DeltaNetLayer(ctypes.Structure):
    """Mirror of col_deltanet_layer (colibri.h); its size is checked against C at load. Build it
    with deltanet_layer(), which checks every size once and keeps the arrays it points into alive."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("dim", "n_k_heads", "n_v_heads", "k_head_dim", "v_head_dim", "conv_kernel")),
        ("eps", ctypes.c_float), ("norm_eps", ctypes.c_float), ("in_type", ctypes.c_int32), ("o_type", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("norm", "wqkv", "wz", "wb", "wa", "conv", "conv_bias", "A_log", "dt_bias",
                                               "gate_norm", "wo")),
    ]


def deltanet_layer(dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int,
                   input_norm: np.ndarray, weights: dict, eps: float, norm_eps: float) -> DeltaNetLayer:
    """One Gated DeltaNet layer for deltanet_block() (see col_deltanet_layer). ``weights`` maps
    "qkv" (C, D), "z" (Hv*Dv, D), "b" (Hv, D), "a" (Hv, D) -- one type -- and "o" (D, Hv*Dv)
    to (type, encoded bytes), read in place, and the float32 arrays "conv" (C, Kc),
    "conv_bias" (C) (optional), "A_log" (Hv), "dt_bias" (Hv), "norm" (Dv, the gated norm's
    weight); ``input_norm`` (D) is the layer's input RMSNorm weight. C = 2*Hk*Dk + Hv*Dv."""
    D, Hk, Hv, Dk, Dv, Kc = (_as_count(v, n) for v, n in (
        (dim, "dim"), (n_k_heads, "n_k_heads"), (n_v_heads, "n_v_heads"), (k_head_dim, "k_head_dim"),
        (v_head_dim, "v_head_dim"), (conv_kernel, "conv_kernel")))
    if min(D, Hk, Hv, Dk, Dv, Kc) == 0 or Hv % Hk:
        raise InvalidArgumentError(f"a DeltaNet layer needs sizes > 0 and value heads ({Hv}) a multiple of key heads ({Hk})")
    C, Z = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    missing = sorted({"qkv", "z", "b", "a", "o", "conv", "A_log", "dt_bias", "norm"} - set(weights))
    if missing:
        raise InvalidArgumentError(f"DeltaNet weights lack {', '.join(missing)}")
    in_types = {_as_type(weights[name][0]) for name in ("qkv", "z", "b", "a")}
    if len(in_types) != 1:
        raise InvalidArgumentError("qkv, z, b and a must have one type (one quantization of the input)")
    keep = [_f32_vector(input_norm, "input_norm", D)]
    layer = DeltaNetLayer(dim=D, n_k_heads=Hk, n_v_heads=Hv, k_head_dim=Dk, v_head_dim=Dv, conv_kernel=Kc, eps=float(eps),
                          norm_eps=float(norm_eps), in_type=int(in_types.pop()), o_type=int(_as_type(weights["o"][0])),
                          norm=_ptr(input_norm))
    fields = {"qkv": "wqkv", "z": "wz", "b": "wb", "a": "wa", "o": "wo"}
    for name, (rows, cols) in {"qkv": (C, D), "z": (Z, D), "b": (Hv, D), "a": (Hv, D), "o": (D, Z)}.items():
        type_, data = weights[name]
        raw = _matrix_bytes(data, name, _as_type(type_), rows, cols)
        keep.append(raw)
        setattr(layer, fields[name], _ptr(raw))
    conv = weights["conv"]
    if not isinstance(conv, np.ndarray) or conv.dtype != np.float32 or conv.shape != (C, Kc) or not conv.flags.c_contiguous:
        raise InvalidArgumentError(f"conv must be a C-contiguous float32 ({C}, {Kc}) array")
    keep.append(conv)
    layer.conv = _ptr(conv)
    vectors = [("conv_bias", "conv_bias", C), ("A_log", "A_log", Hv), ("dt_bias", "dt_bias", Hv), ("norm", "gate_norm", Dv)]
    for name, field, n in vectors:
        vector = weights.get(name)
        if vector is not None:
            keep.append(_f32_vector(vector, name, n))
            setattr(layer, field, _ptr(vector))
    layer._keep = keep  # the buffers the pointers point into
    return layer


def deltanet_block(layer: DeltaNetLayer, x: np.ndarray, conv_state: np.ndarray, recurrent_state: np.ndarray,
                   pool: "ThreadPool | None" = None) -> None:
    """x += Gated DeltaNet(rms_norm(x)) for the T new tokens of one sequence, in place (see
    col_deltanet_block): ``x`` (T, D); the sequence's ``conv_state`` (Kc - 1, C) and
    ``recurrent_state`` (Hv, Dk, Dv), float32, zeros for a new sequence, updated in place."""
    if not isinstance(layer, DeltaNetLayer) or not hasattr(layer, "_keep"):
        raise InvalidArgumentError("layer must come from deltanet_layer()")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InvalidArgumentError("x must be a (T, D) float32 array")
    Hk, Hv, Dk, Dv = layer.n_k_heads, layer.n_v_heads, layer.k_head_dim, layer.v_head_dim
    C = 2 * Hk * Dk + Hv * Dv
    _f32_out(x, "x", (x.shape[0], layer.dim))
    _f32_out(conv_state, "conv_state", (layer.conv_kernel - 1, C))
    _f32_out(recurrent_state, "recurrent_state", (Hv, Dk, Dv))
    check(_lib().col_deltanet_block(_pool_handle(pool), ctypes.addressof(layer), _ptr(x), x.shape[0],
                                    _ptr(conv_state) if conv_state.size else None, _ptr(recurrent_state)),
          "deltanet_block")

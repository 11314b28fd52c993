"""The compute kernels: quantize / dequantize / convert, embedding rows, the matrix
product, the fused MoE expert FFN, RMSNorm, gated activations, RoPE, attention, and the
MoE routers. Each wrapper checks its arguments, then makes one libcolibri call.

Shape letters: R rows, C cols, T tokens, I n_in, O n_out, E experts, A active experts,
D hidden, F expert ffn."""

from __future__ import annotations

import ctypes

import numpy as np

from colibrid.native.arguments import _as_count, _byte_view, _f32_matrix, _f32_vector, _ptr
from colibrid.native.errors import InvalidArgumentError
from colibrid.native.library import _lib, check, mirrors_c_struct, status_error
from colibrid.native.pool import ThreadPool, _pool_handle
from colibrid.native.tensor_type import TensorType, _as_type, _matrix_bytes


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def quantize(type_: TensorType | int | str, src: np.ndarray) -> np.ndarray:
    """Encodes float32 ``src`` (R, C) as ``type_``; returns uint8 (R, row_bytes(C)).

    Raises ValueRangeError for NaN/inf in a q8_0 / q4_g64 / mxfp4 block (or |x| > ~65504 in a
    q8_0 / q4_g64 one)."""
    t = _as_type(type_)
    src = _f32_matrix(src, "src")
    rows, cols = src.shape
    dst = np.empty((rows, t.row_bytes(cols)), dtype=np.uint8)
    check(_lib().col_quantize(int(t), _ptr(src), rows, cols, _ptr(dst)), f"quantize {t.name_in_pack}")
    return dst


def dequantize(type_: TensorType | int | str, data, rows: int, cols: int) -> np.ndarray:
    """Decodes ``data`` (exactly R * row_bytes(C) bytes, any buffer) to float32 (R, C)."""
    t = _as_type(type_)
    rows, cols = _as_count(rows, "rows"), _as_count(cols, "cols")
    raw = _matrix_bytes(data, "data", t, rows, cols)
    out = np.empty((rows, cols), dtype=np.float32)
    check(_lib().col_dequantize(int(t), _ptr(raw), rows, cols, _ptr(out)), f"dequantize {t.name_in_pack}")
    return out


# source dtypes of col_convert, by safetensors name (index = C enum col_source_dtype)
SOURCE_DTYPES = ("F32", "F16", "BF16", "F8_E4M3")
_SOURCE_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8}


@mirrors_c_struct("col_source_matrix_size")
class _SourceMatrix(ctypes.Structure):
    """Mirror of col_source_matrix (colibri.h); its size is checked against C at load."""

    _fields_ = [
        ("dtype", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("n_src_rows", ctypes.c_int64),
        ("row0", ctypes.c_int64),
        ("row_step", ctypes.c_int64),
        ("scale_inv", ctypes.c_void_p),
        ("block_rows", ctypes.c_int64),
        ("block_cols", ctypes.c_int64),
    ]


def convert(type_: TensorType | int | str, source: np.ndarray, dtype: str, rows: slice | None = None,
            scale_inv: np.ndarray | None = None, block: tuple[int, int] | None = None,
            pool: "ThreadPool | None" = None) -> np.ndarray:
    """Checkpoint rows -> ``type_``, on ``pool`` (default: default_pool()); returns uint8
    (R, row_bytes(C)), the same bytes as ``quantize(type_, <source as float32>[rows])``.

    ``source``: the published (N, C) elements of safetensors ``dtype`` (F32, F16, BF16 as
    uint16 bits, F8_E4M3 as uint8 codes), C-contiguous (a read-only memory map is fine);
    ``rows``: a slice of the N rows (default all); ``scale_inv``: F8_E4M3 only, float32
    (ceil(N / b0), ceil(C / b1)) factors for blocks ``block`` = (b0, b1)."""
    t = _as_type(type_)
    if dtype not in SOURCE_DTYPES:
        raise InvalidArgumentError(f"source dtype {dtype!r}: col_convert reads {', '.join(SOURCE_DTYPES)}")
    if not isinstance(source, np.ndarray) or source.ndim != 2 or source.dtype != _SOURCE_NUMPY[dtype] \
            or not source.flags.c_contiguous:
        raise InvalidArgumentError(f"source must be a C-contiguous 2-D {np.dtype(_SOURCE_NUMPY[dtype]).name} array for {dtype}")
    n_src_rows, cols = source.shape
    row0, _, row_step = (rows or slice(None)).indices(n_src_rows)
    if row_step < 1:
        raise InvalidArgumentError(f"rows {rows}: the step must be positive")
    n_rows = len(range(*(rows or slice(None)).indices(n_src_rows)))
    matrix = _SourceMatrix(SOURCE_DTYPES.index(dtype), 0, _ptr(source) if source.size else None, n_src_rows, row0, row_step)
    if scale_inv is not None:
        if dtype != "F8_E4M3" or block is None:
            raise InvalidArgumentError("scale_inv goes with F8_E4M3 sources and a block size")
        b0, b1 = block
        grid = (-(-n_src_rows // b0), -(-cols // b1))
        scale_inv = np.ascontiguousarray(scale_inv, dtype=np.float32)
        if scale_inv.shape != grid:
            raise InvalidArgumentError(f"scale_inv has shape {list(scale_inv.shape)}, expected {list(grid)} for blocks of {b0}x{b1}")
        matrix.scale_inv, matrix.block_rows, matrix.block_cols = _ptr(scale_inv), b0, b1
    dst = np.empty((n_rows, t.row_bytes(cols)), dtype=np.uint8)
    check(_lib().col_convert(_pool_handle(pool), ctypes.byref(matrix), n_rows, cols, int(t), _ptr(dst)),
          f"convert {dtype} to {t.name_in_pack}")
    return dst


def get_rows(type_: TensorType | int | str, data, cols: int, ids) -> np.ndarray:
    """Embedding lookup: decodes rows ``ids`` (N) of ``data`` (n_rows, row_bytes(C)) to
    float32 (N, C). n_rows is len(data) / row_bytes; every id must be in [0, n_rows)."""
    t = _as_type(type_)
    cols = _as_count(cols, "cols")
    raw = _byte_view(data, "data")
    row_bytes = t.row_bytes(cols)
    if row_bytes == 0:
        n_rows = 0
    elif raw.size % row_bytes != 0:
        raise InvalidArgumentError(f"data has {raw.size} bytes, not a whole number of {row_bytes}-byte rows")
    else:
        n_rows = raw.size // row_bytes
    ids_arr = np.asarray(ids)
    if ids_arr.ndim != 1 or not (ids_arr.size == 0 or np.issubdtype(ids_arr.dtype, np.integer)):
        raise InvalidArgumentError(f"ids must be a 1-D integer array, got {ids_arr.dtype} {ids_arr.shape}")
    if ids_arr.size and (int(ids_arr.min()) < 0 or int(ids_arr.max()) >= n_rows):
        raise InvalidArgumentError(f"ids must be in [0, {n_rows}), got [{ids_arr.min()}, {ids_arr.max()}]")
    ids32 = np.ascontiguousarray(ids_arr, dtype=np.int32)
    out = np.empty((ids32.size, cols), dtype=np.float32)
    check(_lib().col_get_rows(int(t), _ptr(raw), cols, _ptr(ids32), ids32.size, _ptr(out)), f"get_rows {t.name_in_pack}")
    return out


def matmul(type_: TensorType | int | str, data, n_out: int, n_in: int, x: np.ndarray,
           pool: "ThreadPool | None" = None) -> np.ndarray:
    """y = x @ w.T: ``data`` is the weight w (O, I) encoded as ``type_`` (exactly
    O * row_bytes(I) bytes), ``x`` float32 (T, I); returns float32 (T, O). Rows are split
    across ``pool`` (default: default_pool())."""
    t = _as_type(type_)
    n_out, n_in = _as_count(n_out, "n_out"), _as_count(n_in, "n_in")
    raw = _matrix_bytes(data, "data", t, n_out, n_in)
    x = _f32_matrix(x, "x", cols=n_in)
    n_tok = x.shape[0]
    y = np.empty((n_tok, n_out), dtype=np.float32)
    status = _lib().col_matmul(_pool_handle(pool), int(t), _ptr(raw), n_out, n_in, _ptr(x), n_tok, _ptr(y))
    if status:  # the message only on failure: building it costs as much as the checks above
        raise status_error(status, f"matmul {t.name_in_pack}")
    return y


class ExpertBuffers:
    """One routed expert's three matrices for col_moe_experts (and, for experts with biases,
    their float32 bias vectors: gate and up (F), down (D)): checked once (type, sizes,
    contiguity) and reduced to addresses, so a layer step that reuses the same expert views
    (resident experts, cache slots) pays no per-call checks. Keeps the buffers alive."""

    __slots__ = ("type", "dim", "ffn", "gate", "up", "down", "gate_bias", "up_bias", "down_bias", "_keep")

    def __init__(self, type_: TensorType | int | str, gate, up, down, dim: int, ffn: int,
                 biases: "tuple[np.ndarray, np.ndarray, np.ndarray] | None" = None) -> None:
        t = _as_type(type_)
        self.type, self.dim, self.ffn = t, _as_count(dim, "dim"), _as_count(ffn, "ffn")
        keep = []
        for field, data, rows, cols in (("gate", gate, self.ffn, self.dim), ("up", up, self.ffn, self.dim),
                                        ("down", down, self.dim, self.ffn)):
            raw = _matrix_bytes(data, f"expert {field}", t, rows, cols)
            keep.append(raw)
            setattr(self, field, _ptr(raw))
        self.gate_bias = self.up_bias = self.down_bias = None
        if biases is not None:
            for field, vector, n in zip(("gate_bias", "up_bias", "down_bias"), biases, (self.ffn, self.ffn, self.dim)):
                keep.append(_f32_vector(vector, f"expert {field}", n))
                setattr(self, field, _ptr(vector))
        self._keep = keep


EXPERT_ACTIVATION_CODES = {"swiglu": 0, "clamped_swiglu": 1, "geglu_tanh": 2}  # enum col_expert_activation


@mirrors_c_struct("col_expert_ffn_size")
class ExpertFfn(ctypes.Structure):
    """Mirror of col_expert_ffn (colibri.h); its size is checked against C at load."""

    _fields_ = [("activation", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("reserved", ctypes.c_int32), ("gate_bias", ctypes.c_void_p), ("up_bias", ctypes.c_void_p),
                ("down_bias", ctypes.c_void_p), ("weight_on_input", ctypes.c_int32), ("reserved2", ctypes.c_int32)]


def moe_experts(type_: TensorType | int | str, gates, ups, downs, dim: int, ffn: int, x: np.ndarray,
                expert_of: np.ndarray, weight: np.ndarray, out: np.ndarray, pool: "ThreadPool | None" = None,
                biases=None, activation: str = "swiglu", alpha: float = 1.0, limit: float = 0.0,
                weight_on_input: bool = False) -> None:
    """One fused MoE layer step, accumulated into ``out`` (T, D) float32 in place:
    for every (t, a) with e = expert_of[t, a] >= 0,
    out[t] += weight[t, a] * down_e(silu(gate_e x[t]) * up_e x[t]).

    ``gates``/``ups`` are E buffers of (F, row_bytes(D)) bytes, ``downs`` E buffers of
    (D, row_bytes(F)) bytes (any buffer: numpy views of a record, slot memory);
    ``expert_of`` (T, A) integers in [-1, E), ``weight`` (T, A) float32. Experts are added in
    increasing index. The buffers are only read during the call."""
    if len(ups) != len(gates) or len(downs) != len(gates):
        raise InvalidArgumentError(f"gates, ups and downs must have the same length, got {len(gates)}, {len(ups)}, {len(downs)}")
    biases = biases if biases is not None else [None] * len(gates)
    experts = [ExpertBuffers(type_, g, u, d, dim, ffn, b) for g, u, d, b in zip(gates, ups, downs, biases)]
    moe_experts_of(experts, x, expert_of, weight, out, pool, type_=type_, dim=dim, ffn=ffn, activation=activation,
                   alpha=alpha, limit=limit, weight_on_input=weight_on_input)


def moe_experts_of(experts: "list[ExpertBuffers]", x: np.ndarray, expert_of: np.ndarray, weight: np.ndarray,
                   out: np.ndarray, pool: "ThreadPool | None" = None, type_=None, dim: int | None = None,
                   ffn: int | None = None, activation: str = "swiglu", alpha: float = 1.0, limit: float = 0.0,
                   weight_on_input: bool = False) -> None:
    """moe_experts over prepared ExpertBuffers (all of one type and shape; ``type_``, ``dim``
    and ``ffn`` are needed only when ``experts`` is empty). ``activation`` "clamped_swiglu"
    (with ``alpha`` and ``limit``), experts carrying biases and ``weight_on_input`` (the
    weight scales each expert's input, its output is added unweighted: Llama 4) run
    col_moe_experts_ffn."""
    if experts:
        first = experts[0]
        t, dim, ffn = first.type, first.dim, first.ffn
        if any(e.type is not t or e.dim != dim or e.ffn != ffn for e in experts):
            raise InvalidArgumentError("experts must all have the same type and shape")
    else:
        t, dim, ffn = _as_type(type_), _as_count(dim, "dim"), _as_count(ffn, "ffn")
    n_experts = len(experts)
    x = _f32_matrix(x, "x", cols=dim)
    n_tok = x.shape[0]
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n_tok, dim) or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise InvalidArgumentError(f"out must be a writable C-contiguous float32 ({n_tok}, {dim}) array")
    expert_of = np.ascontiguousarray(expert_of, dtype=np.int32)
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if expert_of.ndim != 2 or expert_of.shape[0] != n_tok or weight.shape != expert_of.shape:
        raise InvalidArgumentError(f"expert_of and weight must both be ({n_tok}, A), got {expert_of.shape} and {weight.shape}")
    # entries outside [-1, E) are refused by libcolibri before it writes anything (COL_EINVAL)
    ptrs = (ctypes.c_void_p * (3 * max(n_experts, 1)))()
    ptrs[:3 * n_experts] = [e.gate for e in experts] + [e.up for e in experts] + [e.down for e in experts]
    base = ctypes.addressof(ptrs)
    size = ctypes.sizeof(ctypes.c_void_p) * n_experts
    kind = _expert_ffn(experts, activation, alpha, limit, weight_on_input)
    if kind is None:
        status = _lib().col_moe_experts(_pool_handle(pool), int(t), n_experts, base, base + size, base + 2 * size, dim, ffn,
                                        _ptr(x), n_tok, _ptr(expert_of), _ptr(weight), expert_of.shape[1], _ptr(out))
    else:
        status = _lib().col_moe_experts_ffn(_pool_handle(pool), ctypes.addressof(kind[0]), int(t), n_experts, base,
                                            base + size, base + 2 * size, dim, ffn, _ptr(x), n_tok, _ptr(expert_of),
                                            _ptr(weight), expert_of.shape[1], _ptr(out))
    if status:
        raise status_error(status, f"moe_experts {t.name_in_pack}")


def _expert_ffn(experts: "list[ExpertBuffers]", activation: str, alpha: float, limit: float, weight_on_input: bool):
    """(col_expert_ffn, the bias pointer arrays it points into), or None for plain SwiGLU
    experts without biases, weighted at the output (col_moe_experts)."""
    if activation not in EXPERT_ACTIVATION_CODES:
        raise InvalidArgumentError(f"activation must be one of {', '.join(EXPERT_ACTIVATION_CODES)}, got {activation!r}")
    with_bias = [e.gate_bias is not None for e in experts]
    if any(with_bias) and not all(with_bias):
        raise InvalidArgumentError("either every expert of a call has biases or none has")
    if activation == "swiglu" and not any(with_bias) and not weight_on_input:
        return None
    kind = ExpertFfn(activation=EXPERT_ACTIVATION_CODES[activation], alpha=float(alpha), limit=float(limit),
                     weight_on_input=int(bool(weight_on_input)))
    arrays = []
    if any(with_bias):
        for field in ("gate_bias", "up_bias", "down_bias"):
            array = (ctypes.c_void_p * len(experts))(*[getattr(e, field) for e in experts])
            arrays.append(array)
            setattr(kind, field, ctypes.addressof(array))
    return kind, arrays


def draw_cumulative(probabilities: np.ndarray, u: float) -> int:
    """Replaces float64 ``probabilities`` (N,) (>= 0, contiguous) with their running sums and
    returns how many of those are <= u * their total: np.cumsum then np.searchsorted(...,
    side="right"), bit for bit, in a quarter of the time."""
    if not isinstance(probabilities, np.ndarray) or probabilities.dtype != np.float64 or probabilities.ndim != 1 \
            or not probabilities.flags.c_contiguous or not probabilities.flags.writeable or probabilities.size < 1:
        raise InvalidArgumentError("probabilities must be a writable, contiguous, non-empty float64 vector")
    position = ctypes.c_int64(0)
    check(_lib().col_draw_cumulative(_ptr(probabilities), probabilities.size, float(u), ctypes.byref(position)),
          "draw_cumulative")
    return position.value


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of float32 ``x`` (..., N) with ``weight`` (N); float32 throughout."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim < 1:
        raise InvalidArgumentError("x must be a float32 array")
    n = x.shape[-1]
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if w.shape != (n,):
        raise InvalidArgumentError(f"weight must have shape ({n},), got {w.shape}")
    xc = np.ascontiguousarray(x)
    y = np.empty_like(xc)
    rows = xc.size // n if n else 0
    check(_lib().col_rms_norm(_ptr(xc), _ptr(w), rows, n, float(eps), _ptr(y)), "rms_norm")
    return y


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u elementwise for float32 arrays of one shape, as the fused expert call
    computes it on the active kernel level (see col_silu_mul)."""
    return _gated(g, u, "col_silu_mul")


def gelu_tanh_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gelu_tanh(g) * u elementwise (transformers' gelu_pytorch_tanh gating) for float32 arrays
    of one shape, as the fused expert call computes it on the active level (see col_gelu_tanh_mul)."""
    return _gated(g, u, "col_gelu_tanh_mul")


def _gated(g: np.ndarray, u: np.ndarray, function: str) -> np.ndarray:
    for name, a in (("g", g), ("u", u)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise InvalidArgumentError(f"{name} must be a float32 array")
    if g.shape != u.shape:
        raise InvalidArgumentError(f"g and u must have the same shape, got {g.shape} and {u.shape}")
    g, u = np.ascontiguousarray(g), np.ascontiguousarray(u)
    h = np.empty_like(g)
    check(getattr(_lib(), function)(_ptr(g), _ptr(u), _ptr(h), g.size), function)
    return h


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half rotary embedding of float32 ``x`` (T, H, Hd) by cos/sin (T, Hr): the first
    Hr <= Hd dims of each head rotate, the rest pass through (partial rotary when Hr < Hd);
    returns a new array."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 3:
        raise InvalidArgumentError("x must be a float32 (T, H, Hd) array")
    T, H, Hd = x.shape
    cos, sin = _f32_matrix(cos, "cos"), _f32_matrix(sin, "sin")
    Hr = cos.shape[1]
    if cos.shape != (T, Hr) or sin.shape != (T, Hr) or Hr > Hd:
        raise InvalidArgumentError(f"cos and sin must be ({T}, Hr) with Hr <= {Hd}, got {cos.shape}, {sin.shape}")
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    check(_lib().col_rope_partial(_ptr(y), T, H, Hd, Hr, _ptr(cos), _ptr(sin)), "rope")
    return y


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, window: int | None,
              scale: float, pool: "ThreadPool | None" = None, *, chunk: int | None = None,
              ring: bool = False) -> np.ndarray:
    """Causal GQA, optionally sliding-window (``window``) or chunked-local (``chunk``):
    ``q`` (Tq, H, Hd), ``keys``/``values`` (S, K, Hd) float32, ``positions`` (Tq) ints; returns
    (Tq, H*Hd) float32. ``ring``: keys/values are a ring buffer of S rows holding key position
    p in row p % S (see col_attention)."""
    for name, a in (("q", q), ("keys", keys), ("values", values)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 3:
            raise InvalidArgumentError(f"{name} must be a 3-D float32 array")
    Tq, H, Hd = q.shape
    S, K = keys.shape[0], keys.shape[1]
    if keys.shape != (S, K, Hd) or values.shape != keys.shape or K == 0 or H % K:
        raise InvalidArgumentError(f"keys/values must be (S, K, {Hd}) with H % K == 0, got {keys.shape}, {values.shape}")
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    if pos.shape != (Tq,):
        raise InvalidArgumentError(f"positions must have shape ({Tq},)")
    q, keys, values = np.ascontiguousarray(q), np.ascontiguousarray(keys), np.ascontiguousarray(values)
    out = np.empty((Tq, H * Hd), dtype=np.float32)
    check(_lib().col_attention(_pool_handle(pool), _ptr(q), _ptr(keys), _ptr(values), Tq, S, H, K, Hd, _ptr(pos),
                               int(window or 0), int(chunk or 0), S if ring else 0, float(scale), _ptr(out)),
          "attention")
    return out


# --------------------------------------------------------------------------------------------
# MoE routing
# --------------------------------------------------------------------------------------------


def moe_route(type_: TensorType | int | str, data, n_experts: int, dim: int, x: np.ndarray, top_k: int,
              normalize: bool, pool: "ThreadPool | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """A MoE router (see col_moe_route): ``data`` the router (E, D) encoded as ``type_``,
    ``x`` float32 (T, D). Returns (experts int32 (T, A), weights float32 (T, A)): per token
    the top_k experts of the softmax over x @ router^T, best first (lower index on ties),
    and their probabilities, renormalised to sum 1 if ``normalize``."""
    t = _as_type(type_)
    n_experts, dim, top_k = _as_count(n_experts, "n_experts"), _as_count(dim, "dim"), _as_count(top_k, "top_k")
    if not 1 <= top_k <= n_experts:
        raise InvalidArgumentError(f"top_k must be in [1, {n_experts}], got {top_k}")
    raw = _matrix_bytes(data, "router", t, n_experts, dim)
    x = _f32_matrix(x, "x", cols=dim)
    n_tok = x.shape[0]
    experts = np.empty((n_tok, top_k), dtype=np.int32)
    weights = np.empty((n_tok, top_k), dtype=np.float32)
    status = _lib().col_moe_route(_pool_handle(pool), int(t), _ptr(raw), n_experts, dim, _ptr(x), n_tok, top_k,
                                  int(bool(normalize)), _ptr(experts), _ptr(weights))
    if status:
        raise status_error(status, f"moe_route {t.name_in_pack}")
    return experts, weights


ROUTER_SCORING_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2, "topk_sigmoid": 3}  # enum col_router_scoring
GROUP_SCORE_CODES = {"max": 0, "top2_sum": 1}  # enum col_group_score


@mirrors_c_struct("col_moe_router_size")
class MoeRouter(ctypes.Structure):
    """Mirror of col_moe_router (colibri.h); its size is checked against C at load. Build it
    with moe_router(), which checks every size once and keeps the arrays it points into alive."""

    _fields_ = [
        ("n_experts", ctypes.c_int64), ("dim", ctypes.c_int64), ("top_k", ctypes.c_int64),
        ("n_groups", ctypes.c_int64), ("groups_kept", ctypes.c_int64),
        ("type", ctypes.c_int32), ("scoring", ctypes.c_int32), ("group_score", ctypes.c_int32),
        ("normalize", ctypes.c_int32), ("scaling", ctypes.c_float),
        ("weight", ctypes.c_void_p), ("choice_bias", ctypes.c_void_p), ("logit_bias", ctypes.c_void_p),
        ("expert_scale", ctypes.c_void_p),
    ]


def moe_router(type_: TensorType | int | str, data, n_experts: int, dim: int, top_k: int, *, normalize: bool,
               scoring: str = "softmax", choice_bias: np.ndarray | None = None, n_groups: int = 1,
               groups_kept: int = 1, group_score: str = "max", scaling: float = 1.0,
               logit_bias: np.ndarray | None = None, expert_scale: np.ndarray | None = None) -> MoeRouter:
    """A MoE layer's router for moe_router_route() (see col_moe_router_route): ``data`` the
    router (E, D) encoded as ``type_``, read in place; ``choice_bias``, ``logit_bias`` and
    ``expert_scale`` float32 (E) or None."""
    t = _as_type(type_)
    n_experts, dim, top_k = _as_count(n_experts, "n_experts"), _as_count(dim, "dim"), _as_count(top_k, "top_k")
    n_groups, groups_kept = _as_count(n_groups, "n_groups"), _as_count(groups_kept, "groups_kept")
    if scoring not in ROUTER_SCORING_CODES or group_score not in GROUP_SCORE_CODES:
        raise InvalidArgumentError(f"scoring must be one of {', '.join(ROUTER_SCORING_CODES)} and group_score one of "
                                   f"{', '.join(GROUP_SCORE_CODES)}, got {scoring!r}, {group_score!r}")
    if n_experts == 0 or n_groups == 0 or n_experts % n_groups or not 1 <= groups_kept <= n_groups:
        raise InvalidArgumentError(f"{n_experts} experts in {n_groups} groups, {groups_kept} kept: need groups that "
                                   "divide the experts and 1 <= kept <= groups")
    if not 1 <= top_k <= groups_kept * (n_experts // n_groups):
        raise InvalidArgumentError(f"top_k must be in [1, {groups_kept * (n_experts // n_groups)}], got {top_k}")
    if group_score == "top2_sum" and n_groups > 1 and n_experts // n_groups < 2:
        raise InvalidArgumentError("top2_sum group scores need at least two experts per group")
    if not np.isfinite(scaling):
        raise InvalidArgumentError(f"scaling must be finite, got {scaling}")
    raw = _matrix_bytes(data, "router", t, n_experts, dim)
    keep = [raw]
    router = MoeRouter(n_experts=n_experts, dim=dim, top_k=top_k, n_groups=n_groups, groups_kept=groups_kept, type=int(t),
                       scoring=ROUTER_SCORING_CODES[scoring], group_score=GROUP_SCORE_CODES[group_score],
                       normalize=int(bool(normalize)), scaling=float(scaling), weight=_ptr(raw))
    if choice_bias is not None:
        keep.append(_f32_vector(choice_bias, "choice_bias", n_experts))
        router.choice_bias = _ptr(choice_bias)
    if logit_bias is not None:
        keep.append(_f32_vector(logit_bias, "logit_bias", n_experts))
        router.logit_bias = _ptr(logit_bias)
    if expert_scale is not None:
        keep.append(_f32_vector(expert_scale, "expert_scale", n_experts))
        router.expert_scale = _ptr(expert_scale)
    router._keep = keep  # the buffers the pointers point into
    return router


def moe_router_route(router: MoeRouter, x: np.ndarray, pool: "ThreadPool | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """Route every token of ``x`` float32 (T, D): (experts int32 (T, A) best first, weights
    float32 (T, A)), one libcolibri call (see col_moe_router_route)."""
    if not isinstance(router, MoeRouter) or not hasattr(router, "_keep"):
        raise InvalidArgumentError("router must come from moe_router()")
    x = _f32_matrix(x, "x", cols=router.dim)
    n_tok = x.shape[0]
    experts = np.empty((n_tok, router.top_k), dtype=np.int32)
    weights = np.empty((n_tok, router.top_k), dtype=np.float32)
    status = _lib().col_moe_router_route(_pool_handle(pool), ctypes.addressof(router), _ptr(x), n_tok, _ptr(experts),
                                         _ptr(weights))
    if status:
        raise status_error(status, "moe_router_route")
    return experts, weights

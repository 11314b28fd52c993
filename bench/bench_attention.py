"""One decode token's attention block at a long context, against this machine's memory: the
layer's weights and its KV cache are read once a token, so their bytes over the read bandwidth
measured in the same run is the fastest the step can be.

Two shapes of attention (q8_0 weights, head dim 128, hidden 2048), each over a float32 and a
float16 cache (kv_cache_type):
- mha: OLMoE-1B-7B's, 16 query heads over 16 kv heads;
- gqa: Qwen3-30B-A3B's, 32 query heads over 4 kv heads (groups of 8 share a kv head).

Not a test; the machine should be quiet. Best of --repeat steps, each through 1.5 GB of layers:

    python bench/bench_attention.py
    python bench/bench_attention.py --context 1000 --context 4000 --threads 1 --kv-cache-type f16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from colibrid import native  # noqa: E402
from colibrid.engine.forward.model import KV_CACHE_DTYPES  # noqa: E402
from colibrid.native import TensorType  # noqa: E402
from machine import cpu_model, memory_bandwidth  # noqa: E402

D, HEAD_DIM = 2048, 128
SHAPES = {"mha": (16, 16), "gqa": (32, 4)}  # (query heads, kv heads)
ROTATION = 1_500_000_000  # bytes of layers a step runs through


def step_ms(n_heads: int, n_kv_heads: int, context: int, kv_type: str, pool, repeat: int) -> tuple[float, int]:
    """(best ms per layer of a decode step, bytes a layer reads: its weights and its KV cache up
    to context). A step runs through as many layers, each with its own copy of the weights and
    its own cache, as make ROTATION bytes, so no layer is still in the caches (this Xeon has a
    260 MB L3) when the next step comes back to it."""
    rng = np.random.default_rng(0)

    def gaussian(shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = TensorType.Q8_0
    Q, KV = n_heads * HEAD_DIM, n_kv_heads * HEAD_DIM
    weights = [native.quantize(t, gaussian(shape)) for shape in ((Q, D), (KV, D), (KV, D), (D, Q))]
    dtype = KV_CACHE_DTYPES[kv_type]
    read = sum(w.nbytes for w in weights) + 2 * (context + 1) * KV * np.dtype(dtype).itemsize
    layers = []
    for _ in range(-(-ROTATION // read)):
        w = [m.copy() for m in weights]
        layer = native.attention_layer(D, n_heads, n_kv_heads, HEAD_DIM, np.ones(D, np.float32), t, *w[:3], t, w[3],
                                       eps=1e-5, scale=HEAD_DIM ** -0.5)
        cache = tuple(gaussian((context + 1, n_kv_heads, HEAD_DIM), 1.0).astype(dtype) for _ in range(2))
        layers.append((layer, w, cache))
    angles = gaussian((1, HEAD_DIM), 1.0)
    cos, sin = np.cos(angles), np.sin(angles)
    x = gaussian((1, D), 1.0)
    best = float("inf")
    for _ in range(repeat + 1):  # the first pass pages everything in
        t0 = time.perf_counter()
        for layer, _, (keys, values) in layers:  # the same position each step: the reads do not grow
            native.attention_block(layer, x.copy(), cos, sin, keys, values, context, pool=pool)
        best = min(best, (time.perf_counter() - t0) / len(layers))
    return best * 1e3, read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, action="append", help="keys before the token (default 1000 and 4000)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--kv-cache-type", action="append", choices=list(KV_CACHE_DTYPES),
                        help="the cache's element type (default both)")
    args = parser.parse_args()
    contexts, kv_types = args.context or [1000, 4000], args.kv_cache_type or list(KV_CACHE_DTYPES)
    pool = native.ThreadPool(args.threads)
    bandwidth = memory_bandwidth(args.threads)
    print(f"{cpu_model()}; kernels {native.kernels()}; {args.threads} thread(s); memory read bandwidth "
          f"{bandwidth:.1f} GB/s")
    print(f"{'shape':5} {'heads':>7} {'context':>7} {'kv':>3} {'MB read':>8} {'ms/step':>8} {'roof ms':>8} "
          f"{'% roof':>6}")
    for name, (n_heads, n_kv_heads) in SHAPES.items():
        for context in contexts:
            for kv_type in kv_types:
                ms, read = step_ms(n_heads, n_kv_heads, context, kv_type, pool, args.repeat)
                roof = read / (bandwidth * 1e9) * 1e3
                print(f"{name:5} {n_heads:>3}/{n_kv_heads:<3} {context:>7} {kv_type:>3} {read / 1e6:8.1f} {ms:8.3f} "
                      f"{roof:8.3f} {100 * roof / ms:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark of the integer kernels at MoE shapes: col_matmul of a (D, D) weight over a
512-token prompt and over one token, and one MoE layer's fused expert call over a 512-token
prompt (every expert gets T * top_k / E tokens on average, the random routing of a prompt).
``--only batch``: a matrix too large for the caches over 1, 2, 3, 4 and 8 tokens, as a decode
batch's attention and head products run: where the product stops being bound by memory and
becomes bound by its arithmetic (each token costs its multiply-adds, the weights are read once).

Not a test; the machine should be quiet. Best of --repeat runs, milliseconds of CPU time per
call (so use one thread, the default); pin it with taskset for stable numbers:

    taskset -c 0 python bench/bench_matmul.py --kernels avx2
    taskset -c 0 python bench/bench_matmul.py --kernels avx2 --only moe --quant q4_g64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from colibrid import native  # noqa: E402
from colibrid.native import TensorType  # noqa: E402

D, PROMPT = 2048, 512
# (name, experts, top-k, expert ffn): the experts of one layer
MOE_SHAPES = [("olmoe", 64, 8, 1024), ("qwen3_moe", 128, 8, 768), ("qwen3_5_moe", 256, 8, 512)]


def best_ms(fn, repeat: int) -> float:
    """The best of `repeat` calls in CPU time of this process (one thread: its compute time,
    which a shared machine's other processes do not inflate as much as wall time)."""
    fn()  # warm: page faults, caches
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * min(times)


def bench_matmul(t: TensorType, pool, repeat: int) -> None:
    rng = np.random.default_rng(0)
    w = native.quantize(t, (rng.standard_normal((D, D)) * 0.05).astype(np.float32))
    x = rng.standard_normal((PROMPT, D)).astype(np.float32)
    ms = best_ms(lambda: native.matmul(t, w, D, D, x, pool=pool), repeat)
    gops = 2 * D * D * PROMPT / ms / 1e6
    print(f"matmul {t.name_in_pack:7s} ({D}, {D}) x {PROMPT} tokens: {ms:8.2f} ms  {gops:6.1f} GOP/s", flush=True)
    # decode: a matrix too large for the caches, one token (memory bound)
    rows = 16 * D
    big = native.quantize(t, (rng.standard_normal((rows, D)) * 0.05).astype(np.float32))
    ms = best_ms(lambda: native.matmul(t, big, rows, D, x[:1], pool=pool), repeat)
    gbs = big.nbytes / ms / 1e6
    print(f"matmul {t.name_in_pack:7s} ({rows}, {D}) x 1 token:    {ms:8.2f} ms  {gbs:6.1f} GB/s", flush=True)


def bench_decode_batch(t: TensorType, pool, repeat: int) -> None:
    rng = np.random.default_rng(2)
    rows = 16 * D
    big = native.quantize(t, (rng.standard_normal((rows, D)) * 0.05).astype(np.float32))
    one_ms = None
    for n_tok in (1, 2, 3, 4, 8):
        x = rng.standard_normal((n_tok, D)).astype(np.float32)
        ms = best_ms(lambda: native.matmul(t, big, rows, D, x, pool=pool), repeat)
        one_ms = one_ms or ms
        ns_per_64 = ms * 1e6 / (rows * D / 64 * n_tok)
        print(f"matmul {t.name_in_pack:7s} ({rows}, {D}) x {n_tok} tokens: {ms:8.2f} ms = {ms / one_ms:4.2f} x one token, "
              f"{big.nbytes / ms / 1e6:5.1f} GB/s, {ns_per_64:5.3f} ns per 64 weights and token", flush=True)


def bench_moe(t: TensorType, pool, repeat: int, shapes) -> None:
    rng = np.random.default_rng(1)
    for name, n_experts, top_k, ffn in shapes:
        experts = []
        for _ in range(n_experts):
            g, u = (rng.standard_normal((2, ffn, D)) * 0.05).astype(np.float32)
            d = (rng.standard_normal((D, ffn)) * 0.05).astype(np.float32)
            experts.append(native.ExpertBuffers(t, native.quantize(t, g), native.quantize(t, u), native.quantize(t, d), D, ffn))
        x = rng.standard_normal((PROMPT, D)).astype(np.float32)
        expert_of = np.argsort(rng.random((PROMPT, n_experts)), axis=1)[:, :top_k].astype(np.int32)
        weight = np.full((PROMPT, top_k), 1.0 / top_k, np.float32)
        out = np.zeros((PROMPT, D), np.float32)
        ms = best_ms(lambda: native.moe_experts_of(experts, x, expert_of, weight, out, pool=pool), repeat)
        gops = 2 * 3 * D * ffn * PROMPT * top_k / ms / 1e6
        print(f"moe    {t.name_in_pack:7s} {name:12s} E {n_experts} top-{top_k} F {ffn}, {PROMPT} tokens "
              f"({PROMPT * top_k // n_experts} per expert): {ms:8.2f} ms  {gops:6.1f} GOP/s", flush=True)
        step = iter(range(10**9))

        def decode() -> None:  # each call another token's experts: mostly not in cache, as in decode
            t = next(step) % PROMPT
            native.moe_experts_of(experts, x[t:t + 1], expert_of[t:t + 1], weight[t:t + 1], out[t:t + 1], pool=pool)

        ms = best_ms(lambda: [decode() for _ in range(20)], repeat) / 20
        print(f"moe    {t.name_in_pack:7s} {name:12s} 1 token: {ms:8.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default=None, help="kernel level (default: the best)")
    parser.add_argument("--quant", action="append", choices=["q8_0", "q4_g64"])
    parser.add_argument("--only", choices=["matmul", "moe", "batch"])
    parser.add_argument("--moe-shape", action="append", choices=[s[0] for s in MOE_SHAPES])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.kernels:
        native.set_kernels(args.kernels)
    pool = native.ThreadPool(1)
    shapes = [s for s in MOE_SHAPES if not args.moe_shape or s[0] in args.moe_shape]
    print(f"kernels {native.kernels()}, 1 thread, CPU ms per call")
    for q in args.quant or ["q8_0", "q4_g64"]:
        t = TensorType.from_name(q)
        if args.only in (None, "matmul"):
            bench_matmul(t, pool, args.repeat)
        if args.only in (None, "batch"):
            bench_decode_batch(t, pool, args.repeat)
        if args.only in (None, "moe"):
            bench_moe(t, pool, args.repeat, shapes)


if __name__ == "__main__":
    main()

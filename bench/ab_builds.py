"""Two or more libcolibri builds against each other in one process, alternating call by call.

On a shared machine the memory's speed drifts by up to 2x between runs minutes apart, so two
builds timed one after the other tell nothing about a change of a few percent. Here every
build is loaded at once and the engine's library is swapped before each measured call
(round-robin, the order reversed every round), so the drift falls on all of them alike; the
medians are printed side by side.

    python setup.py build_ext --inplace && cp colibrid/_libcolibri*.so /tmp/new.so
    git stash && python setup.py build_ext --inplace && cp colibrid/_libcolibri*.so /tmp/old.so && git stash pop
    python bench/ab_builds.py decode ~/.cache/colibri-bench/olmoe-q8_0.pack /tmp/old.so /tmp/new.so --threads 1
    python bench/ab_builds.py decode PACK OLD NEW --batch 8       # steps of 8 sequences
    python bench/ab_builds.py decode PACK OLD NEW --prompt 512    # a 512-token prefill
    python bench/ab_builds.py kernels OLD NEW --quant q4_g64      # cold one-token products
    python bench/ab_builds.py products OLD NEW --rows 512 --tokens 4,8,64 --threads 1   # several tokens
    python bench/ab_builds.py products OLD NEW --rows 2048 --tokens 1,8 --rotate-mb 1000  # ... from memory
    python bench/ab_builds.py attention OLD NEW --context 4000 --kv f32,f16  # a decode token's attention

``kernels`` times a one-token product of a 16384 x 2048 matrix and one fused expert call
(8 experts, D 2048, F 1024: OLMoE's), rotating through 2 GB of weights so nothing is cached.
``products`` times products of several tokens (a batch step's dense products, a prompt) with
one rows x 2048 matrix, the same every call: with 512 rows it stays in L2, which leaves the
arithmetic (and a kernel's repacking) alone; reported in microseconds a token. With --rotate-mb
each call takes the next of that many MB of copies, so the matrix comes from memory (as a
decode batch's attention and head products read theirs).
``attention`` times one decode token's attention block (q8_0 weights, head dim 128) of two
shapes, OLMoE's 16 query heads over 16 kv heads and Qwen3-30B-A3B's 32 over 4, at --context
keys, rotating through 1 GB (--rotate-mb) of caches of each type so none is in the caches.
The builds must come from the same tree apart from the change under test: the thread pool is
started by the first and used by all. COLIBRI_KERNELS applies to every build.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from colibrid import native  # noqa: E402
from colibrid.native import library  # noqa: E402


def load_builds(paths: list[Path]) -> list[tuple[str, object]]:
    """(name, loaded library) per build. Each is copied first: the dynamic loader maps one file
    once, so two builds must have two names."""
    builds, scratch = [], Path(tempfile.mkdtemp(prefix="colibri-ab-"))
    before = os.environ.get(library.LIBRARY_ENV)
    for i, path in enumerate(paths):
        copy = scratch / f"{i}-{path.name}"
        shutil.copy(path, copy)
        os.environ[library.LIBRARY_ENV] = str(copy)
        builds.append((f"{i}:{path.name}", library._load()))
    if before is None:
        del os.environ[library.LIBRARY_ENV]
    else:
        os.environ[library.LIBRARY_ENV] = before
    library._lib_handle = builds[0][1]
    return builds


def alternate(builds, rounds: int, call, warmup: int = 1) -> dict[str, list[float]]:
    """call(round) timed with each build active, round-robin, the order reversed every round;
    the first ``warmup`` rounds are not kept."""
    seconds: dict[str, list[float]] = {name: [] for name, _ in builds}
    for r in range(warmup + rounds):
        for name, lib in builds if r % 2 == 0 else builds[::-1]:
            library._lib_handle = lib
            t0 = time.perf_counter()
            call(r)
            if r >= warmup:
                seconds[name].append(time.perf_counter() - t0)
    library._lib_handle = builds[0][1]
    return seconds


def report(what: str, seconds: dict[str, list[float]], unit: str, scale) -> None:
    """Median (and quartiles) of each build, in ``unit`` = scale(seconds)."""
    cells = []
    for name, values in seconds.items():
        v = np.array([scale(s) for s in values])
        cells.append(f"{name} {np.median(v):.2f} [{np.percentile(v, 25):.2f}, {np.percentile(v, 75):.2f}]")
    print(f"{what} ({unit}, median [quartiles]): " + "   ".join(cells))


def run_decode(args, builds) -> None:
    from bench_kernels import ResidentExpertSource

    from colibrid.engine.engine import Engine
    from colibrid.engine.forward.model import StepInput
    from colibrid.pack.reader import Pack

    pack = Pack.open(args.pack)
    engine = Engine(pack, experts=ResidentExpertSource(pack))
    model, vocab = engine.model, engine.config.vocab_size
    n = len(builds)
    if args.prompt:
        prompt = np.random.default_rng(0).integers(1, vocab, args.prompt)
        seconds = alternate(builds, args.rounds, lambda r: engine.new_session(args.prompt + 8).forward(prompt, all_logits=False))
        report(f"{args.pack.name}, {args.threads} thread(s), {native.kernels()}: a {args.prompt}-token prefill",
               seconds, "ms", lambda s: 1e3 * s)
        return
    rows = max(args.batch, 1)
    sessions = [engine.new_session(n * (args.rounds + 1) + 8) for _ in range(rows)]
    tokens = list(range(1, rows + 1))

    def step(_r: int) -> None:
        logits = model.forward_batch([StepInput(s.state, np.array([t], np.int32), "last") for s, t in zip(sessions, tokens)])
        tokens[:] = [int(np.argmax(row[-1])) for row in logits]

    seconds = alternate(builds, args.rounds, step)
    what = f"steps of {rows} tokens" if args.batch else "decode tokens"
    report(f"{args.pack.name}, {args.threads} thread(s), {native.kernels()}: {what}", seconds, "ms", lambda s: 1e3 * s)


def run_kernels(args, builds) -> None:
    from colibrid.native.compute import ExpertBuffers, matmul, moe_experts_of, quantize

    D, F, E = 2048, 1024, 8
    rng = np.random.default_rng(0)
    parts = [quantize(args.quant, rng.standard_normal(shape, dtype=np.float32) * 0.05).reshape(-1)
             for shape in ((F, D), (F, D), (D, F))]
    record = np.concatenate(parts)
    n_records = int(2e9 // record.nbytes)
    area = mmap.mmap(-1, n_records * record.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    records = np.frombuffer(area, dtype=np.uint8).reshape(n_records, record.nbytes)
    records[:] = record
    g, u = parts[0].nbytes, parts[1].nbytes
    experts = [ExpertBuffers(args.quant, r[:g], r[g:g + u], r[g + u:], D, F) for r in records]
    x = rng.standard_normal((1, D), dtype=np.float32)
    expert_of, weight = np.arange(E, dtype=np.int32)[None, :], np.full((1, E), 1 / E, np.float32)
    out = np.zeros((1, D), np.float32)
    flat = records.reshape(-1)
    rows = 16384
    matrix_bytes = rows * parts[0].nbytes // F
    n_matrices = flat.nbytes // matrix_bytes
    turn = iter(range(10**9))  # a fresh matrix or set of experts for every call

    def product(_r: int) -> None:
        i = next(turn) % n_matrices
        matmul(args.quant, flat[i * matrix_bytes:(i + 1) * matrix_bytes], rows, D, x)

    def experts_call(_r: int) -> None:
        i = next(turn) * E
        moe_experts_of([experts[(i + k) % n_records] for k in range(E)], x, expert_of, weight, out)

    label = f"{args.threads} thread(s), {native.kernels()}, {args.quant}"
    report(f"{label}: cold {rows} x {D} product, one token", alternate(builds, args.rounds, product, warmup=4),
           "GB/s", lambda s: matrix_bytes / s / 1e9)
    report(f"{label}: cold fused call, {E} experts, one token", alternate(builds, args.rounds, experts_call, warmup=4),
           "GB/s", lambda s: E * record.nbytes / s / 1e9)


def run_products(args, builds) -> None:
    from colibrid.native.compute import matmul, quantize

    D = 2048
    rng = np.random.default_rng(0)
    w = quantize(args.quant, rng.standard_normal((args.rows, D), dtype=np.float32) * 0.05).reshape(-1)
    # --rotate-mb: copies of the matrix taken in turn, a fresh one every call, so that none is
    # in any cache (a decode batch's attention and head products read theirs from memory)
    n_copies = max(1, int(args.rotate_mb * 1e6 // w.nbytes))
    copies = np.empty((n_copies, w.nbytes), np.uint8)
    copies[:] = w
    turn = iter(range(10**9))
    where = f", {n_copies} copies in turn" if n_copies > 1 else ""
    label = f"{args.threads} thread(s), {native.kernels()}, {args.quant}"
    for n_tok in args.tokens:
        x = rng.standard_normal((n_tok, D), dtype=np.float32)
        seconds = alternate(builds, args.rounds,
                            lambda _r: matmul(args.quant, copies[next(turn) % n_copies], args.rows, D, x),
                            warmup=3 if n_copies == 1 else n_copies)
        report(f"{label}: {args.rows} x {D} product{where}, {n_tok} tokens", seconds, "us a token",
               lambda s, n=n_tok: s * 1e6 / n)


def run_attention(args, builds) -> None:
    from colibrid.engine.forward.model import KV_CACHE_DTYPES
    from colibrid.native import TensorType, attention_block, attention_layer, quantize

    D, HD = 2048, 128
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, D), dtype=np.float32)
    angles = rng.standard_normal((1, HD), dtype=np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    for shape, (heads, kv_heads) in (("OLMoE 16/16 heads", (16, 16)), ("Qwen3-30B-A3B 32/4 heads", (32, 4))):
        w = [quantize(TensorType.Q8_0, rng.standard_normal(s, dtype=np.float32) * 0.05)
             for s in ((heads * HD, D), (kv_heads * HD, D), (kv_heads * HD, D), (D, heads * HD))]
        layer = attention_layer(D, heads, kv_heads, HD, np.ones(D, np.float32), TensorType.Q8_0, *w[:3],
                                TensorType.Q8_0, w[3], eps=1e-5, scale=HD ** -0.5)
        for kv in args.kv:
            dtype = KV_CACHE_DTYPES[kv]
            shape_of = (args.context + 1, kv_heads, HD)
            n_caches = max(2, int(args.rotate_mb * 1e6 // (2 * np.prod(shape_of) * np.dtype(dtype).itemsize)))
            caches = [tuple(rng.standard_normal(shape_of, dtype=np.float32).astype(dtype) for _ in range(2))
                      for _ in range(n_caches)]
            turn = iter(range(10**9))  # a fresh cache every call

            def call(_r: int) -> None:
                keys, values = caches[next(turn) % n_caches]
                attention_block(layer, x.copy(), cos, sin, keys, values, args.context)

            report(f"{args.threads} thread(s), {native.kernels()}: {shape}, {args.context} keys, {kv} cache",
                   alternate(builds, args.rounds, call, warmup=n_caches), "ms", lambda s: 1e3 * s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    decode = sub.add_parser("decode", help="whole-model steps on a pack (fully in RAM)")
    decode.add_argument("pack", type=Path)
    decode.add_argument("builds", type=Path, nargs="+")
    decode.add_argument("--batch", type=int, default=0, help="steps of N sequences (0: one token at a time)")
    decode.add_argument("--prompt", type=int, default=0, help="time an N-token prefill instead")
    kernels = sub.add_parser("kernels", help="cold one-token products and fused expert calls")
    kernels.add_argument("builds", type=Path, nargs="+")
    kernels.add_argument("--quant", default="q8_0", choices=["q8_0", "q4_g64"])
    products = sub.add_parser("products", help="products of several tokens with a matrix kept in cache")
    products.add_argument("builds", type=Path, nargs="+")
    products.add_argument("--quant", default="q8_0", choices=["q8_0", "q4_g64"])
    products.add_argument("--rows", type=int, default=512, help="matrix rows (default 512: in L2)")
    products.add_argument("--tokens", type=lambda v: [int(n) for n in v.split(",")], default=[4, 8, 64],
                          help="tokens per product, comma-separated (default 4,8,64)")
    products.add_argument("--rotate-mb", type=float, default=0,
                          help="copies of the matrix to take in turn, so none is cached (default 0: one, in cache)")
    attention = sub.add_parser("attention", help="one decode token's attention block over a long context")
    attention.add_argument("builds", type=Path, nargs="+")
    attention.add_argument("--context", type=int, default=4000, help="keys before the token (default 4000)")
    attention.add_argument("--kv", type=lambda v: v.split(","), default=["f32", "f16"],
                           help="cache types, comma-separated (default f32,f16)")
    attention.add_argument("--rotate-mb", type=float, default=1000, help="caches of each type to rotate through")
    for p in (decode, kernels, products, attention):
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--rounds", type=int, default=0, help="measured calls per build (default: by mode)")
    args = parser.parse_args()
    if len(args.builds) < 2:
        parser.error("give two builds or more")
    args.rounds = args.rounds or (6 if args.mode == "decode" and args.prompt else 40 if args.mode == "decode" else 150)
    builds = load_builds(args.builds)
    native.configure_default_pool(n_threads=args.threads)
    {"decode": run_decode, "kernels": run_kernels, "products": run_products,
     "attention": run_attention}[args.mode](args, builds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

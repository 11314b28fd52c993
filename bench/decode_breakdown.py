"""Where a decode token's time goes: every libcolibri call is wrapped with a timer, the
rest is Python (wrappers, routing, numpy glue). Uses the packs bench_kernels.py builds.

    python bench/decode_breakdown.py ~/.cache/colibri-bench/olmoe-q4_g64.pack --threads 2
    python bench/decode_breakdown.py ~/.cache/colibri-bench/olmoe-4l-q8_0.pack --batch 8

With --prompt N, one N-token prompt is prefilled instead (in the daemon's steps of up to 512
tokens) and its time broken down the same way.

With --batch N, N sequences decode together through Model.forward_batch (one step = one
token of each), as the daemon's batch runs them, and each step's sampling (seeded,
temperature 1, as bench_serving asks) is timed on its own line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import ResidentExpertSource  # noqa: E402

CALLS = ("col_matmul", "col_moe_experts", "col_moe_experts_ffn", "col_attention_block", "col_attention_block_batch", "col_mla_block", "col_moe_route",
         "col_moe_router_route", "col_attention", "col_rms_norm", "col_rope", "col_rope_partial", "col_silu_mul",
         "col_get_rows")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=0, help="decode N sequences together (0: one, unbatched)")
    parser.add_argument("--prompt", type=int, default=0, help="break down the prefill of an N-token prompt instead")
    parser.add_argument("--context", type=int, default=0,
                        help="prompt tokens each sequence holds before decoding (bench_serving's prompts: ~128)")
    args = parser.parse_args()

    from colibrid import native
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    native.configure_default_pool(n_threads=args.threads)
    pack = Pack.open(args.pack)
    engine = Engine(pack, experts=ResidentExpertSource(pack))
    lib = native._lib()
    spent: dict[str, float] = {}
    for name in CALLS:
        fn = getattr(lib, name)

        def timed(*a, _fn=fn, _name=name):
            t0 = time.perf_counter()
            result = _fn(*a)
            spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0
            return result

        setattr(lib, name, timed)

    def prompt(seed: int) -> np.ndarray:
        """A different prompt for each sequence, as bench_serving's clients ask."""
        return np.random.default_rng(seed).integers(1, engine.model.config.vocab_size, args.context).astype(np.int32)

    def decode() -> float:
        session = engine.new_session(args.context + args.tokens + 8)
        if args.context:
            session.forward(prompt(0), all_logits=False)
            spent.clear()
        token = 1
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            token = int(np.argmax(session.forward([token], all_logits=False)[0]))
        return time.perf_counter() - t0

    def decode_batch() -> float:
        from colibrid.engine.forward.model import StepInput
        from colibrid.engine.sampling import Sampler
        from colibrid.wire.sampling_params import SamplingParams

        sessions = [engine.new_session(args.context + args.tokens + 8) for _ in range(args.batch)]
        if args.context:
            engine.model.forward_batch([StepInput(s.state, prompt(i), "last") for i, s in enumerate(sessions)])
            spent.clear()
        samplers = [Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i))
                    for i in range(args.batch)]
        tokens = list(range(1, args.batch + 1))
        history = np.zeros(args.context + args.tokens + 8, np.int64)
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            logits = engine.model.forward_batch([StepInput(s.state, np.array([t], np.int32), "last")
                                                 for s, t in zip(sessions, tokens)])
            t_sample = time.perf_counter()
            tokens = [sampler.sample(rows[-1], history).token_id for sampler, rows in zip(samplers, logits)]
            spent["sampling"] = spent.get("sampling", 0.0) + time.perf_counter() - t_sample
        return time.perf_counter() - t0

    def prefill() -> float:
        session = engine.new_session(args.prompt + 8)
        tokens = np.random.default_rng(0).integers(1, engine.model.config.vocab_size, args.prompt).astype(np.int32)
        t0 = time.perf_counter()
        session.forward(tokens, all_logits=False)
        return time.perf_counter() - t0

    run = prefill if args.prompt else decode_batch if args.batch else decode
    run()
    spent.clear()
    total = run()
    if args.prompt:  # the whole prompt, in ms
        scale, what, rate = 1e3, f"ms for a {args.prompt}-token prompt", args.prompt / total
    else:  # per step or token
        scale = 1e3 / args.tokens
        what = f"ms/step of {args.batch} tokens" if args.batch else "ms/token"
        rate = max(args.batch, 1) * args.tokens / total
    print(f"{args.pack.name}, {args.threads} thread(s), kernels {native.kernels()}: {scale * total:.2f} {what} "
          f"({rate:.1f} tok/s)")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:18s} {scale * seconds:8.2f} ms")
    print(f"  {'python / other':18s} {scale * (total - sum(spent.values())):8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

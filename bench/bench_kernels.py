"""Colibri vs llama.cpp on MoE-shaped models, fully cached: decode and prefill tokens/s at each
shape's quantizations, 1 and 2 threads, next to llama-bench on the same weights and this
machine's roofline (measured read bandwidth / active bytes per token).

Shapes (``--shape``, bench/shapes/): ``olmoe`` (OLMoE-1B-7B, the default), ``deepseek_v3``
(DeepSeek-V3's dimensions: MLA, 256 experts top-8, FP8 as published; 2 layers, vocab 32768)
``gpt_oss_20b`` (gpt-oss-20b's dimensions, MXFP4 experts on both sides; 8 of 24 layers) and
``qwen3_5_moe`` (Qwen3.5-35B-A3B's dimensions: three Gated DeltaNet layers to one gated
attention layer; 4 of 40 layers, vocab 32768).
``--layers`` changes a shape's depth. ``--isa avx2`` pairs COLIBRI_KERNELS=avx2 with a
llama.cpp built for AVX2 without AVX-512.

Not a test: the first run builds llama-bench and, under --work (default
~/.cache/colibri-bench), a random-weight checkpoint, packs and GGUFs (tens of GB), then
deletes the checkpoint (--keep-checkpoint keeps it); later runs reuse the files.

    python bench/bench_kernels.py                     # OLMoE, both quantizations, 1 and 2 threads
    python bench/bench_kernels.py --shape deepseek_v3 --isa avx2 --threads 2 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibrid.engine.experts.source import PlainExpertSource
from machine import cpu_model, memory_bandwidth
from shapes import SHAPES, Shape, Variant, log

REPO = Path(__file__).resolve().parent.parent
PROMPT_TOKENS, DECODE_TOKENS = 512, 128
ISAS = ("native", "avx2")  # llama.cpp build; Colibri: its best level, or COLIBRI_KERNELS=avx2


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


class ResidentExpertSource(PlainExpertSource):
    """Every expert record read once (CRC-checked) into RAM: the fully cached case."""

    def __init__(self, pack) -> None:
        import mmap

        from colibrid import native

        super().__init__(pack)
        # Transparent huge pages where the kernel allows them, as the AEPC slab will have:
        # streaming gigabytes through 4 KiB pages costs TLB misses neither side should pay.
        size = pack.manifest.experts_size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.data = np.frombuffer(self._map, dtype=np.uint8)  # (experts_size,)
        with open(pack.experts_path, "rb") as f:
            f.readinto(self._map)
        self._weights = {}
        for record in pack.manifest.expert_records:
            raw = self.data[record.offset : record.offset + record.length]
            if native.crc32c(raw) != record.crc32c:
                raise RuntimeError(f"checksum mismatch in expert {record.expert} of layer {record.layer}")
            self._weights[record.layer, record.expert] = pack.expert_weights(raw)

    def get(self, layer: int, expert: int):
        return self._weights[layer, expert]

    def summary(self) -> dict:
        """Everything was read at start: every lookup is a hit."""
        return {"kind": "resident", "hits": 0, "misses": 0, "bytes_read": self.pack.manifest.experts_size}


def active_bytes_per_token(pack) -> int:
    """Bytes a decode step reads: every dense tensor except the embedding table (one row),
    plus top-k experts per MoE layer."""
    m = pack.manifest
    c = m.model
    dense = sum(e.nbytes for name, e in m.dense_tensors.items() if name != "embed")
    embed = m.dense_tensors["embed"]
    dense += embed.nbytes // embed.shape[0]
    if c.tie_word_embeddings:
        dense += embed.nbytes
    expert = sum(part.nbytes for part in m.expert_parts.values())  # gate, up, down (and their biases)
    return dense + len(c.moe_layer_ids) * c.num_experts_per_tok * expert


def run_colibri(pack_dir: Path, threads: int, repeat: int, profile: bool, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """One configuration, in this (fresh) process."""
    from colibrid import native
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    native.configure_default_pool(n_threads=threads)
    pack = Pack.open(pack_dir)
    engine = Engine(pack, experts=ResidentExpertSource(pack))
    V = engine.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, prompt_tokens)

    def prefill() -> float:
        session = engine.new_session(prompt_tokens + 8)
        t0 = time.perf_counter()
        session.forward(prompt, all_logits=False)
        return prompt_tokens / (time.perf_counter() - t0)

    def decode() -> float:  # like llama-bench tg: from an empty context, one token at a time
        session = engine.new_session(DECODE_TOKENS + 8)
        token = int(prompt[0])
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            token = int(np.argmax(session.forward([token], all_logits=False)[0]))
        return DECODE_TOKENS / (time.perf_counter() - t0)

    decode()  # warm-up: page in the dense file, start the pool
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        decode()
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(14)
    dec = [decode() for _ in range(repeat)]
    pre = [prefill() for _ in range(repeat)]
    return {"decode_tok_s": max(dec), "prefill_tok_s": max(pre), "decode_all": dec, "prefill_all": pre,
            "kernels": native.kernels(), "active_bytes": active_bytes_per_token(pack)}


def run_llama_bench(binary: Path, gguf_path: Path, threads: int, repeat: int, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    cmd = [str(binary), "-m", str(gguf_path), "-p", str(prompt_tokens), "-n", str(DECODE_TOKENS), "-t", str(threads),
           "-r", str(repeat), "-o", "json"]
    log(" ".join(cmd))
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {"command": " ".join(cmd)}
    for row in result:
        key = "prefill_tok_s" if row["n_prompt"] else "decode_tok_s"
        out[key] = row["avg_ts"]
    return out


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def file_prefix(shape: Shape, layers: int) -> str:
    return shape.name if layers == shape.default_layers else f"{shape.name}-{layers}l"


def prepare(work: Path, shape: Shape, variants: list[Variant], layers: int, with_gguf: bool,
            keep_checkpoint: bool) -> dict[str, tuple[Path, Path]]:
    """(pack, GGUF) per variant, made from one random checkpoint (written first when a file is
    missing, deleted afterwards unless keep_checkpoint)."""
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant

    config = shape.hf_config(layers)
    prefix = file_prefix(shape, layers)
    legacy = shape.legacy_prefix is not None and layers == shape.default_layers
    checkpoint = work / (shape.legacy_prefix if legacy else f"{prefix}-checkpoint")
    files = {v.name: (work / f"{prefix}-{v.name}.pack", work / f"{prefix}-{v.gguf_label}.gguf") for v in variants}
    missing = [(v, pack, gguf_path) for v in variants for pack, gguf_path in [files[v.name]]
               if not (pack / "manifest.json").exists() or (with_gguf and not gguf_path.exists())]
    if missing and not (checkpoint / "model.safetensors.index.json").exists():
        tensors = shape.checkpoint_tensors(config)
        size_gb = sum(t.nbytes for t in tensors.values()) / 1e9
        log(f"writing the random {shape.name} checkpoint ({layers} layers, {size_gb:.1f} GB) to {checkpoint}")
        from shapes.common import write_checkpoint

        write_checkpoint(checkpoint, config, tensors)
    for variant, pack, gguf_path in missing:
        if not (pack / "manifest.json").exists():
            log(f"converting to {pack} (--quant {variant.quant})")
            convert(checkpoint, pack, parse_quant(variant.quant), force=True)
        if with_gguf and not gguf_path.exists():
            log(f"writing {gguf_path}")
            shape.write_gguf(checkpoint, gguf_path, variant, config)
    if checkpoint.exists() and not keep_checkpoint:
        log(f"deleting {checkpoint} (--keep-checkpoint keeps it)")
        shutil.rmtree(checkpoint)
    return files


def build_llama_bench(work: Path, isa: str, targets: tuple[str, ...] = ("llama-bench",)) -> Path:
    """The llama-bench binary (with ``targets`` built beside it in the same bin/) for ``isa``."""
    env = dict(os.environ, LLAMA_CPP_DIR=str(work / "llama.cpp"), LLAMA_CPP_ISA=isa, LLAMA_CPP_TARGETS=" ".join(targets))
    out = subprocess.run(["sh", str(REPO / "bench" / "build_llama_cpp.sh")], check=True, env=env,
                         stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "colibri-bench")
    parser.add_argument("--shape", choices=list(SHAPES), default="olmoe")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--quant", action="append", help="a variant of the shape (default: the shape's defaults); "
                        + "; ".join(f"{s.name}: {', '.join(v.name for v in s.variants)}" for s in SHAPES.values()))
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="avx2: COLIBRI_KERNELS=avx2 against llama.cpp built for AVX2 without AVX-512")
    parser.add_argument("--threads", action="append", type=int, help="default: 1 and 2")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is reported")
    parser.add_argument("--profile", action="store_true", help="cProfile one decode run (stderr)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help=f"the prefill measurement's prompt, both sides (default {PROMPT_TOKENS}; a long one "
                             "weighs attention over the prompt)")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--keep-checkpoint", action="store_true", help="keep the random checkpoint after converting")
    parser.add_argument("--prepare-only", action="store_true", help="build the files and llama-bench, measure nothing")
    parser.add_argument("--json", type=Path, help="also write the results here")
    # internal: one Colibri configuration in a child process
    parser.add_argument("--run-colibri", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_colibri:
        print(json.dumps(run_colibri(args.run_colibri, args.threads[0], args.repeat, args.profile, args.prompt_tokens)))
        return 0

    shape = SHAPES[args.shape]
    names = args.quant or list(shape.default_variants)
    unknown = [n for n in names if n not in {v.name for v in shape.variants}]
    if unknown:
        parser.error(f"--quant {unknown[0]} is not a variant of {shape.name} "
                     f"({', '.join(v.name for v in shape.variants)})")
    variants = [shape.variant(n) for n in names]
    layers = args.layers or shape.default_layers
    thread_counts = args.threads or [1, 2]
    args.work.mkdir(parents=True, exist_ok=True)
    # llama.cpp first: its tree carries the gguf package the GGUFs are written with
    llama_bench = None if args.skip_llama else build_llama_bench(args.work, args.isa)
    files = prepare(args.work, shape, variants, layers, not args.skip_llama, args.keep_checkpoint)
    if args.prepare_only:
        return 0

    results = []
    for variant in variants:
        pack, gguf_path = files[variant.name]
        for threads in thread_counts:
            bandwidth = memory_bandwidth(threads)
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
            if args.isa == "avx2":
                env["COLIBRI_KERNELS"] = "avx2"
            cmd = [sys.executable, __file__, "--run-colibri", str(pack), "--threads", str(threads), "--repeat", str(args.repeat),
                   "--prompt-tokens", str(args.prompt_tokens)]
            if args.profile:
                cmd.append("--profile")
            log(f"colibri {shape.name} {variant.name} {threads} thread(s)")
            ours = json.loads(subprocess.run(cmd, check=True, env=env, stdout=subprocess.PIPE, text=True).stdout)
            theirs = run_llama_bench(llama_bench, gguf_path, threads, args.repeat, args.prompt_tokens) if llama_bench else {}
            roofline = bandwidth * 1e9 / ours["active_bytes"]
            row = {"shape": shape.name, "layers": layers, "isa": args.isa, "quant": variant.name,
                   "gguf": variant.gguf_label, "threads": threads, "bandwidth_gb_s": bandwidth,
                   "active_mb_per_token": ours["active_bytes"] / 1e6, "roofline_tok_s": roofline, "colibri": ours,
                   "prompt_tokens": args.prompt_tokens, "llama_cpp": theirs}
            results.append(row)
            log(json.dumps(row))

    print(f"{shape.description}; {layers} layers; --isa {args.isa} (Colibri kernels: "
          f"{', '.join(sorted({r['colibri']['kernels'] for r in results}))}); {cpu_model()}; "
          f"prefill of {args.prompt_tokens} tokens")
    header = (f"{'quant':7} {'thr':>3} {'BW GB/s':>7} {'MB/tok':>7} {'roof t/s':>8} | {'decode':>7} {'llama':>7} {'ratio':>5} "
              f"{'%roof':>5} | {'prefill':>7} {'llama':>7} {'ratio':>5}")
    print(header)
    for r in results:
        o, t = r["colibri"], r["llama_cpp"]
        dec_l, pre_l = t.get("decode_tok_s", float("nan")), t.get("prefill_tok_s", float("nan"))
        print(f"{r['quant']:7} {r['threads']:>3} {r['bandwidth_gb_s']:7.1f} {r['active_mb_per_token']:7.0f} "
              f"{r['roofline_tok_s']:8.1f} | {o['decode_tok_s']:7.2f} {dec_l:7.2f} {o['decode_tok_s'] / dec_l:5.2f} "
              f"{100 * o['decode_tok_s'] / r['roofline_tok_s']:5.0f} | {o['prefill_tok_s']:7.1f} {pre_l:7.1f} "
              f"{o['prefill_tok_s'] / pre_l:5.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

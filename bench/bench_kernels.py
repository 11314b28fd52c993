"""Colibri vs llama.cpp on an OLMoE-1B-7B-shaped model, fully cached: decode and prefill
tokens/s at q8_0 and 4-bit, 1 and 2 threads, next to llama-bench on the same weights (GGUF
Q8_0 / Q4_0) and this machine's roofline (measured read bandwidth / active bytes per token).

Not a test: it builds ~40 GB of files under --work (default ~/.cache/colibri-bench) the
first time (random weights, a bf16 checkpoint, two packs, two GGUFs, llama-bench) and
reuses them afterwards.

    python bench/bench_kernels.py                     # everything, results as a table
    python bench/bench_kernels.py --threads 2 --quant q8_0 --repeat 2

Legend: T tokens, D hidden 2048, F expert ffn 1024, E 64 experts, A top-8, V 50304.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OLMOE_SHAPE = dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304)
WEIGHT_STD = 0.05
PROMPT_TOKENS, DECODE_TOKENS = 512, 128
# our pack type -> the nearest GGUF type
GGUF_TYPE = {"q8_0": "Q8_0", "q4_g64": "Q4_0"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The checkpoint: random weights in the Hugging Face OLMoE layout, bf16 safetensors shards
# --------------------------------------------------------------------------------------------


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    D, F, V, E = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_experts"]
    kv = c["num_key_value_heads"] * (D // c["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (D, D), p + "self_attn.k_proj.weight": (kv, D),
                   p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, D),
                   p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (kv,),
                   p + "mlp.gate.weight": (E, D)}
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (F, D), q + "up_proj.weight": (F, D), q + "down_proj.weight": (D, F)}
    return shapes


def random_tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic per name; norms are ones. Returned as bf16 bits (uint16)."""
    if len(shape) == 1:
        values = np.ones(shape, np.float32)
    else:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD)
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def write_checkpoint(directory: Path, config: dict, shard_bytes: int = 2 << 30) -> None:
    from colibrid.demo import write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    shapes = tensor_shapes(config)
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            n = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        header_bytes = json.dumps(header).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)
        with open(directory / (file + ".tmp"), "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for name in names:
                f.write(random_tensor(name, shapes[name]).tobytes())
        os.replace(directory / (file + ".tmp"), directory / file)
        log(f"checkpoint shard {i + 1}/{len(shards)}")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def read_checkpoint_tensor(directory: Path, name: str, index: dict) -> np.ndarray:
    """float32 values of one bf16 tensor of the checkpoint."""
    path = directory / index[name]
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_len))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        bits = np.frombuffer(f.read(end - begin), dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


# --------------------------------------------------------------------------------------------
# GGUF for llama.cpp, the same values
# --------------------------------------------------------------------------------------------


def write_gguf(checkpoint: Path, out: Path, gguf_type: str, config: dict) -> None:
    import gguf

    from colibrid import native

    qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    D, E, L = config["hidden_size"], config["num_experts"], config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out) + ".tmp", "olmoe")
    writer.add_context_length(4096)
    writer.add_embedding_length(D)
    writer.add_block_count(L)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(E)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gguf_type])
    # A placeholder SentencePiece vocabulary of the model's size: llama-bench feeds random ids.
    V = config["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"tok{i}" for i in range(V - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (V - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * V)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def quantize(values: np.ndarray) -> np.ndarray:
        if gguf_type == "Q8_0":  # colibri's q8_0 is byte-identical to ggml's Q8_0
            return native.quantize("q8_0", values.reshape(-1, values.shape[-1])).reshape(*values.shape[:-1], -1)
        return gguf.quants.quantize(values, qtype)

    def add(name: str, values: np.ndarray, quantized: bool) -> None:
        if quantized:
            writer.add_tensor(name, quantize(values), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values.astype(np.float32))

    t = lambda n: read_checkpoint_tensor(checkpoint, n, index)  # noqa: E731
    add("token_embd.weight", t("model.embed_tokens.weight"), True)
    add("output_norm.weight", t("model.norm.weight"), False)
    add("output.weight", t("lm_head.weight"), True)
    for layer in range(L):
        p = f"model.layers.{layer}."
        b = f"blk.{layer}."
        add(b + "attn_norm.weight", t(p + "input_layernorm.weight"), False)
        add(b + "ffn_norm.weight", t(p + "post_attention_layernorm.weight"), False)
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            add(b + theirs + ".weight", t(p + f"self_attn.{ours}.weight"), True)
        add(b + "attn_q_norm.weight", t(p + "self_attn.q_norm.weight"), False)
        add(b + "attn_k_norm.weight", t(p + "self_attn.k_norm.weight"), False)
        add(b + "ffn_gate_inp.weight", t(p + "mlp.gate.weight"), False)  # router f32, as in the pack
        for ours, theirs in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            stacked = np.stack([t(p + f"mlp.experts.{e}.{ours}.weight") for e in range(E)])  # (E, rows, cols)
            add(b + theirs + ".weight", stacked, True)
        log(f"gguf {gguf_type}: layer {layer + 1}/{L}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".tmp", out)


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


class ResidentExpertSource:
    """Every expert record read once (CRC-checked) into RAM: the fully cached case."""

    def __init__(self, pack) -> None:
        import mmap

        from colibrid import native

        self.pack = pack
        self.max_pinned = pack.manifest.model.num_experts
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

    def acquire(self, layer: int, experts):
        from contextlib import nullcontext

        return nullcontext({e: self._weights[layer, e] for e in experts})


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
    expert = sum(m.expert_parts[p].nbytes for p in ("gate", "up", "down"))
    return dense + len(c.moe_layer_ids) * c.num_experts_per_tok * expert


def run_colibri(pack_dir: Path, threads: int, repeat: int, profile: bool) -> dict:
    """One configuration, in this (fresh) process."""
    from colibrid import native
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    native.configure_default_pool(n_threads=threads)
    pack = Pack.open(pack_dir)
    engine = Engine(pack, experts=ResidentExpertSource(pack))
    V = engine.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, PROMPT_TOKENS)

    def prefill() -> float:
        session = engine.new_session(PROMPT_TOKENS + 8)
        t0 = time.perf_counter()
        session.forward(prompt, all_logits=False)
        return PROMPT_TOKENS / (time.perf_counter() - t0)

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


def run_llama_bench(binary: Path, gguf_path: Path, threads: int, repeat: int) -> dict:
    cmd = [str(binary), "-m", str(gguf_path), "-p", str(PROMPT_TOKENS), "-n", str(DECODE_TOKENS), "-t", str(threads),
           "-r", str(repeat), "-o", "json"]
    log(" ".join(cmd))
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {"command": " ".join(cmd)}
    for row in result:
        key = "prefill_tok_s" if row["n_prompt"] else "decode_tok_s"
        out[key] = row["avg_ts"]
    return out


def memory_bandwidth(threads: int, runs: int = 3) -> float:
    """Read bandwidth in GB/s with ``threads`` readers: the best of ``runs`` runs of
    bench/membw.c (each the best of 5 passes over 2 GiB)."""
    binary = Path("/tmp/colibri-membw")
    source = REPO / "bench" / "membw.c"
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-mavx2", "-pthread", str(source), "-o", str(binary)], check=True)
    return max(float(subprocess.run([str(binary), str(threads)], check=True, capture_output=True, text=True).stdout)
               for _ in range(runs))


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def prepare(work: Path, quants: list[str]) -> dict[str, tuple[Path, Path]]:
    from colibrid.convert.converter import convert
    from colibrid.convert.quant_spec import parse_quant

    config = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "norm_topk_prob": False, "eos_token_id": 0, "pad_token_id": 0, "bos_token_id": None, **OLMOE_SHAPE}
    checkpoint = work / "checkpoint"
    if not (checkpoint / "model.safetensors.index.json").exists():
        log(f"writing the random bf16 checkpoint to {checkpoint}")
        write_checkpoint(checkpoint, config)
    out = {}
    for quant in quants:
        pack = work / f"olmoe-{quant}.pack"
        if not (pack / "manifest.json").exists():
            log(f"converting to {pack}")
            convert(checkpoint, pack, parse_quant(quant), force=True)
        gguf_path = work / f"olmoe-{GGUF_TYPE[quant]}.gguf"
        if not gguf_path.exists():
            log(f"writing {gguf_path}")
            write_gguf(checkpoint, gguf_path, GGUF_TYPE[quant], config)
        out[quant] = (pack, gguf_path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "colibri-bench")
    parser.add_argument("--quant", action="append", choices=list(GGUF_TYPE), help="default: both")
    parser.add_argument("--threads", action="append", type=int, help="default: 1 and 2")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is reported")
    parser.add_argument("--profile", action="store_true", help="cProfile one decode run (stderr)")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--prepare-only", action="store_true", help="build the files and llama-bench, measure nothing")
    parser.add_argument("--json", type=Path, help="also write the results here")
    # internal: one Colibri configuration in a child process
    parser.add_argument("--run-colibri", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_colibri:
        print(json.dumps(run_colibri(args.run_colibri, args.threads[0], args.repeat, args.profile)))
        return 0

    quants, thread_counts = args.quant or list(GGUF_TYPE), args.threads or [1, 2]
    args.work.mkdir(parents=True, exist_ok=True)
    files = prepare(args.work, quants)
    if args.prepare_only:
        return 0
    llama_bench = None
    if not args.skip_llama:
        env = dict(os.environ, LLAMA_CPP_DIR=str(args.work / "llama.cpp"))
        llama_bench = Path(subprocess.run(["sh", str(REPO / "bench" / "build_llama_cpp.sh")], check=True, env=env,
                                          capture_output=True, text=True).stdout.strip().splitlines()[-1])

    results = []
    for quant in quants:
        pack, gguf_path = files[quant]
        for threads in thread_counts:
            bandwidth = memory_bandwidth(threads)
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
            cmd = [sys.executable, __file__, "--run-colibri", str(pack), "--threads", str(threads), "--repeat", str(args.repeat)]
            if args.profile:
                cmd.append("--profile")
            log(f"colibri {quant} {threads} thread(s)")
            ours = json.loads(subprocess.run(cmd, check=True, env=env, stdout=subprocess.PIPE, text=True).stdout)
            theirs = run_llama_bench(llama_bench, gguf_path, threads, args.repeat) if llama_bench else {}
            roofline = bandwidth * 1e9 / ours["active_bytes"]
            row = {"quant": quant, "gguf": GGUF_TYPE[quant], "threads": threads, "bandwidth_gb_s": bandwidth,
                   "active_mb_per_token": ours["active_bytes"] / 1e6, "roofline_tok_s": roofline, "colibri": ours,
                   "llama_cpp": theirs}
            results.append(row)
            log(json.dumps(row))

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

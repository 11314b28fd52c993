"""colibri-convert's speed in parameters per second, per output type, on a bf16 (and an FP8)
checkpoint with OLMoE-1B-7B shapes and fewer layers (~1 B parameters), next to this machine's
disk read and write bandwidth measured in the same run.

Not a test: the first run writes the checkpoints under --work (default
/tmp/colibri-bench-convert, ~3 GB; delete it afterwards). Every conversion runs in a fresh
process (`python -m colibrid.tools.convert.cli SRC OUT --quant TYPE --threads N --quiet`), with the
checkpoint in the page cache (one warm-up read), so the rate is the converter's, not the
disk's; the disk's bandwidth is measured separately with O_DIRECT and printed next to it.

    python bench/bench_convert.py                                   # every type, 1 and 2 threads
    python bench/bench_convert.py --type q4_g64 --threads 2
    python bench/bench_convert.py --repo /tmp/old-main --threads 1  # another checkout's converter

Legend: D hidden 2048, F expert ffn 1024, E 64 experts, V 50304.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from shapes import olmoe  # noqa: E402
from shapes.common import log, write_checkpoint  # noqa: E402

LAYERS = 2  # of the OLMoE-1B-7B shape: ~1.05 B parameters, 2.1 GB of bf16


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    return {name: spec.shape for name, spec in olmoe.checkpoint_tensors(config).items()}
# (name, --quant, source checkpoint)
CASES = {
    "q8_0": ("q8_0", "bf16"),
    "q4_g64": ("q4_g64", "bf16"),
    "mxfp4": ("experts=mxfp4,dense=q8_0,embeddings=q8_0", "bf16"),
    "bf16": ("bf16", "bf16"),
    "f16": ("f16", "bf16"),
    "fp8-q4_g64": ("q4_g64", "fp8"),
}
FP8_BLOCK = 128
CHUNK_BYTES = 8 << 20


def config() -> dict:
    return olmoe.hf_config(LAYERS)


def write_fp8_checkpoint(bf16: Path, out: Path) -> None:
    """The bf16 checkpoint's matrices as float8_e4m3fn codes with 128 x 128 block scales
    (DeepSeek-V3's layout; random codes: the converter's speed does not depend on them);
    vectors stay bf16."""
    out.mkdir(parents=True, exist_ok=True)
    for f in bf16.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    shapes = tensor_shapes(cfg)
    rng = np.random.default_rng(8)
    header, offset, weight_map = {}, 0, {}
    parts = []
    for name, shape in shapes.items():
        if len(shape) == 1:
            parts.append((name, "BF16", shape, np.ones(shape, np.float32).view(np.uint32).__rshift__(16).astype(np.uint16)))
            continue
        codes = rng.integers(0, 0x7E, shape, dtype=np.uint8) | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)
        grid = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
        scale = rng.uniform(1e-4, 3e-4, grid).astype(np.float32)
        parts += [(name, "F8_E4M3", shape, codes), (name + "_scale_inv", "F32", grid, scale)]
    for name, dtype, shape, array in parts:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        weight_map[name] = "model.safetensors"
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(out / "model.safetensors.tmp", "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for _, _, _, array in parts:
            f.write(np.ascontiguousarray(array).tobytes())
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def prepare(work: Path) -> dict[str, Path]:
    bf16, fp8 = work / "checkpoint-bf16", work / "checkpoint-fp8"
    if not (bf16 / "model.safetensors.index.json").is_file():
        log(f"writing {bf16}")
        write_checkpoint(bf16, config(), olmoe.checkpoint_tensors(config()))
    if not (fp8 / "model.safetensors.index.json").is_file():
        log(f"writing {fp8}")
        write_fp8_checkpoint(bf16, fp8)
    return {"bf16": bf16, "fp8": fp8}


def n_params(checkpoint: Path) -> int:
    shapes = tensor_shapes(json.loads((checkpoint / "config.json").read_text()))
    return sum(int(np.prod(s)) for s in shapes.values())


def read_all(checkpoint: Path) -> None:
    """Puts the checkpoint in the page cache (the conversions then measure the converter)."""
    for f in sorted(checkpoint.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(CHUNK_BYTES):
                pass


def disk_read_gbps(path: Path) -> float:
    """O_DIRECT sequential read of ``path`` in 8 MiB requests (past the page cache)."""
    buf = mmap.mmap(-1, CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        started, total = time.perf_counter(), 0
        while n := os.readv(fd, [buf]):
            total += n
            if n < CHUNK_BYTES:
                break
        return total / (time.perf_counter() - started) / 1e9
    finally:
        os.close(fd)


def disk_write_gbps(directory: Path, nbytes: int = 1 << 30) -> float:
    """O_DIRECT sequential write of ``nbytes`` in 8 MiB requests, then fsync."""
    buf = mmap.mmap(-1, CHUNK_BYTES)
    buf.write(np.random.default_rng(0).integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes())
    path = directory / "write-test.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        started = time.perf_counter()
        for _ in range(nbytes // CHUNK_BYTES):
            os.writev(fd, [buf])
        os.fsync(fd)
        return nbytes / (time.perf_counter() - started) / 1e9
    finally:
        os.close(fd)
        path.unlink()


def run_convert(repo: Path, checkpoint: Path, out: Path, quant: str, threads: int | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the process and its threads) of one
    conversion in a fresh process (output deleted afterwards). On a machine shared with other
    work the CPU seconds still say what the conversion costs: parameters per CPU second is the
    per-core rate."""
    cmd = [sys.executable, "-m", "colibrid.tools.convert.cli", str(checkpoint), str(out), "--quant", quant, "--force", "--quiet"]
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=str(repo))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=repo)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_description() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    level = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    return f"{name}, {os.cpu_count()} CPUs, {level}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/colibri-bench-convert"))
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose converter runs (default: this one)")
    parser.add_argument("--type", action="append", choices=list(CASES), help="default: all")
    parser.add_argument("--threads", action="append", type=int,
                        help="default: 1 and 2; 0 runs without --threads (a converter that has no such option)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    checkpoints = prepare(args.work)
    results = {"cpu": cpu_description(), "repo": str(args.repo), "runs": []}
    log(results["cpu"])
    log(f"load average before: {os.getloadavg()[0]:.1f}")
    results["disk_read_GBps"] = disk_read_gbps(next(checkpoints["bf16"].glob("*.safetensors")))
    results["disk_write_GBps"] = disk_write_gbps(args.work)
    log(f"disk: read {results['disk_read_GBps']:.2f} GB/s, write {results['disk_write_GBps']:.2f} GB/s (O_DIRECT, 8 MiB)")
    for case in args.type or list(CASES):
        quant, source = CASES[case]
        checkpoint = checkpoints[source]
        read_all(checkpoint)
        params = n_params(checkpoint)
        for threads in args.threads or [1, 2]:
            seconds, cpu_seconds = run_convert(args.repo, checkpoint, args.work / "out.pack", quant, threads)
            rate, per_core = params / seconds / 1e6, params / cpu_seconds / 1e6
            results["runs"].append(dict(type=case, source=source, threads=threads, params=params, seconds=seconds,
                                        cpu_seconds=cpu_seconds, mparams_per_s=rate, mparams_per_cpu_s=per_core))
            print(f"{case:12s} from {source:4s} threads={threads}  {params / 1e9:.3f} B params in {seconds:6.1f} s"
                  f" = {rate:6.1f} M params/s;  {cpu_seconds:6.1f} CPU s = {per_core:6.1f} M params per CPU second",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

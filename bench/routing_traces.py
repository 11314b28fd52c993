"""Routing traces of real generations: the trained default model, greedy, on held-out text.

    python bench/routing_traces.py bench/traces/stdlib-greedy.jsonl
    python bench/routing_traces.py /tmp/long.jsonl --sequences 32 --prompt-tokens 128 --generate 384

Converts models/colibri-olmoe-stdlib to ~/.cache/colibri/colibri-olmoe-stdlib.pack on first
use (where tools/demo.sh puts it; --pack to choose), then runs the engine in-process with its
routing capture on (the same capture the daemon's routing stream and debug_routing read): for
each of --sequences windows spread evenly over the model's validation text
(tools/train_default_model.py's held-out files), the prompt is prefilled in one step and
--generate tokens are decoded greedily one step each (stopping early at an end-of-sequence
token). Every step's routing is written, prompt steps included, so the trace holds exactly the
(layer, experts) requests the engine made.

The trace is JSON lines: a header object (trace "colibri-routing", the model's MoE layers,
experts per layer, top-k, the pack's expert record size, how it was made), then one object per
engine step: {"seq": i, "phase": "prompt" | "decode", "experts": (L, rows, top-k) nested lists,
best first}. bench/cache_sim.py reads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_MODEL = ROOT / "models" / "colibri-olmoe-stdlib"
PACK_DIR = Path.home() / ".cache" / "colibri"  # <model name>.pack, as tools/demo.sh places it


def ensure_pack(model: Path, pack: Path) -> Path:
    """Converts ``model`` to ``pack`` unless a pack newer than every checkpoint file is there."""
    manifest = pack / "manifest.json"
    newest = max(p.stat().st_mtime for p in model.glob("*.safetensors"))
    if manifest.is_file() and manifest.stat().st_mtime >= newest:
        return pack
    from colibrid.convert.cli import main as convert

    print(f"converting {model} to {pack}", file=sys.stderr, flush=True)
    pack.parent.mkdir(parents=True, exist_ok=True)
    if convert([str(model), str(pack), "--force"]) != 0:
        raise SystemExit(f"converting {model} failed")
    return pack


def validation_windows(tokenizer, sequences: int, prompt_tokens: int) -> list[list[int]]:
    """``sequences`` prompts of ``prompt_tokens`` tokens, spread evenly over the validation text."""
    from bench_aepc import validation_text_ids

    ids = validation_text_ids(tokenizer, 10**9)
    if len(ids) < sequences * prompt_tokens:
        raise SystemExit(f"the validation text has {len(ids)} tokens, fewer than {sequences} x {prompt_tokens}")
    stride = len(ids) // sequences
    return [ids[i * stride: i * stride + prompt_tokens] for i in range(sequences)]


def record(pack_path: Path, out: Path, sequences: int, prompt_tokens: int, generate: int) -> dict:
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    engine = Engine(pack)  # routed experts read with pread: the trace does not depend on a cache
    try:
        config = engine.config
        capture = engine.model.routing_capture
        capture.enabled = True
        eos = engine.tokenizer.eos_token_ids
        header = {"trace": "colibri-routing", "version": 1, "model": pack.manifest.source.get("path", str(pack_path)),
                  "moe_layers": capture.moe_layers, "num_experts": config.num_experts,
                  "top_k": config.num_experts_per_tok,
                  "record_bytes": max(r.length for r in pack.manifest.expert_records),
                  "made_by": f"bench/routing_traces.py --sequences {sequences} --prompt-tokens {prompt_tokens} "
                             f"--generate {generate}",
                  "text": "held-out validation files of tools/train_default_model.py; greedy decoding"}
        prompts = validation_windows(engine.tokenizer, sequences, prompt_tokens)
        counts = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0}
        started = time.monotonic()
        with open(out, "w") as f:
            f.write(json.dumps(header) + "\n")

            def step(seq: int, phase: str, session, ids: list[int]) -> int:
                logits = session.forward(ids, all_logits=False)  # (1, V)
                routing = capture.step()
                if routing is None:
                    raise RuntimeError("the routing capture missed a MoE layer of the step")
                f.write(json.dumps({"seq": seq, "phase": phase, "experts": routing.experts.tolist()},
                                   separators=(",", ":")) + "\n")
                counts["steps"] += 1
                return int(np.argmax(logits[-1]))

            for seq, prompt in enumerate(prompts):
                session = engine.new_session(max_context=prompt_tokens + generate + 1)
                token = step(seq, "prompt", session, prompt)
                counts["prompt_tokens"] += len(prompt)
                for _ in range(generate):
                    if token in eos:
                        break
                    token = step(seq, "decode", session, [token])
                    counts["generated_tokens"] += 1
                print(f"sequence {seq + 1}/{len(prompts)}: {counts['generated_tokens']} tokens generated so far "
                      f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
        return counts
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out", type=Path, help="the trace to write (JSON lines)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"checkpoint (default {DEFAULT_MODEL})")
    parser.add_argument("--pack", type=Path, default=None, help=f"its pack (default {PACK_DIR}/<model name>.pack)")
    parser.add_argument("--sequences", type=int, default=8, help="prompts from the validation text (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--generate", type=int, default=192, help="greedy tokens per prompt at most (default 192)")
    args = parser.parse_args(argv)
    if min(args.sequences, args.prompt_tokens, args.generate) < 1:
        raise SystemExit("--sequences, --prompt-tokens and --generate must be at least 1")
    pack = ensure_pack(args.model, args.pack or PACK_DIR / f"{args.model.resolve().name}.pack")
    counts = record(pack, args.out, args.sequences, args.prompt_tokens, args.generate)
    print(f"{args.out}: {counts['steps']} steps, {counts['prompt_tokens']} prompt tokens, "
          f"{counts['generated_tokens']} generated ({args.out.stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

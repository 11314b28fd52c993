"""Routing traces of real generations: the trained default model, greedy, on held-out text.

    python bench/routing_traces.py bench/traces/stdlib-greedy.jsonl
    python bench/routing_traces.py /tmp/long.jsonl --sequences 32 --prompt-tokens 128 --generate 384
    python bench/routing_traces.py bench/traces/stdlib64-greedy.jsonl --model models/colibri-olmoe64-stdlib \
        --guesses router-on-residual

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

--guesses router-on-moe-input | router-on-residual also records, in every step, what that
lookahead predictor (colibrid/engine/forward/moe.py) guesses of each next MoE layer: "guesses" holds
(L - 1, rows, G) nested lists, for each MoE layer l but the last the G (--guesses-per-row,
default 16) experts layer l+1's router ranks best on layer l's MoE input, or on the residual
stream leaving layer l through layer l+1's pre-MoE norm; the header's "guesses" names the
predictor and G. bench/bench_aepc.py run --routing-trace hands them to the engine's
lookahead when it replays the trace. Without --guesses (the default, "none") the trace is
as before.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
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
    from colibrid.tools.convert.cli import main as convert

    print(f"converting {model} to {pack}", file=sys.stderr, flush=True)
    pack.parent.mkdir(parents=True, exist_ok=True)
    if convert([str(model), str(pack), "--force"]) != 0:
        raise SystemExit(f"converting {model} failed")
    return pack


def model_name(path: str) -> str:
    """What a trace's header calls its model: the path inside this repository (models/...)
    when it is one, so a trace written from any checkout reads the same; else as given."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def validation_windows(tokenizer, sequences: int, prompt_tokens: int) -> list[list[int]]:
    """``sequences`` prompts of ``prompt_tokens`` tokens, spread evenly over the validation text."""
    from bench_aepc import validation_text_ids

    ids = validation_text_ids(tokenizer, 10**9)
    if len(ids) < sequences * prompt_tokens:
        raise SystemExit(f"the validation text has {len(ids)} tokens, fewer than {sequences} x {prompt_tokens}")
    stride = len(ids) // sequences
    return [ids[i * stride: i * stride + prompt_tokens] for i in range(sequences)]


GUESS_PREDICTORS = ("none", "router-on-moe-input", "router-on-residual")


class NextLayerGuesses:
    """A lookahead predictor's ranked guesses of every next MoE layer's experts, from the
    hidden states the routing capture kept: what the engine's lookahead would guess."""

    def __init__(self, model, predictor: str, per_row: int) -> None:
        from colibrid.engine.forward.moe import Router

        moe = [layer for layer in model.layers if layer.moe is not None]
        self.predictor = predictor
        self.per_row = min(per_row, model.config.num_experts)
        # layer l+1's router ranking more experts (the first top-k of a longer ranking are the routed ones)
        self.rankers = [Router(model.config, nxt.moe.w, top_k=self.per_row) for nxt in moe[1:]]
        self.router_inputs = [nxt.router_input_of for nxt in moe[1:]]

    def of(self, routing) -> np.ndarray:
        """(L - 1, T, G) int: for each MoE layer l but the last, the guesses of layer l+1 per row."""
        out = []
        for pair, (ranker, router_input_of) in enumerate(zip(self.rankers, self.router_inputs)):
            x = routing.moe_inputs[pair] if self.predictor == "router-on-moe-input" else \
                router_input_of(routing.residuals[pair])
            out.append(ranker(np.ascontiguousarray(x, dtype=np.float32)).experts)
        return np.stack(out) if out else np.empty((0, routing.rows, self.per_row), np.int64)


def record(pack_path: Path, out: Path, sequences: int, prompt_tokens: int, generate: int,
           guesses: str = "none", guesses_per_row: int = 16) -> dict:
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    if guesses not in GUESS_PREDICTORS:
        raise ValueError(f"guesses must be one of {', '.join(GUESS_PREDICTORS)}, got {guesses!r}")

    pack = Pack.open(pack_path)
    engine = Engine(pack)  # routed experts read with pread: the trace does not depend on a cache
    try:
        config = engine.config
        capture = engine.model.routing_capture
        capture.enabled = True
        guesser = NextLayerGuesses(engine.model, guesses, guesses_per_row) if guesses != "none" else None
        capture.keep_hidden = guesser is not None  # the states the predictor reads
        eos = engine.tokenizer.eos_token_ids
        header = {"trace": "colibri-routing", "version": 1, "model": model_name(pack.manifest.source.get("path", str(pack_path))),
                  "moe_layers": capture.moe_layers, "num_experts": config.num_experts,
                  "top_k": config.num_experts_per_tok,
                  "record_bytes": max(r.length for r in pack.manifest.expert_records),
                  "made_by": f"bench/routing_traces.py --sequences {sequences} --prompt-tokens {prompt_tokens} "
                             f"--generate {generate}",
                  "text": "held-out validation files of tools/train_default_model.py; greedy decoding"}
        if guesser is not None:
            header["made_by"] += f" --guesses {guesses} --guesses-per-row {guesses_per_row}"
            header["guesses"] = {"predictor": guesses, "per_row": guesser.per_row,
                                 "of": "layer l+1's experts, ranked best first at layer l, for each MoE layer l but the last"}
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
                line = {"seq": seq, "phase": phase, "experts": routing.experts.tolist()}
                if guesser is not None:
                    line["guesses"] = guesser.of(routing).tolist()
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
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


@dataclass
class DecodeSteps:
    """A trace's decode steps (one row each), what bench_aepc.py run --routing-trace replays."""

    header: dict
    experts: np.ndarray  # (S, L, A) int32 each step's experts per MoE layer, best first
    guesses: np.ndarray | None  # (S, L - 1, G) int32 the recorded guesses of layer l+1 at layer l, or None

    @property
    def layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def predictor(self) -> str | None:
        return self.header["guesses"]["predictor"] if self.guesses is not None else None


def read_decode_steps(path: Path, num_experts: int, top_k: int) -> DecodeSteps:
    """The decode steps of a routing_traces.py trace, checked against a pack of ``num_experts``
    experts routing ``top_k`` per token: every expert id and guess in range, top-k experts per
    row, one row per step, the same shape on every line. SystemExit with the reason otherwise
    (a trace is a file anyone may have written)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        header = {}
    if not isinstance(header, dict) or header.get("trace") != "colibri-routing":
        raise SystemExit(f"{path} is not a bench/routing_traces.py trace (no colibri-routing header)")
    if header.get("top_k") != top_k:
        raise SystemExit(f"{path} routes {header.get('top_k')!r} experts per token, the pack {top_k}")
    guesses_meta = header.get("guesses")
    experts, guesses = [], []
    try:
        for number, line in enumerate(lines[1:], start=2):
            step = json.loads(line)
            if step.get("phase") != "decode":
                continue
            experts.append(np.asarray(step["experts"], dtype=np.int64))
            if guesses_meta is not None:
                guesses.append(np.asarray(step["guesses"], dtype=np.int64))
        if not experts:
            raise SystemExit(f"{path} holds no decode steps")
        experts_array = np.stack(experts)  # (S, L, 1, A): ragged lines fail here
        guesses_array = np.stack(guesses) if guesses_meta is not None else None  # (S, L - 1, 1, G)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise SystemExit(f"{path}: malformed decode step ({type(exc).__name__}: {str(exc)[:120]})") from None
    if experts_array.ndim != 4 or experts_array.shape[2] != 1 or experts_array.shape[3] != top_k \
            or experts_array.shape[1] < 1:
        raise SystemExit(f"{path}: decode steps must be (layers, 1 row, {top_k}), got {experts_array.shape[1:]}")
    layers = experts_array.shape[1]
    if guesses_array is not None and (guesses_array.ndim != 4 or guesses_array.shape[1:3] != (layers - 1, 1)):
        raise SystemExit(f"{path}: guesses must be ({layers - 1} layers, 1 row, G), got {guesses_array.shape[1:]}")
    for name, array in (("experts", experts_array), ("guesses", guesses_array)):
        if array is not None and array.size and (array.min() < 0 or array.max() >= num_experts):
            raise SystemExit(f"{path}: {name} outside [0, {num_experts}): a trace of a bigger model?")
    ordered = np.sort(experts_array, axis=3)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise SystemExit(f"{path}: a decode step names an expert twice in one row")
    return DecodeSteps(header, experts_array[:, :, 0].astype(np.int32),
                       None if guesses_array is None else guesses_array[:, :, 0].astype(np.int32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out", type=Path, help="the trace to write (JSON lines)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"checkpoint (default {DEFAULT_MODEL})")
    parser.add_argument("--pack", type=Path, default=None, help=f"its pack (default {PACK_DIR}/<model name>.pack)")
    parser.add_argument("--sequences", type=int, default=8, help="prompts from the validation text (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--generate", type=int, default=192, help="greedy tokens per prompt at most (default 192)")
    parser.add_argument("--guesses", choices=GUESS_PREDICTORS, default="none",
                        help="also record this lookahead predictor's guesses of each next MoE layer (default none)")
    parser.add_argument("--guesses-per-row", type=int, default=16, help="guesses recorded per row and layer (default 16)")
    args = parser.parse_args(argv)
    if min(args.sequences, args.prompt_tokens, args.generate) < 1:
        raise SystemExit("--sequences, --prompt-tokens and --generate must be at least 1")
    if args.guesses_per_row < 1:
        raise SystemExit("--guesses-per-row must be at least 1")
    pack = ensure_pack(args.model, args.pack or PACK_DIR / f"{args.model.resolve().name}.pack")
    counts = record(pack, args.out, args.sequences, args.prompt_tokens, args.generate, args.guesses,
                    args.guesses_per_row)
    print(f"{args.out}: {counts['steps']} steps, {counts['prompt_tokens']} prompt tokens, "
          f"{counts['generated_tokens']} generated ({args.out.stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

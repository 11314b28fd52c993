"""Prefix reuse, measured: the time to first token of a chat's second turn, whose prompt
resends a long history (the first turn's prompt and answer), against the first turn's.

    python bench/bench_prefix.py                               # 4-layer OLMoE-shaped q8_0 pack
    python bench/bench_prefix.py --history-tokens 2000 --conversations 5
    python bench/bench_prefix.py --pack PACK --threads 2 --json prefix.json

Each conversation has a history of about ``--history-tokens`` tokens of its own (text the
pack's tokenizer encodes to that many tokens) and two questions. Turn 1 asks the history and
the first question; turn 2 resends turn 1's prompt, its answer and the second question, as a
chat client does (raw prompts, so no chat template is needed: any pack works). Both turns are
greedy, ``--answer-tokens`` long. The same conversations run against colibrid with prefix reuse
(``--prefix-cache-size``) and without (prefix_cache_size 0), each daemon fresh and warmed up
until every expert is in its cache, so the times are prefill and decode only.

Time to first token is taken by the client, from sending the ask to the first token, and
reported beside the daemon's own (usage.time_to_first_token_ms) and the prompt tokens it reused
(usage.cached_prompt_tokens). Printed: per conversation and as medians, turn 2 with reuse /
turn 1 (issue 17's target: <= 0.2 with a 1,000-token history) and turn 2 without reuse / turn
1. Then the cost of the copies reuse makes, measured in this process on states of the pack's
shape: keeping a finished sequence's state and restoring it into a new one.

Not a test: numbers depend on the machine and on what else runs on it (the load average is
printed at the start and the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_kernels import prepare  # noqa: E402
from bench_serving import (  # noqa: E402
    SHAPE, ColibriDaemon, Sampling, colibri_cache_bytes, colibri_prompts, memory_settings, warm_up,
)
from machine import cpu_model  # noqa: E402

TARGET_RATIO = 0.2  # issue 17: turn 2's time to first token <= 0.2 x turn 1's, 1,000-token history
HISTORY_SEED, QUESTION_SEED, WARMUP_SEED = 17, 18, 19
WARMUP_PROMPTS = 8


def ask(socket_path: str, prompt: str, max_tokens: int) -> dict:
    """One greedy raw ask: the client's time to first token, the text, and the done event's usage."""
    from colibrid.wire.client import Connection
    from colibrid.wire.events import DoneEvent, TokenEvent
    from colibrid.wire.requests import AskFields

    with Connection.open(socket_path, client_name="bench_prefix") as connection:
        sent_s = time.perf_counter()
        first_token_s, text, usage = None, [], None
        request_id = connection.ask(AskFields(prompt=prompt, raw=True, max_tokens=max_tokens, ignore_eos=True,
                                              temperature=0.0))
        for event in connection.events(request_id):  # an error event raises RequestError
            if isinstance(event, TokenEvent):
                first_token_s = first_token_s or time.perf_counter()
                text.append(event.text)
            elif isinstance(event, DoneEvent):
                usage = event.usage
                text = [event.text]
    return {"ttft_ms": (first_token_s - sent_s) * 1000.0, "text": "".join(text),
            "daemon_ttft_ms": usage.time_to_first_token_ms, "prompt_tokens": usage.prompt_tokens,
            "cached_prompt_tokens": usage.cached_prompt_tokens}


def conversation(socket_path: str, history: str, questions: tuple[str, str], answer_tokens: int) -> dict:
    """Turn 1 (history + question 1), then turn 2 (turn 1's prompt and answer + question 2)."""
    first_prompt = f"{history}\n{questions[0]}\n"
    first = ask(socket_path, first_prompt, answer_tokens)
    second = ask(socket_path, f"{first_prompt}{first['text']}\n{questions[1]}\n", answer_tokens)
    return {"turn1": first, "turn2": second}


def measure(pack: Path, args, histories: list[str], questions: list[tuple[str, str]], warmups: list[str],
            prefix_cache_size: str) -> list[dict]:
    memory = memory_settings("cached", pack, None, 0.4)[0]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    daemon = ColibriDaemon(pack, colibri_cache_bytes(pack, memory, 1, args.history_tokens), args.threads,
                           memory.hugepages, 1, env, None, ["--prefix-cache-size", prefix_cache_size])
    try:
        warm_up(daemon, warmups, Sampling(4, True), fill_cache=True)
        return [conversation(daemon.socket_path, history, pair, args.answer_tokens)
                for history, pair in zip(histories, questions)]
    finally:
        daemon.stop()


def copy_cost(pack: Path, tokens: int, repeats: int = 5) -> dict:
    """Keeping (compact copy) and restoring (copy into a fresh state) a sequence of ``tokens``
    tokens, on full-attention states of the pack's shape: the median ms of each."""
    from colibrid.engine.forward.kv_cache import KVCache
    from colibrid.engine.forward.sequence_state import SequenceState
    from colibrid.pack.reader import Pack

    c = Pack.open(pack).manifest.model
    max_tokens = tokens + 256

    def state() -> SequenceState:
        return SequenceState([KVCache(c.num_kv_heads, c.head_dim, max_tokens) for _ in range(c.num_layers)], max_tokens)

    finished = state()
    rows = np.random.default_rng(0).standard_normal((tokens, c.num_kv_heads, c.head_dim)).astype(np.float32)
    for layer in finished.layers:
        layer.write(0, rows, rows)
    finished.advance(tokens)
    keep_ms, restore_ms = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        prefix = finished.keep()
        keep_ms.append((time.perf_counter() - started) * 1000.0)
        target = state()
        started = time.perf_counter()
        prefix.restore(target, tokens)
        restore_ms.append((time.perf_counter() - started) * 1000.0)
    return {"tokens": tokens, "bytes": prefix.nbytes, "keep_ms": statistics.median(keep_ms),
            "restore_ms": statistics.median(restore_ms)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "colibri-bench")
    parser.add_argument("--pack", type=Path, help="default: the 4-layer OLMoE-shaped q8_0 pack in --work (made if missing)")
    parser.add_argument("--history-tokens", type=int, default=1000)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--prefix-cache-size", default="1G", help="the reusing daemon's prefix_cache_size")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="compute threads")
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args(argv)

    pack = args.pack
    if pack is None:
        args.work.mkdir(parents=True, exist_ok=True)
        pack = prepare(args.work, SHAPE, [SHAPE.variant("q8_0")], 4, False, keep_checkpoint=False)["q8_0"][0]
    load_before = os.getloadavg()
    print(f"{cpu_model()}; {args.threads} threads; load average {load_before[0]:.2f} (1 min) at the start; {pack}",
          flush=True)
    n = args.conversations
    histories = colibri_prompts(pack, n, args.history_tokens, HISTORY_SEED)
    texts = colibri_prompts(pack, 2 * n, args.question_tokens, QUESTION_SEED)
    questions = [(texts[2 * i], texts[2 * i + 1]) for i in range(n)]
    warmups = colibri_prompts(pack, WARMUP_PROMPTS, 64, WARMUP_SEED)  # prompts no conversation begins with

    reused = measure(pack, args, histories, questions, warmups, args.prefix_cache_size)
    fresh = measure(pack, args, histories, questions, warmups, "0")
    for r, f in zip(reused, fresh):  # without reuse the answers must be the same
        if (r["turn1"]["text"], r["turn2"]["text"]) != (f["turn1"]["text"], f["turn2"]["text"]):
            raise SystemExit("the answers with and without prefix reuse differ: that is a bug")

    print(f"\n{'conv':>4} {'prompt':>7} {'cached':>7}   {'turn 1 ms':>9} {'turn 2 ms':>9} {'no reuse':>9}   "
          f"{'2/1':>5} {'no reuse/1':>10}   (client time to first token; daemon's in brackets)")
    ratios, fresh_ratios = [], []
    for i, (r, f) in enumerate(zip(reused, fresh)):
        one, two, two_fresh = r["turn1"], r["turn2"], f["turn2"]
        ratios.append(two["ttft_ms"] / one["ttft_ms"])
        fresh_ratios.append(two_fresh["ttft_ms"] / one["ttft_ms"])
        print(f"{i:>4} {two['prompt_tokens']:>7} {two['cached_prompt_tokens']:>7}   {one['ttft_ms']:>9.1f} "
              f"{two['ttft_ms']:>9.1f} {two_fresh['ttft_ms']:>9.1f}   {ratios[-1]:>5.3f} {fresh_ratios[-1]:>10.3f}   "
              f"({one['daemon_ttft_ms']:.1f} / {two['daemon_ttft_ms']:.1f} / {two_fresh['daemon_ttft_ms']:.1f})")
    ratio = statistics.median(ratios)
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(f"median turn 2 / turn 1 with reuse: {ratio:.3f} (target <= {TARGET_RATIO}: {verdict}); "
          f"without reuse: {statistics.median(fresh_ratios):.3f}")
    copies = copy_cost(pack, reused[0]["turn2"]["cached_prompt_tokens"] or args.history_tokens)
    print(f"copies for {copies['tokens']} tokens ({copies['bytes'] / 2**20:.1f} MiB of keys and values): keep "
          f"{copies['keep_ms']:.1f} ms, restore {copies['restore_ms']:.1f} ms")
    load_after = os.getloadavg()
    print(f"load average {load_after[0]:.2f} (1 min) at the end")
    if args.json:
        args.json.write_text(json.dumps({"pack": str(pack), "cpu": cpu_model(), "threads": args.threads,
                                         "load_average": [load_before[0], load_after[0]], "reused": reused,
                                         "fresh": fresh, "median_ratio": ratio, "copies": copies}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

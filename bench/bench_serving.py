"""Serving under load: N concurrent clients, each asking a different prompt, against colibrid
(through its Unix socket) and llama.cpp's llama-server (through its HTTP API) on the same
OLMoE-1B-7B-shaped weights.

    python bench/bench_serving.py --prepare-only                   # packs, GGUFs, llama-server
    python bench/bench_serving.py                                  # 4 layers, q8_0 and q4_g64, 1-16 clients
    python bench/bench_serving.py --layers 16 --quant q8_0 --memory limited --clients 1,8
    python bench/bench_serving.py --isa avx2 --threads 2 --clients 1,2,4,8 --json serving.json
    python bench/bench_serving.py --pack PACK --skip-llama --clients 1,2   # any pack, Colibri only
    python bench/bench_serving.py --quant q8_0 --memory cached --clients 1,8 --rounds 3 --skip-llama

Each client asks once (``--requests`` times, one after another) for ``--tokens`` tokens after a
prompt of about ``--prompt-tokens`` tokens of its own, with the end-of-sequence token ignored so
every request runs its full length; sampling is seeded (temperature 1, no truncation, one seed
per client; ``--greedy`` for temperature 0), the same on both sides. Per request the client
records when it sent the request and when each token arrived; per N the bench reports:
- aggregate decode tok/s: tokens after each request's first / (last token of any request -
  first token of any request); aggregate tok/s counts every token from the first request sent;
  steady: the decode rate while every request decodes (last first token to first last token),
  which leaves out the steps that prefill later prompts while earlier requests decode;
- time to first token (from sending, queueing included) and inter-token latency (gaps between
  consecutive tokens of one request), p50 and p99 over all requests;
- for Colibri, what the expert cache read during the run (MB), and the batch the daemon's
  `status` reports (`batch`: mean distinct experts per layer step and the mean sum of
  per-sequence experts, "n/a" from a daemon that has no such fields).

Two memory configurations (``--memory``): ``cached`` - the expert cache holds every expert
(hugepages as the daemon's default), the GGUF sits in the page cache after the warm-up; and
``limited`` - each server runs inside a cgroup v1 memory limit of 40 % of the pack
(``--limit-fraction``, ``--limit``), its files evicted from the page cache first; Colibri's cache
is what the limit leaves after the dense weights, a process allowance and the KV caches of the
run's N sequences (so it shrinks as N grows, as the daemon's memory budget would). The daemon's
``kv_cache_size`` is set to what the N sequences reserve (each its prompt plus ``--tokens``, as
``--kv-cache-type``), so all N join the batch at once whatever the limit. Each server
is started afresh for each N (llama-server with ``-np N -cb``) and warmed up by a request with a
prompt no client asks (fully cached, Colibri's by as many as it takes to load every expert).

Then the bound: a step of N sequences reads attention and the head once, and each distinct
expert once, so at the memory-bandwidth limit N tokens cost (dense + distinct experts) bytes
against N x (dense + top-k experts) one at a time. Printed from the measured distinct experts
and from random routing's expectation (E (1 - (1 - k/E)^N)), with the roofline (this machine's
read bandwidth / bytes of a step x N) when fully cached; under a limit, the disk's bound too:
the expert records a step of N needs (distinct experts x MoE layers), the least it could read a
token were every cache slot a hit, and that against what one client read a token; and the
ratios issue 16 sets targets for, at 8 clients.

``--rounds R`` runs the whole sweep of client counts R times, one round after another, and
gives each round's ratios and then their median and range: on a host whose speed drifts over
minutes (a shared cloud machine), the single client and the 8 clients measured a minute apart
make a fairer ratio than a single client measured once against 8 measured much later.

Not a test: numbers depend on the machine and on what else runs on it. Every result names the
CPU, Colibri's kernel level and the llama.cpp build.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_kernels import ISAS, active_bytes_per_token, build_llama_bench, prepare  # noqa: E402
from machine import cpu_model, memory_bandwidth  # noqa: E402
from memory_cgroup import (  # noqa: E402
    PROCESS_ALLOWANCE_BYTES, MemoryCgroup, drop_from_page_cache, evict_from_page_cache,
)
from server_process import ServerProcess  # noqa: E402
from shapes import SHAPES, log  # noqa: E402
from shapes.common import FIRST_TEXT_ID  # noqa: E402

SHAPE = SHAPES["olmoe"]
DEFAULT_LAYERS = 4  # the depth the daemon-side benchmarks use; --layers 16 is the whole model
TARGET_CLIENTS = 8  # issue 16's targets compare 8 clients with one
PROMPT_SEED, SAMPLING_SEED = 1, 1000  # prompts; sampling seeds are SAMPLING_SEED + the client's index
WARMUP_TOKENS = 4
WARMUP_PROMPTS = 8  # at most this many warm-up requests, until every expert is cached
START_TIMEOUT_S = 600.0  # loading a pack or GGUF through a small memory limit is slow


# --------------------------------------------------------------------------------------------
# Prompts: one per client, different for each, the same on every run
# --------------------------------------------------------------------------------------------


def colibri_prompts(pack: Path, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` texts of ``tokens`` tokens each, or up to two fewer, for the pack's tokenizer:
    random vocabulary entries (those that decode to whole characters) as text, then cut or
    grown until the text encodes to that many tokens (re-encoding merges some neighbours)."""
    from colibrid.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(pack)
    rng = np.random.default_rng(seed)
    special = {tokenizer.token_to_id(t) for t in tokenizer.special_tokens.values()}
    pieces = {i: tokenizer.decode([i]) for i in range(tokenizer.vocab_size) if i not in special}
    ordinary = np.array([i for i, piece in pieces.items() if piece and "\ufffd" not in piece])
    texts = []
    for _ in range(count):
        ids = [int(i) for i in rng.choice(ordinary, tokens)]
        for _ in range(16):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if tokens - 2 <= len(ids) <= tokens:
                break
            ids = ids[:tokens] if len(ids) > tokens else ids + [int(i) for i in rng.choice(ordinary, tokens - len(ids))]
        texts.append(text)
    return texts


def llama_prompts(vocab_size: int, count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``tokens`` ids of the GGUF's placeholder vocabulary (one
    character per id, bench/shapes/common.py): sent as ids, so no tokenizer is involved."""
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.integers(FIRST_TEXT_ID, vocab_size, tokens)] for _ in range(count)]


# --------------------------------------------------------------------------------------------
# The load generator: one thread per client, each with its own connection
# --------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    max_tokens: int
    greedy: bool

    def temperature(self) -> float:
        return 0.0 if self.greedy else 1.0


@dataclass
class RequestTiming:
    """One request as its client saw it; times are time.perf_counter() seconds."""

    client: int
    sent_s: float
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times_s)


# A client: (client index, its prompt, sampling, a barrier every client waits at once connected) -> timings
Client = Callable[[int, object, Sampling, threading.Barrier], RequestTiming]


def colibri_client(socket_path: str) -> Client:
    """A client of colibrid speaking the protocol through colibrid.wire's client."""
    from colibrid.wire.client import Connection
    from colibrid.wire.errors import ClientError
    from colibrid.wire.events import DoneEvent, TokenEvent
    from colibrid.wire.requests import AskFields

    def ask(index: int, prompt: object, sampling: Sampling, start: threading.Barrier) -> RequestTiming:
        with Connection.open(socket_path, client_name="bench_serving") as connection:
            start.wait()
            timing = RequestTiming(index, time.perf_counter())
            try:
                request_id = connection.ask(AskFields(
                    prompt=prompt, raw=True, max_tokens=sampling.max_tokens, ignore_eos=True,
                    temperature=sampling.temperature(), top_k=0, top_p=1.0, min_p=0.0, seed=SAMPLING_SEED + index))
                for event in connection.events(request_id):
                    now = time.perf_counter()
                    if isinstance(event, TokenEvent):
                        timing.token_times_s += [now] * len(event.token_ids)
                    elif isinstance(event, DoneEvent):
                        timing.finish_reason = event.finish_reason
                        timing.prompt_tokens = event.usage.prompt_tokens
            except ClientError as error:
                timing.error = str(error)
            return timing

    return ask


def llama_client(port: int) -> Client:
    """A client of llama-server: POST /completion with a streamed answer (server-sent events,
    one per token), the prompt as token ids."""

    def ask(index: int, prompt: object, sampling: Sampling, start: threading.Barrier) -> RequestTiming:
        body = json.dumps({"prompt": prompt, "n_predict": sampling.max_tokens, "stream": True, "ignore_eos": True,
                           "temperature": sampling.temperature(), "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                           "typical_p": 1.0, "repeat_penalty": 1.0, "seed": SAMPLING_SEED + index,
                           "cache_prompt": False})
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        try:
            connection.connect()
            start.wait()
            timing = RequestTiming(index, time.perf_counter())
            try:
                connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                if response.status != 200:
                    timing.error = f"HTTP {response.status}: {response.read(500)!r}"
                    return timing
                _read_events(response, timing)
            except (OSError, http.client.HTTPException, ValueError) as error:
                timing.error = f"{type(error).__name__}: {error}"
            return timing
        finally:
            connection.close()

    return ask


def _read_events(response: http.client.HTTPResponse, timing: RequestTiming) -> None:
    """Token arrival times from llama-server's event stream. Each event carries the count of
    tokens decoded so far (`tokens_predicted`); prompt-progress events add none."""
    decoded = 0
    for line in response:
        if not line.startswith(b"data: "):
            if line.startswith(b"error"):
                timing.error = line.decode(errors="replace").strip()
            continue
        event = json.loads(line[len(b"data: "):])
        now = time.perf_counter()
        new = int(event.get("tokens_predicted", decoded)) - decoded
        timing.token_times_s += [now] * max(new, 0)
        decoded += max(new, 0)
        if event.get("stop"):
            timing.finish_reason = event.get("stop_type")
            timing.prompt_tokens = event.get("tokens_evaluated")
            return


def run_clients(client: Client, prompts: list, sampling: Sampling, requests_per_client: int) -> list[RequestTiming]:
    """len(prompts) clients at once, each connected before any sends; each asks its prompt
    ``requests_per_client`` times, one after another."""
    count = len(prompts)
    results: list[list[RequestTiming]] = [[] for _ in range(count)]
    barriers = [threading.Barrier(count) for _ in range(requests_per_client)]

    def one_client(index: int) -> None:
        for barrier in barriers:
            try:
                results[index].append(client(index, prompts[index], sampling, barrier))
            except Exception as error:  # a client that cannot connect still releases the others
                barrier.abort()
                failed = RequestTiming(index, time.perf_counter(), error=f"{type(error).__name__}: {error}")
                results[index].append(failed)

    threads = [threading.Thread(target=one_client, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [timing for per_client in results for timing in per_client]


def summarize(timings: list[RequestTiming], expected_tokens: int) -> dict:
    """The numbers one row of the table shows (times in ms)."""
    ok = [t for t in timings if t.error is None and t.tokens > 0]
    errors = [t.error for t in timings if t.error is not None]
    if not ok:
        return {"requests": len(timings), "errors": errors, "ok": 0}
    first = min(t.token_times_s[0] for t in ok)
    last = max(t.token_times_s[-1] for t in ok)
    sent = min(t.sent_s for t in ok)
    total = sum(t.tokens for t in ok)
    decode = sum(t.tokens - 1 for t in ok)
    ttft_ms = [1e3 * (t.token_times_s[0] - t.sent_s) for t in ok]
    itl_ms = [1e3 * gap for t in ok for gap in np.diff(t.token_times_s)]

    def percentile(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    # While every request decodes: from the last first token to the first last token. The
    # aggregate above also spans the steps that prefill later prompts while earlier requests
    # decode (with N prompts arriving together and prefill_chunk below N x their length);
    # this is the rate a step of N sequences gives, what the bound speaks of.
    steady_from = max(t.token_times_s[0] for t in ok)
    steady_to = min(t.token_times_s[-1] for t in ok)
    steady = sum(int(np.count_nonzero((np.asarray(t.token_times_s) > steady_from)
                                      & (np.asarray(t.token_times_s) <= steady_to))) for t in ok)
    prompt_tokens = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    return {
        "requests": len(timings), "ok": len(ok), "errors": errors,
        "short": sum(t.tokens < expected_tokens for t in ok),  # ended before max_tokens (should be 0)
        "finish_reasons": sorted({str(t.finish_reason) for t in ok}),
        "prompt_tokens_mean": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "tokens": total, "wall_s": last - sent,
        "aggregate_tok_s": total / (last - sent),
        "aggregate_decode_tok_s": decode / (last - first) if last > first else None,
        "steady_decode_tok_s": steady / (steady_to - steady_from) if steady_to > steady_from else None,
        "ttft_ms_p50": percentile(ttft_ms, 50), "ttft_ms_p99": percentile(ttft_ms, 99),
        "itl_ms_p50": percentile(itl_ms, 50), "itl_ms_p99": percentile(itl_ms, 99),
        "timings": [asdict(t) for t in timings],
    }


# --------------------------------------------------------------------------------------------
# The servers
# --------------------------------------------------------------------------------------------




class ColibriDaemon(ServerProcess):
    """colibrid on a pack, optionally in a memory cgroup. No config file from the machine: the
    defaults and the flags only."""

    def __init__(self, pack: Path, cache_bytes: int, threads: int, hugepages: str, max_clients: int,
                 env: dict, group: MemoryCgroup | None, extra: list[str]) -> None:
        super().__init__("colibri-serving-")
        self.pack = pack
        self.socket_path = str(self.dir / "colibrid.sock")
        (self.dir / "colibrid.toml").write_text("")
        argv = [sys.executable, "-m", "colibrid", "--config", str(self.dir / "colibrid.toml"), "--model", str(pack),
                "--socket", self.socket_path, "--hugepage-record", str(self.dir / "hugepages.json"),
                "--cache-size", str(cache_bytes), "--hugepages", hugepages, "--max-queue", str(max(16, max_clients)),
                "--log-level", "warning", *extra]
        argv += ["--cpu-affinity", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log, cwd=REPO,
                                     env=dict(env, PYTHONPATH=str(REPO)), preexec_fn=group.join if group else None)
        self._wait_until_serving()

    def _wait_until_serving(self) -> None:
        from colibrid.wire.client import Connection
        from colibrid.wire.errors import ClientError

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibrid exited with {self.proc.returncode} during start-up:\n{self.stop()}")
            try:
                Connection.open(self.socket_path, "bench_serving", timeout_s=5.0).close()
                return
            except ClientError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"colibrid did not answer within {START_TIMEOUT_S:.0f} s:\n{self.stop()}")
                time.sleep(0.2)

    def client(self) -> Client:
        return colibri_client(self.socket_path)

    def status(self) -> dict:
        """The daemon's `status` event; {} if it cannot answer (it died during the run)."""
        from colibrid.wire.client import Connection
        from colibrid.wire.errors import ClientError

        try:
            with Connection.open(self.socket_path, client_name="bench_serving") as connection:
                return dict(connection.status().to_wire())
        except ClientError as error:
            log(f"colibrid status: {error}")
            return {}



def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer(ServerProcess):
    """llama-server on a GGUF with ``slots`` parallel sequences and continuous batching."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context_per_slot: int, threads: int,
                 group: MemoryCgroup | None, extra: list[str]) -> None:
        super().__init__("llama-serving-")
        self.port = _free_port()
        self.argv = [str(binary), "-m", str(gguf), "-np", str(slots), "-cb", "-c", str(slots * context_per_slot),
                     "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=group.join if group else None)
        self._wait_until_healthy()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                oom = self.proc.returncode == -signal.SIGKILL
                killed = " (SIGKILL: in a memory cgroup, its OOM killer)" if oom else ""
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}{killed} during start-up:\n"
                                   f"{self.stop()}")
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                connection.request("GET", "/health")  # 503 while the model loads
                if connection.getresponse().status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            finally:
                connection.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server was not healthy within {START_TIMEOUT_S:.0f} s:\n{self.stop()}")
            time.sleep(0.2)

    def client(self) -> Client:
        return llama_client(self.port)



# --------------------------------------------------------------------------------------------
# Bytes per step, and the bound they set
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """What a decode step reads: ``dense_bytes`` (attention, norms, routers, the head: once per
    step whatever the batch; plus an embedding row per token) and ``expert_bytes`` per expert
    per MoE layer."""

    dense_bytes: int
    embedding_row_bytes: int
    expert_bytes: int
    moe_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    slot_bytes: int = 0  # an expert cache slot: the largest record, in whole 4 KiB pages

    @classmethod
    def of(cls, pack_path: Path) -> "StepBytes":
        from colibrid.engine.experts.slab import expert_slot_bytes
        from colibrid.pack.reader import Pack

        pack = Pack.open(pack_path)
        m, c = pack.manifest, pack.manifest.model
        expert = sum(part.nbytes for part in m.expert_parts.values())
        embed = m.dense_tensors["embed"]
        one_token = active_bytes_per_token(pack)  # dense except the embedding, one embedding row, top-k experts
        moe_layers = len(c.moe_layer_ids)
        row = embed.nbytes // embed.shape[0]
        dense = one_token - row - moe_layers * c.num_experts_per_tok * expert
        return cls(dense, row, expert, moe_layers, c.num_experts, c.num_experts_per_tok, c.vocab_size,
                   expert_slot_bytes(m))

    def step(self, tokens: int, distinct_experts_per_layer: float) -> float:
        """Bytes read by a step of ``tokens`` tokens that touches that many experts per layer."""
        experts = self.moe_layers * distinct_experts_per_layer * self.expert_bytes
        return self.dense_bytes + tokens * self.embedding_row_bytes + experts

    def random_routing_distinct(self, sequences: int) -> float:
        """Expected distinct experts per layer when each of ``sequences`` tokens picks top-k of E uniformly."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** sequences)

    def tokens_per_byte_bound(self, sequences: int, distinct_experts_per_layer: float) -> float:
        """Tokens per byte of a step of ``sequences`` tokens against one token's step."""
        return self.step(1, self.top_k) * sequences / self.step(sequences, distinct_experts_per_layer)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def batch_during(before: dict, after: dict) -> dict:
    """The daemon's batch statistics over the run, from `status` before and after it. The means
    are taken as since-start means over `steps` steps, so the run's own mean is the difference
    of the sums; a daemon without `batch` gives None for each."""
    b0, b1 = before.get("batch") or {}, after.get("batch") or {}
    steps0, steps1 = _number(b0.get("steps")), _number(b1.get("steps"))
    out = {"max_batch": b1.get("max_batch"), "prefill_chunk": b1.get("prefill_chunk"),
           "steps": steps1 - steps0 if steps0 is not None and steps1 is not None else steps1}
    for key in ("distinct_experts_per_layer_step", "sequence_experts_per_layer_step"):
        m0, m1 = _number(b0.get(key)), _number(b1.get(key))
        if m1 is not None and m0 is not None and steps0 is not None and steps1 is not None and steps1 > steps0:
            out[key] = (m1 * steps1 - m0 * steps0) / (steps1 - steps0)
        else:
            out[key] = m1
    return out


def cache_during(before: dict, after: dict) -> dict:
    c0, c1 = before.get("cache") or {}, after.get("cache") or {}
    return {key: (c1.get(key) or 0) - (c0.get(key) or 0) for key in ("hits", "misses", "bytes_read")}


# --------------------------------------------------------------------------------------------
# One configuration: a pack (and its GGUF), a memory setting, every N
# --------------------------------------------------------------------------------------------


@dataclass
class Memory:
    """How the servers get their memory: fully cached (``limit_bytes`` None: an expert cache
    that holds every expert, hugepages as the daemon's default), or inside a cgroup memory
    limit (hugepages off: hugetlb pages are not charged to a v1 memory cgroup)."""

    name: str
    limit_bytes: int | None
    hugepages: str


def memory_settings(names: str, pack: Path, limit: str | None, limit_fraction: float) -> list[Memory]:
    from colibrid.system.memory import parse_size

    out = []
    for name in names.split(","):
        if name == "cached":
            out.append(Memory("cached", None, "auto"))
        elif name == "limited":
            pack_bytes = sum(f.stat().st_size for f in pack.iterdir() if f.is_file())
            out.append(Memory("limited", parse_size(limit) if limit else int(pack_bytes * limit_fraction), "off"))
        else:
            raise ValueError(f"--memory takes cached, limited or both, not {name!r}")
    return out


def kv_cache_bytes(pack: Path, sequences: int, tokens: int, kv_type: str = "f32") -> int:
    """The keys and values (float32 or float16, ``kv_type``) that ``sequences`` sequences of
    ``tokens`` tokens reserve: each its prompt plus max_tokens, in every layer (full attention,
    as the OLMoE shape has). The daemon is given this as its kv_cache_size, so that every
    client's request joins the batch at once."""
    from colibrid.engine.forward.model import KV_CACHE_DTYPES
    from colibrid.pack.reader import Pack

    c = Pack.open(pack).manifest.model
    element = np.dtype(KV_CACHE_DTYPES[kv_type]).itemsize
    return sequences * c.num_layers * tokens * 2 * c.num_kv_heads * c.head_dim * element


def colibri_cache_bytes(pack: Path, memory: Memory, sequences: int, tokens: int, kv_type: str = "f32") -> int | str:
    """The expert cache for a run of ``sequences`` sequences of ``tokens`` tokens: every expert
    (and a slot to spare) when fully cached; under a limit, what it leaves after the dense
    weights, the process allowance and the sequences' KV caches, as the daemon's memory budget
    counts them. A string says why the limit leaves too little: less than one layer's experts,
    which one prompt (or one batch step) may need at once."""
    from colibrid.engine.experts.slab import expert_slot_bytes
    from colibrid.sizes import format_bytes
    from colibrid.pack.reader import Pack

    manifest = Pack.open(pack).manifest
    slot_bytes = expert_slot_bytes(manifest)
    if memory.limit_bytes is None:
        return (len(manifest.expert_records) + 1) * slot_bytes
    kv_bytes = kv_cache_bytes(pack, sequences, tokens, kv_type)
    cache = memory.limit_bytes - manifest.dense_size - PROCESS_ALLOWANCE_BYTES - kv_bytes
    one_layer = manifest.model.num_experts * slot_bytes
    if cache >= one_layer:
        return cache
    return (f"a limit of {format_bytes(memory.limit_bytes)} leaves {format_bytes(max(cache, 0))} for the expert cache "
            f"after the dense weights ({format_bytes(manifest.dense_size)}), the process allowance "
            f"({format_bytes(PROCESS_ALLOWANCE_BYTES)}) and {sequences} sequences' KV caches "
            f"({format_bytes(kv_bytes)}): "
            f"less than one layer's experts ({format_bytes(one_layer)}); use --layers 16 or a larger --limit")


@dataclass
class Setup:
    """What stays the same across a run's configurations."""

    threads: int
    env: dict
    llama_server: Path | None
    sampling: Sampling
    limited_sampling: Sampling
    requests: int
    daemon_args: list[str]
    llama_args: list[str]
    kv_type: str = "f32"  # colibrid's kv_cache_type

    def sampling_for(self, memory: Memory) -> Sampling:
        return self.sampling if memory.limit_bytes is None else self.limited_sampling


def measure_colibri(setup: Setup, pack: Path, memory: Memory, cache_bytes: int, kv_bytes: int, prompts: list[str],
                    warmups: list[str]) -> dict:
    """A fresh colibrid, warmed up, then len(prompts) clients at once, with a KV budget of
    ``kv_bytes`` (what they reserve together: none waits for another's KV)."""
    sampling = setup.sampling_for(memory)
    if memory.limit_bytes is not None:
        drop_from_page_cache(pack)
    with _memory_cgroup(memory.limit_bytes) as group:
        try:
            daemon = ColibriDaemon(pack, cache_bytes, setup.threads, memory.hugepages, len(prompts), setup.env,
                                   group, ["--kv-cache-size", str(kv_bytes), "--kv-cache-type", setup.kv_type,
                                           *setup.daemon_args])
        except RuntimeError as error:
            return {"ok": 0, "errors": [str(error)[-2000:]]}
        try:
            warm_up(daemon, warmups, sampling, fill_cache=memory.limit_bytes is None)
            before = daemon.status()
            timings = run_clients(daemon.client(), prompts, sampling, setup.requests)
            after = daemon.status()
        finally:
            log_text = daemon.stop()
        result = summarize(timings, sampling.max_tokens)
        result.update(cache=cache_during(before, after), batch=batch_during(before, after),
                      rss_bytes=(after.get("memory") or {}).get("rss_bytes"), cache_bytes=cache_bytes,
                      kv_cache=after.get("kv_cache"))
        if group is not None:
            result["cgroup"] = group.usage()
    if result.get("errors"):
        result["log_tail"] = log_text[-2000:]
    return result


def warm_up(daemon: ColibriDaemon, prompts: list[str], sampling: Sampling, fill_cache: bool) -> None:
    """One request alone; with ``fill_cache``, more (each with the next prompt) until every expert
    has been read into the cache, so that a fully cached run reads nothing."""
    from colibrid.pack.reader import Pack

    records = len(Pack.open(daemon.pack).manifest.expert_records)
    for prompt in prompts:
        run_clients(daemon.client(), [prompt], Sampling(WARMUP_TOKENS, sampling.greedy), 1)
        if not fill_cache or (daemon.status().get("cache") or {}).get("misses", 0) >= records:
            return
    log(f"warm-up: after {len(prompts)} requests some experts were never routed to; the run may read them")


def measure_llama(setup: Setup, gguf: Path, memory: Memory, prompts: list[list[int]], warmup: list[int]) -> dict:
    """A fresh llama-server with len(prompts) slots, one warm-up request, then the clients."""
    sampling = setup.sampling_for(memory)
    context_per_slot = -(-(len(warmup) + sampling.max_tokens + 64) // 256) * 256
    if memory.limit_bytes is not None:
        evict_from_page_cache(gguf)
    with _memory_cgroup(memory.limit_bytes) as group:
        try:
            server = LlamaServer(setup.llama_server, gguf, len(prompts), context_per_slot, setup.threads, group,
                                 setup.llama_args)
        except RuntimeError as error:
            return {"ok": 0, "errors": [str(error)[-2000:]]}
        try:
            run_clients(server.client(), [warmup], Sampling(WARMUP_TOKENS, sampling.greedy), 1)
            timings = run_clients(server.client(), prompts, sampling, setup.requests)
        finally:
            exit_code = server.proc.poll()  # set if it died during the run (the OOM killer: -9)
            log_text = server.stop()
        result = summarize(timings, sampling.max_tokens)
        result["command"] = " ".join(server.argv)
        if exit_code is not None:
            result["exit_code"] = exit_code
            result["oom_killed"] = exit_code == -signal.SIGKILL
        if group is not None:
            result["cgroup"] = group.usage()
    if result.get("errors"):
        result["log_tail"] = log_text[-2000:]
    return result


@contextmanager
def _memory_cgroup(limit_bytes: int | None) -> Iterator[MemoryCgroup | None]:
    """A MemoryCgroup with this limit, removed afterwards; None without a limit."""
    if limit_bytes is None:
        yield None
        return
    with MemoryCgroup(limit_bytes) as group:
        yield group


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def _f(value, spec: str = ".2f") -> str:
    """``value`` formatted by ``spec``; "n/a" (as wide) when there is none."""
    if value is None:
        width = spec.split(".")[0]
        return format("n/a", f">{width}") if width else "n/a"
    return format(value, spec)


def print_row(clients: int, name: str, r: dict) -> None:
    if not r.get("ok"):
        print(f"{clients:>3} {name:8} failed: {'; '.join(r.get('errors') or ['no tokens'])[:300]}", flush=True)
        return
    extra = ""
    if "cache" in r:
        extra += f"  cache {r['cache_bytes'] / 2**30:.2f} GiB, read {r['cache']['bytes_read'] / 1e6:.1f} MB"
    if r.get("cgroup"):
        extra += f"  peak {r['cgroup']['peak_bytes'] / 2**30:.2f} GiB, limit hit {r['cgroup']['limit_hits']}x"
    if r.get("oom_killed"):
        extra += "  OOM-killed"
    if r["short"] or r["errors"]:
        extra += f"  ({r['short']} short, {len(r['errors'])} failed: {r['finish_reasons']})"
    print(f"{clients:>3} {name:8} {_f(r['aggregate_decode_tok_s'], '8.2f')} {_f(r.get('steady_decode_tok_s'), '8.2f')} "
          f"{r['aggregate_tok_s']:8.2f}   "
          f"{_f(r['ttft_ms_p50'], '8.0f')} {_f(r['ttft_ms_p99'], '8.0f')}   {_f(r['itl_ms_p50'], '7.1f')} "
          f"{_f(r['itl_ms_p99'], '7.1f')}   {_f(r['prompt_tokens_mean'], '5.0f')}{extra}", flush=True)


def print_bound(rows: list[dict], step: StepBytes, bandwidth_gb_s: float | None, cached: bool) -> None:
    print("  bound: tokens per byte of a step of N sequences against one sequence's step (attention + head once, "
          "each distinct expert once)")
    print(f"  {'N':>3} {'distinct/layer':>14} {'(random)':>8} {'seq experts':>11} {'bound':>6} {'(random)':>8} "
          f"{'roofline tok/s':>14}  {'steps':>6} {'max_batch':>9}")
    for row in rows:
        n, batch = row["clients"], row["colibri"].get("batch") or {}
        distinct = batch.get("distinct_experts_per_layer_step")
        random_distinct = step.random_routing_distinct(n)
        measured_bound = step.tokens_per_byte_bound(n, distinct) if distinct is not None else None
        roofline = (bandwidth_gb_s * 1e9 * n / step.step(n, distinct if distinct is not None else random_distinct)
                    if cached and bandwidth_gb_s else None)
        row["bound"] = {"distinct_experts_per_layer_step": distinct, "random_routing_distinct": random_distinct,
                        "tokens_per_byte_bound": measured_bound,
                        "random_routing_bound": step.tokens_per_byte_bound(n, random_distinct),
                        "roofline_tok_s": roofline}
        print(f"  {n:>3} {_f(distinct, '14.1f')} {random_distinct:8.1f} "
              f"{_f(batch.get('sequence_experts_per_layer_step'), '11.1f')} {_f(measured_bound, '6.2f')} "
              f"{row['bound']['random_routing_bound']:8.2f} {_f(roofline, '14.1f')}  {_f(batch.get('steps'), '6.0f')} "
              f"{_f(_number(batch.get('max_batch')), '9.0f')}")


def read_bound(rows: list[dict], slot_bytes: int, moe_layers: int) -> None:
    """Under a memory limit the disk is the bound, and a step of N sequences needs its distinct
    experts of every MoE layer: even if each of the cache's slots held one of them, it reads the
    rest, (distinct x layers - slots) / N records a token at the least. Printed against what one
    sequence read a token in the same run (its own locality may do better than that floor), and
    their ratio: the most N clients can gain over one while the disk stays the bound."""
    print("  disk: expert records read a token (prompts included), and the least a step of N could read "
          "(every cache slot a hit)")
    print(f"  {'N':>3} {'slots':>6} {'needed/step':>11} {'least/token':>11} {'read/token':>10} {'bound vs 1':>10}")
    single = next((r for r in rows if r["clients"] == 1), None)
    single_read = _read_per_token(single["colibri"]) if single else None
    for row in rows:
        n, colibri = row["clients"], row["colibri"]
        distinct = (colibri.get("batch") or {}).get("distinct_experts_per_layer_step")
        slots = int(colibri["cache_bytes"] // slot_bytes) if isinstance(colibri.get("cache_bytes"), int) else None
        needed = distinct * moe_layers if distinct is not None else None
        least = max(0.0, needed - slots) / n if needed is not None and slots is not None else None
        ratio = single_read / least if single_read and least and n > 1 else None
        row["read_bound"] = {"slots": slots, "needed_per_step": needed, "least_per_token": least,
                             "read_per_token": _read_per_token(colibri), "bound_vs_single": ratio}
        print(f"  {n:>3} {_f(slots, '6.0f')} {_f(needed, '11.1f')} {_f(least, '11.1f')} "
              f"{_f(row['read_bound']['read_per_token'], '10.1f')} {_f(ratio, '10.2f')}")


def _read_per_token(colibri: dict) -> float | None:
    tokens = colibri.get("tokens")
    misses = (colibri.get("cache") or {}).get("misses")
    return misses / tokens if tokens and misses is not None else None


def target_medians(rounds: list[dict]) -> dict:
    """Per ratio of print_targets: its median over the rounds that have it, with the least and
    the greatest (None where no round has it)."""
    out = {}
    for key in rounds[0] if rounds else ():
        values = sorted(r[key] for r in rounds if r.get(key) is not None)
        out[key] = {"median": float(np.median(values)), "min": values[0], "max": values[-1],
                    "rounds": len(values)} if values else None
    return out


def print_target_medians(rounds: list[dict]) -> dict:
    medians = target_medians(rounds)

    def show(key: str) -> str:
        m = medians.get(key)
        return "n/a" if m is None else f"{m['median']:.2f}x ({m['min']:.2f}-{m['max']:.2f})"

    print(f"  over {len(rounds)} rounds, median (range): aggregate {show('vs_own_single')} Colibri's single client, "
          f"steady {show('steady_vs_own_single')}, {show('vs_llama_server')} llama-server's; p99 inter-token latency "
          f"{show('p99_itl_vs_single_median')} the single client's median", flush=True)
    return medians


def print_targets(rows: list[dict], cached: bool) -> dict:
    """Issue 16's ratios at TARGET_CLIENTS clients (n/a when a number is missing)."""
    by_n = {row["clients"]: row for row in rows}
    one, many = by_n.get(1), by_n.get(TARGET_CLIENTS)

    def get(row, side, key):
        value = row and row.get(side, {}).get(key)
        return value if isinstance(value, (int, float)) else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    ours_many = get(many, "colibri", "aggregate_decode_tok_s")
    targets = {
        "vs_own_single": ratio(ours_many, get(one, "colibri", "aggregate_decode_tok_s")),
        "vs_llama_server": ratio(ours_many, get(many, "llama_server", "aggregate_decode_tok_s")),
        "p99_itl_vs_single_median": ratio(get(many, "colibri", "itl_ms_p99"), get(one, "colibri", "itl_ms_p50")),
        "steady_vs_own_single": ratio(get(many, "colibri", "steady_decode_tok_s"),
                                      get(one, "colibri", "aggregate_decode_tok_s")),
    }
    own, llama = ("2.2", "1.2") if cached else ("2", "6")
    print(f"  targets at {TARGET_CLIENTS} clients: aggregate decode tok/s {_f(targets['vs_own_single'])}x Colibri's "
          f"single client (target >= {own}x; {_f(targets['steady_vs_own_single'])}x while all {TARGET_CLIENTS} decode), "
          f"{_f(targets['vs_llama_server'])}x llama-server's "
          f"(target >= {llama}x); p99 inter-token latency {_f(targets['p99_itl_vs_single_median'])}x the single "
          "client's median (target <= 3x)", flush=True)
    return targets


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def kernel_level(env: dict) -> str:
    """The kernel level colibrid will pick with this environment (COLIBRI_KERNELS included)."""
    return subprocess.run([sys.executable, "-c", "from colibrid import native; print(native.kernels())"],
                          env=dict(env, PYTHONPATH=str(REPO)), cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def packs_to_measure(args) -> list[tuple[str, Path, Path | None]]:
    """(name, pack, GGUF or None) per variant, built first when missing."""
    if args.pack:
        return [(args.pack.name, args.pack, args.gguf)]
    variants = [SHAPE.variant(name) for name in (args.quant or SHAPE.default_variants)]
    files = prepare(args.work, SHAPE, variants, args.layers, not args.skip_llama, keep_checkpoint=False)
    return [(v.name, *files[v.name]) for v in variants]


def sweep(setup: Setup, clients: list[int], prompt_tokens: int, name: str, pack: Path, gguf: Path | None, memory,
          texts: list[str], ids: list, llama_server: Path | None) -> list[dict]:
    """One row per number of clients: Colibri (and llama-server) started afresh for each."""
    rows = []
    print(f"{'N':>3} {'server':8} {'dec t/s':>8} {'steady':>8} {'all t/s':>8}   {'TTFT p50':>8} {'p99 ms':>8}   "
          f"{'ITL p50':>7} {'p99 ms':>7}   {'prompt'}", flush=True)
    for n in clients:
        tokens = prompt_tokens + 1 + setup.sampling_for(memory).max_tokens  # + 1: a BOS the model may add
        cache_bytes = colibri_cache_bytes(pack, memory, n, tokens, setup.kv_type)
        if isinstance(cache_bytes, str):  # no comparison to make: llama-server is not run either
            print(f"{n:>3} skipped: {cache_bytes}", flush=True)
            continue
        row = {"variant": name, "memory": memory.name, "limit_bytes": memory.limit_bytes, "clients": n,
               "colibri": measure_colibri(setup, pack, memory, cache_bytes, kv_cache_bytes(pack, n, tokens, setup.kv_type),
                                          texts[:n], texts[max(clients):])}
        print_row(n, "colibri", row["colibri"])
        if llama_server and gguf:
            row["llama_server"] = measure_llama(setup, gguf, memory, ids[:n], ids[max(clients)])
            print_row(n, "llama", row["llama_server"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "colibri-bench")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help=f"decoder layers (default {DEFAULT_LAYERS}; "
                        f"the model has {SHAPE.default_layers})")
    parser.add_argument("--quant", action="append", choices=[v.name for v in SHAPE.variants],
                        help="a variant (default: q8_0 and q4_g64)")
    parser.add_argument("--pack", type=Path, help="measure this pack instead of the OLMoE-shaped ones")
    parser.add_argument("--gguf", type=Path, help="with --pack: the same model for llama-server")
    parser.add_argument("--memory", default="cached,limited", help="cached, limited or both")
    parser.add_argument("--limit-fraction", type=float, default=0.4, help="memory limit as a fraction of the pack")
    parser.add_argument("--limit", help="memory limit (\"3G\"), instead of --limit-fraction")
    parser.add_argument("--clients", default="1,2,4,8,16", help="numbers of concurrent clients")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--limited-tokens", type=int,
                        help="tokens per request under the memory limit (default --tokens)")
    parser.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    parser.add_argument("--greedy", action="store_true", help="temperature 0 instead of seeded sampling")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="avx2: COLIBRI_KERNELS=avx2 against llama.cpp built for AVX2 without AVX-512")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="compute threads, both sides")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--skip-roofline", action="store_true", help="do not measure the memory bandwidth")
    parser.add_argument("--kv-cache-type", choices=["f32", "f16"], default="f32",
                        help="colibrid's KV cache type, counted in its memory under --memory limited (default f32)")
    parser.add_argument("--daemon-args", default="", help="more colibrid flags, e.g. \"--max-batch 8\"")
    parser.add_argument("--llama-args", default="", help="more llama-server flags, e.g. \"--no-repack\"")
    parser.add_argument("--prepare-only", action="store_true", help="build the files and llama-server, measure nothing")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the sweep of client counts this many times; also the ratios' median over rounds")
    parser.add_argument("--json", type=Path, help="also write every result (each request's timings too) here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    clients = sorted({int(n) for n in args.clients.split(",")})
    if args.gguf and not args.pack:
        parser.error("--gguf goes with --pack")
    if not set(args.memory.split(",")) <= {"cached", "limited"}:
        parser.error(f"--memory takes cached, limited or cached,limited, not {args.memory}")

    args.work.mkdir(parents=True, exist_ok=True)
    # llama.cpp first: its tree carries the gguf package the GGUFs are written with
    llama_server = None
    if not args.skip_llama:
        llama_server = build_llama_bench(args.work, args.isa, ("llama-bench", "llama-server")).parent / "llama-server"
    to_measure = packs_to_measure(args)
    if args.prepare_only:
        return 0

    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    if args.isa == "avx2":
        env["COLIBRI_KERNELS"] = "avx2"
    setup = Setup(args.threads, env, llama_server, Sampling(args.tokens, args.greedy),
                  Sampling(args.limited_tokens or args.tokens, args.greedy), args.requests, args.daemon_args.split(),
                  args.llama_args.split(), args.kv_cache_type)
    bandwidth = None if args.skip_roofline else memory_bandwidth(args.threads)
    machine = {"cpu": cpu_model(), "colibri_kernels": kernel_level(env), "isa": args.isa, "threads": args.threads,
               "llama_server": str(llama_server) if llama_server else None, "bandwidth_gb_s": bandwidth}
    print(f"{machine['cpu']}; Colibri kernels {machine['colibri_kernels']}; llama.cpp build "
          f"{llama_server.parent.parent.name if llama_server else 'n/a'} (--isa {args.isa}); {args.threads} threads; "
          f"memory read bandwidth {_f(bandwidth, '.1f')} GB/s", flush=True)
    shape = f"{SHAPE.description}; {args.layers} layers" if not args.pack else f"{args.pack}"
    print(f"{shape}; prompts of ~{args.prompt_tokens} "
          f"tokens, {args.tokens} tokens each ({'greedy' if args.greedy else 'seeded sampling'}, end-of-sequence "
          f"ignored), {args.requests} request(s) per client", flush=True)

    results = []
    for name, pack, gguf in to_measure:
        # one prompt per client, then the warm-ups': prompts no client asks (a prefix cache must not help a client)
        texts = colibri_prompts(pack, max(clients) + WARMUP_PROMPTS, args.prompt_tokens, PROMPT_SEED)
        step = StepBytes.of(pack)
        ids = llama_prompts(step.vocab_size, max(clients) + 1, args.prompt_tokens, PROMPT_SEED)
        for memory in memory_settings(args.memory, pack, args.limit, args.limit_fraction):
            limit = f", limit {memory.limit_bytes / 2**30:.2f} GiB" if memory.limit_bytes else ""
            rounds = []
            for round_number in range(1, args.rounds + 1):
                print(f"\n{name} {memory.name}{limit}" + (f", round {round_number} of {args.rounds}" if args.rounds > 1 else ""))
                rows = sweep(setup, clients, args.prompt_tokens, name, pack, gguf, memory, texts, ids, llama_server)
                if rows:
                    print_bound(rows, step, bandwidth, memory.limit_bytes is None)
                    if memory.limit_bytes is not None:
                        read_bound(rows, step.slot_bytes, step.moe_layers)
                    targets = print_targets(rows, memory.limit_bytes is None)
                    rounds.append(targets)
                    results.append({"variant": name, "memory": asdict(memory), "round": round_number, "rows": rows,
                                    "targets": targets})
            if len(rounds) > 1:
                results[-1]["targets_over_rounds"] = print_target_medians(rounds)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

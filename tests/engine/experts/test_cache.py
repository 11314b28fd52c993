"""CachedExpertSource as the engine's ExpertSource: the same logits and tokens as the plain
pread path for every cache size and policy, clean errors for damaged or missing expert
files, and a lock_memory = "required" failure that says how to fix the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import numpy as np
import pytest

from tests.tiny_checkpoints import CheckpointSpec

# 8 experts, top-2, a shared expert; layers 0 and 2 are dense MLPs, so the expert index has holes.
SPEC = CheckpointSpec("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2})
MOE_LAYERS = [1, 3]
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 11, 200, 31, 8]


@pytest.fixture(scope="module")
def pack_path(packs):
    return packs.pack(SPEC, "q8_0")


@pytest.fixture(scope="module")
def reference(pack_path):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(pack_path))
    return engine.forward(PROMPT), engine.greedy(PROMPT, 10)


def _cached_engine(path, **kwargs):
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(path)
    kwargs.setdefault("hugepages", "off")
    source = CachedExpertSource(pack, **kwargs)
    return Engine(pack, experts=source), source


def _slot_bytes(path) -> int:
    from colibrid.pack.reader import Pack

    record = Pack.open(path).manifest.expert_records[0].length
    return -(-record // 4096) * 4096


# GLM-4.5's layout as well: sigmoid routing with a choice bias and a group limit, a dense first
# layer, an ungated shared expert, partial rotary (8 experts, top-2, MoE layers 1 and 2).
GLM_SPEC = CheckpointSpec("glm4_moe", {"num_hidden_layers": 3, "use_qk_norm": True, "attention_bias": True, "n_group": 4,
                                       "topk_group": 2, "routed_scaling_factor": 2.5})
# gpt-oss's: biases inside every expert record, a clamped SwiGLU, the top-k-then-softmax router
# with a bias, attention sinks, a sliding layer (window 4) and a full one (8 experts, top-2).
GPT_OSS_SPEC = CheckpointSpec("gpt_oss", {"swiglu_limit": 0.15})
# DeepSeek-V3's: latent attention (its latent cache), sigmoid routing with groups, a shared
# expert, a dense first layer (8 experts, top-2, MoE layers 1 and 2).
DEEPSEEK_SPEC = CheckpointSpec("deepseek_v3", {"num_hidden_layers": 3})
# Qwen3.5-MoE's: three Gated DeltaNet layers (their conv and recurrent states), a gated
# full-attention layer, a sigmoid-gated shared expert (8 experts, top-2, every layer MoE).
QWEN3_5_SPEC = CheckpointSpec("qwen3_5_moe")
# Llama 4's: top-1 by logit with the sigmoid weight on the expert's input, a shared expert, dense MLPs on
# layers 0 and 2, chunked attention, a NoPE layer (8 experts, MoE layers 1 and 3).
LLAMA4_SPEC = CheckpointSpec("llama4")
# Gemma 4's: GeGLU experts beside a dense MLP, a router with its own norm and per-expert scales,
# per-layer inputs, a sliding and a full layer of different head shapes (8 experts, top-2).
GEMMA4_SPEC = CheckpointSpec("gemma4_text")
FAMILIES = {"qwen2_moe": (SPEC, MOE_LAYERS), "glm4_moe": (GLM_SPEC, [1, 2]), "deepseek_v3": (DEEPSEEK_SPEC, [1, 2]),
            "gpt_oss": (GPT_OSS_SPEC, [0, 1]), "qwen3_5_moe": (QWEN3_5_SPEC, [0, 1, 2, 3]),
            "llama4": (LLAMA4_SPEC, [1, 3]), "gemma4": (GEMMA4_SPEC, [0, 1])}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, packs):
    """(pack path, its uncached logits and greedy tokens, its MoE layers) per family."""
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    spec, moe_layers = FAMILIES[request.param]
    path = packs.pack(spec, "q8_0")
    engine = Engine(Pack.open(path))
    return path, (engine.forward(PROMPT), engine.greedy(PROMPT, 10)), moe_layers


@pytest.mark.parametrize("policy", ["lru", "lfru", "lfu-decay", "next-use"])
@pytest.mark.parametrize("n_slots", [1, 2, 3, 7, 64])  # 1 < top-k; 64 > every expert of the pack
def test_any_cache_size_gives_bit_identical_output(family, n_slots, policy):
    pack_path, (logits_ref, tokens_ref), moe_layers = family
    engine, source = _cached_engine(pack_path, cache_bytes=n_slots * _slot_bytes(pack_path), policy=policy)
    try:
        all_experts = 8 * len(moe_layers)  # every family's packs have 8 experts a layer
        assert source.max_pinned == min(n_slots, all_experts)
        logits = engine.forward(PROMPT)
        assert logits.dtype == logits_ref.dtype and np.array_equal(logits, logits_ref)
        assert engine.greedy(PROMPT, 10) == tokens_ref
        st = source.stats()
        assert st["pinned"] == 0 and st["total"]["load_failures"] == 0
        assert [layer["layer"] for layer in st["layers"]] == moe_layers
        if n_slots >= all_experts:
            assert st["total"]["evictions"] == 0 and st["total"]["misses"] <= all_experts
    finally:
        source.close()


def _wrapping(source):
    """An ExpertSource that passes every member on to ``source``; tests override a few."""
    from colibrid.engine.experts.source import ExpertSource

    class Wrapper(ExpertSource):
        max_pinned = property(lambda self: source.max_pinned)
        prefetch_enabled = property(lambda self: source.prefetch_enabled)
        io_queue_depth = property(lambda self: source.io_queue_depth)
        loading_pause = property(lambda self: source.loading_pause)
        holds_every_expert = property(lambda self: source.holds_every_expert)

        def acquire(self, layer, experts):
            return source.acquire(layer, experts)

        def get(self, layer, expert):
            return source.get(layer, expert)

        def prefetch(self, layer, experts):
            return source.prefetch(layer, experts)

        def summary(self):
            return source.summary()

        def set_io_queue_depth(self, depth):
            source.set_io_queue_depth(depth)

        def set_prefetch(self, enabled):
            source.set_prefetch(enabled)

        def set_loading_paused(self, pause):
            source.set_loading_paused(pause)

        def return_hugepages(self):
            source.return_hugepages()

        def close(self):
            source.close()

    return Wrapper


def _prefetching_source(source, rng):
    """Wraps a CachedExpertSource and, at every layer step, prefetches a guess for the next
    MoE layer (besides the real lookahead of moe.py): checks that prefetch, even one that
    guesses wrong and fights a tiny cache for slots, never changes the output."""

    class PrefetchingSource(_wrapping(source)):
        def acquire(self, layer, experts):
            nxt = (layer + 2) % 4
            source.prefetch(nxt, [int(e) for e in rng.choice(8, size=3, replace=False)])
            return source.acquire(layer, experts)

    return PrefetchingSource()


@pytest.mark.parametrize("n_slots", [1, 3, 16])
def test_prefetch_never_changes_the_output(pack_path, reference, n_slots):
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    source = CachedExpertSource(pack, n_slots * _slot_bytes(pack_path), hugepages="off", io_queue_depth=4)
    try:
        engine = Engine(pack, experts=_prefetching_source(source, np.random.default_rng(n_slots)))
        assert np.array_equal(engine.forward(PROMPT), reference[0])
        assert engine.greedy(PROMPT, 10) == reference[1]
        total = source.stats()["total"]
        assert total["prefetch_issued"] + total["prefetch_skipped"] > 0
        assert total["prediction_precision"] is not None and 0 <= total["prediction_recall"] <= 1
        source.set_prefetch(False)
        assert source.prefetch(0, [1, 2]) == 0
    finally:
        source.close()


def _recording_source(source):
    """Wraps a CachedExpertSource and records every prefetch the engine's lookahead makes,
    with the layer step in progress and whether the engine had already taken (waited for)
    every expert of that step."""
    from colibrid.engine.experts.source import AcquiredExperts

    class Lookups(AcquiredExperts):
        """An acquire's {expert: weights} that notes which experts were looked up."""

        def __init__(self, weights, taken):
            self.weights, self.taken = weights, taken

        def __getitem__(self, expert):
            self.taken.add(expert)
            return self.weights[expert]

        def __iter__(self):
            return iter(self.weights)

        def __len__(self):
            return len(self.weights)

        def is_ready(self, expert):
            return self.weights.is_ready(expert)

    class RecordingSource(_wrapping(source)):
        prefetch_enabled = True
        step = None  # (layer, experts, the experts the engine has looked up) in progress

        def __init__(self):
            self.prefetches = []  # (step layer, predicted layer, predicted experts, step all taken)

        @contextmanager
        def acquire(self, layer, experts):
            taken = set()
            with source.acquire(layer, experts) as weights:
                self.step = (layer, list(experts), taken)
                yield Lookups(weights, taken)
                self.step = None

        def prefetch(self, layer, experts):
            step_layer, ids, taken = self.step
            self.prefetches.append((step_layer, layer, list(experts), taken == set(ids)))
            return source.prefetch(layer, experts)

    return RecordingSource()


@pytest.mark.parametrize("n_slots", [2, 3])
def test_lookahead_reads_the_next_layer_only_once_this_layer_is_loaded(pack_path, reference, n_slots):
    """The lookahead of moe.py: layer 1 predicts layer 3's likeliest experts, and starts those
    reads only when every expert of its own step is in (so they never delay a read the step
    waits for); the output stays bit-identical."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.engine.forward.moe import LOOKAHEAD_TOP
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    source = CachedExpertSource(pack, n_slots * _slot_bytes(pack_path), hugepages="off", prefetch=True)
    try:
        recorder = _recording_source(source)
        engine = Engine(pack, experts=recorder)
        assert np.array_equal(engine.forward(PROMPT), reference[0])
        assert engine.greedy(PROMPT, 10) == reference[1]
        assert len(recorder.prefetches) >= 11  # every step of layer 1: the prompt, then each token
        for step_layer, layer, experts, step_taken in recorder.prefetches:
            assert (step_layer, layer) == (1, 3) and step_taken
            assert 1 <= len(experts) <= max(1, n_slots // 2)
        decode = recorder.prefetches[-1][2]
        assert len(decode) <= LOOKAHEAD_TOP and len(set(decode)) == len(decode)
        total = source.stats()["total"]
        assert total["misses"] > 0 and total["prefetch_issued"] > 0  # the cache is small: reads happen
    finally:
        source.close()


@pytest.mark.parametrize("predictor", ["router-on-moe-input", "router-on-residual"])
def test_the_lookahead_stops_guessing_once_the_cache_holds_every_expert(pack_path, reference, predictor):
    """A cache with a slot for every expert: the lookahead guesses until every record is in,
    then no more (each guess would be a hit); a smaller cache never gets there."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    records = len(pack.manifest.expert_records)
    small = CachedExpertSource(pack, (records - 1) * _slot_bytes(pack_path), hugepages="off")
    try:
        for layer, expert in ((r.layer, r.expert) for r in pack.manifest.expert_records):
            with small.acquire(layer, [expert]):
                pass
        assert not small.holds_every_expert  # one slot short: something is always out
    finally:
        small.close()
    source = CachedExpertSource(pack, records * _slot_bytes(pack_path), hugepages="off", prefetch=True)
    guesses = []

    class Counting(_wrapping(source)):
        def prefetch(self, layer, experts):
            guesses.append(layer)
            return source.prefetch(layer, experts)

    try:
        engine = Engine(pack, experts=Counting(), lookahead_predictor=predictor)
        assert not source.holds_every_expert
        assert engine.greedy(PROMPT, 10) == reference[1]
        assert guesses  # the cache was filling up
        for layer, expert in ((r.layer, r.expert) for r in pack.manifest.expert_records):
            with source.acquire(layer, [expert]):
                pass
        assert source.holds_every_expert
        before = len(guesses)
        assert engine.greedy(PROMPT, 10) == reference[1]
        assert len(guesses) == before
    finally:
        source.close()


def test_lookahead_picks_one_row_s_guesses_or_what_most_rows_guess():
    from colibrid.engine.forward.moe import LOOKAHEAD_TOP, lookahead_picks

    assert LOOKAHEAD_TOP == 4
    assert lookahead_picks(np.array([[5, 3, 9, 1]])) == [5, 3, 9, 1]  # one row: its own order
    rows = np.array([[5, 3, 9, 1], [3, 5, 2, 7], [9, 3, 8, 6]])
    # 3 is named by all three rows; 5 and 9 by two, each first in some row (the lower id first);
    # then, of those named once, 2 and 8 (third in their rows) before 1, 7 and 6 (fourth)
    assert lookahead_picks(rows) == [3, 5, 9, 2]
    many = np.random.default_rng(0).permuted(np.tile(np.arange(16), (8, 1)), axis=1)[:, :4]
    picked = lookahead_picks(many)
    assert len(picked) == LOOKAHEAD_TOP and len(set(picked)) == LOOKAHEAD_TOP
    votes = {int(e): int((many == e).sum()) for e in np.unique(many)}
    assert len(votes) > LOOKAHEAD_TOP  # eight rows name more than a token's share...
    assert min(votes[e] for e in picked) >= max(v for e, v in votes.items() if e not in picked)  # ...the most-named win


def test_a_batch_step_reads_ahead_what_most_of_its_rows_guess(pack_path, monkeypatch):
    """Three sequences decoding together: each step's lookahead reads the LOOKAHEAD_TOP experts
    the most rows guess, not the union of every row's guesses (under a memory limit the
    batch's own misses keep the disk busy, and every wrong guess costs a whole read)."""
    from colibrid.engine.forward import moe
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.engine.forward.model import StepInput
    from colibrid.pack.reader import Pack

    guessed = []
    real_guesses = moe.MoeBlock._guesses

    def recording_guesses(block, rows, router_input):
        guesses = real_guesses(block, rows, router_input)
        guessed.append(guesses[:, : moe.LOOKAHEAD_TOP])
        return guesses

    monkeypatch.setattr(moe.MoeBlock, "_guesses", recording_guesses)
    pack = Pack.open(pack_path)
    n_slots = 12  # of 16 records: the cache never holds every expert, and caps no pick (max_pinned // 2 >= 4)
    source = CachedExpertSource(pack, n_slots * _slot_bytes(pack_path), hugepages="off", prefetch=True)
    try:
        recorder = _recording_source(source)
        engine = Engine(pack, experts=recorder)
        sessions = [engine.new_session(32) for _ in range(3)]
        prompts = [PROMPT[:5], PROMPT[5:9], PROMPT[9:]]
        logits = engine.model.forward_batch([StepInput(s.state, np.array(p, np.int32), "last")
                                             for s, p in zip(sessions, prompts)])
        tokens = [int(np.argmax(rows[-1])) for rows in logits]
        guessed.clear()
        recorder.prefetches.clear()
        for _ in range(4):
            logits = engine.model.forward_batch([StepInput(s.state, np.array([t], np.int32), "last")
                                                 for s, t in zip(sessions, tokens)])
            tokens = [int(np.argmax(rows[-1])) for rows in logits]
        assert len(recorder.prefetches) == len(guessed) == 4  # layer 1 guesses layer 3's, once a step
        for (_, layer, experts, _), guesses in zip(recorder.prefetches, guessed):
            assert layer == 3 and guesses.shape[0] == 3
            assert experts == moe.lookahead_picks(guesses) and len(experts) <= moe.LOOKAHEAD_TOP
        assert any(len(np.unique(g)) > moe.LOOKAHEAD_TOP for g in guessed)  # the rows' union was more
    finally:
        source.close()


def test_lookahead_on_the_residual_guesses_from_the_stream_leaving_the_layer(pack_path, reference):
    """lookahead_predictor = "router-on-residual": once layer 1 has run whole, layer 3's router
    on the residual stream leaving layer 1 (through layer 3's pre-MoE norm) names what is read
    ahead; the output stays bit-identical."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.engine.forward.moe import LOOKAHEAD_TOP
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    n_slots = 4  # two guesses a token
    source = CachedExpertSource(pack, n_slots * _slot_bytes(pack_path), hugepages="off", prefetch=True)

    class Recording(_wrapping(source)):
        in_step = False
        prefetches = []  # (predicted layer, experts, asked while a layer step held its experts)

        @contextmanager
        def acquire(self, layer, experts):
            with source.acquire(layer, experts) as weights:
                self.in_step = True
                yield weights
                self.in_step = False

        def prefetch(self, layer, experts):
            self.prefetches.append((layer, list(experts), self.in_step))
            return source.prefetch(layer, experts)

    recorder = Recording()
    try:
        engine = Engine(pack, experts=recorder, lookahead_predictor="router-on-residual")
        assert np.array_equal(engine.forward(PROMPT), reference[0])
        assert engine.greedy(PROMPT, 10) == reference[1]
        assert len(recorder.prefetches) >= 11 and all(layer == 3 and not in_step
                                                      for layer, _, in_step in recorder.prefetches)
        model, capture = engine.model, engine.model.routing_capture
        capture.enabled = capture.keep_hidden = True
        try:
            session = engine.new_session(max_context=len(PROMPT) + 2)
            session.forward(PROMPT, all_logits=False)
            session.forward([reference[1][0]], all_logits=False)  # one decode token
            residual = capture.step().residuals[0]  # (1, D) leaving layer 1
        finally:
            capture.enabled = capture.keep_hidden = False
        guess = model.layers[3].moe.router(model.layers[3].router_input_of(residual)).experts[0]
        assert recorder.prefetches[-1][1] == guess[:LOOKAHEAD_TOP].tolist()[: max(1, n_slots // 2)]
        assert source.stats()["total"]["prefetch_issued"] > 0
        with pytest.raises(ValueError, match="lookahead_predictor"):
            Engine(pack, experts=recorder, lookahead_predictor="oracle")
    finally:
        source.close()


def test_stats_and_backing_info_say_what_happened(pack_path):
    engine, source = _cached_engine(pack_path, cache_bytes="64M", lock_memory="try")
    try:
        engine.forward(PROMPT)
        first = source.stats()["total"]
        engine.forward(PROMPT)
        second = source.stats()["total"]
        assert second["misses"] == first["misses"]  # all 16 experts fit: the second pass only hits
        assert second["hits"] > first["hits"] and second["hit_rate"] > first["hit_rate"]
        assert first["bytes_read"] == first["loads"] * _slot_bytes(pack_path) and first["loads"] >= first["misses"]
        assert first["read_ms_p50"] is not None and first["read_ms_p50"] <= first["read_ms_p99"]
        summary = source.summary()
        assert source.hits_and_misses() == (summary["hits"], summary["misses"]) \
            == (second["hits"] + second["inflight_hits"], second["misses"])
        info = source.backing_info()
        assert info["backing"] == "pages" and info["direct"] is True and info["slots"] == 16
        assert info["locked"] == (info["lock_errno"] is None)
        source.set_io_queue_depth(2)
        assert source.backing_info()["io_queue_depth"] == 2
        with pytest.raises(ValueError):
            source.set_io_queue_depth(0)
        source.reset_stats()
        assert source.stats()["total"]["requests"] == 0
    finally:
        source.close()


def test_get_returns_a_copy_that_outlives_the_pin(pack_path):
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack.reader import Pack

    _, source = _cached_engine(pack_path, cache_bytes=_slot_bytes(pack_path))
    plain = PreadExpertSource(Pack.open(pack_path))
    try:
        a = source.get(1, 3)
        source.get(3, 5)  # reuses the only slot
        b = plain.get(1, 3)
        for part in ("gate", "up", "down"):
            assert np.array_equal(np.asarray(getattr(a, part).data), np.asarray(getattr(b, part).data))
    finally:
        source.close()
        plain.close()


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _asking_recorder(source):
    """Wraps a PreadExpertSource and remembers which experts each layer step asked for."""

    class Recorder(_wrapping(source)):
        def __init__(self):
            self.asked = {}

        def acquire(self, layer, experts):
            self.asked.setdefault(layer, set()).update(int(e) for e in experts)
            return source.acquire(layer, experts)

    return Recorder()


def test_a_flipped_byte_fails_that_request_and_the_record_stays_marked_until_it_reads_intact(pack_path, reference, tmp_path):
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.source import ExpertChecksumError, ExpertDamagedError, PreadExpertSource
    from colibrid.pack.reader import Pack

    path = shutil.copytree(pack_path, tmp_path / "pack")
    recorder = _asking_recorder(PreadExpertSource(Pack.open(path)))
    Engine(Pack.open(path), experts=recorder).forward(PROMPT)
    layer = MOE_LAYERS[0]
    assert sorted(recorder.asked) == MOE_LAYERS
    used = sorted(recorder.asked[layer])
    unused = sorted(set(range(8)) - recorder.asked[layer])
    damaged = used[0]
    record = Pack.open(path).expert_record(layer, damaged)
    engine, source = _cached_engine(path, cache_bytes=4 * _slot_bytes(path))
    try:
        _flip(path / "experts.bin", record.offset + 1000)
        with pytest.raises(ExpertChecksumError) as err:
            engine.forward(PROMPT)
        e = err.value
        assert (e.layer, e.expert, e.offset) == (layer, damaged, record.offset)
        assert f"expert {damaged} of layer {layer}" in str(e) and f"offset {record.offset}" in str(e)
        assert source.stats()["pinned"] == 0  # the failed step released its pins
        assert source.stats()["total"]["load_failures"] == 1
        for expert in unused[:2] + used[1:2]:
            source.get(layer, expert)  # requests that do not need the damaged expert succeed
        _flip(path / "experts.bin", record.offset + 1000)  # the file is fixed
        # The record stays marked damaged: a request needing it fails at once, without reading it
        # (a read would now succeed) ...
        with pytest.raises(ExpertDamagedError, match=f"pack damaged: expert {damaged} of layer {layer}"):
            engine.forward(PROMPT)
        # ... until a verify reads it intact and clears the mark; then it is read again, not a stale slot.
        engine.pack.damage.clear(layer, damaged)
        assert np.array_equal(engine.forward(PROMPT), reference[0])
    finally:
        source.close()


def test_a_truncated_experts_file_gives_a_clean_error(pack_path, tmp_path):
    from colibrid.engine.experts.source import ExpertLoadError
    from colibrid.pack.reader import Pack

    path = shutil.copytree(pack_path, tmp_path / "pack")
    last = Pack.open(path).manifest.expert_records[-1]
    engine, source = _cached_engine(path, cache_bytes="1M")
    try:
        os.truncate(path / "experts.bin", last.offset)
        with pytest.raises(ExpertLoadError, match="short read") as err:
            source.get(last.layer, last.expert)
        assert (err.value.layer, err.value.expert, err.value.offset) == (last.layer, last.expert, last.offset)
    finally:
        source.close()


def test_a_missing_experts_file_fails_at_start(pack_path, tmp_path):
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack

    path = shutil.copytree(pack_path, tmp_path / "pack")
    pack = Pack.open(path)
    (path / "experts.bin").unlink()
    with pytest.raises(ExpertCacheError, match="experts.bin.*No such file"):
        CachedExpertSource(pack, "1M", hugepages="off")


def test_a_cache_smaller_than_one_record_says_how_big_it_must_be(pack_path):
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack

    with pytest.raises(ExpertCacheError, match="smaller than one expert record"):
        CachedExpertSource(Pack.open(pack_path), 4096, hugepages="off")
    with pytest.raises(ExpertCacheError, match="lock_memory"):
        CachedExpertSource(Pack.open(pack_path), "1M", lock_memory="always")


_LOCK_SCRIPT = textwrap.dedent("""
    import sys
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack
    from colibrid.system.cache_memory import MachineMemory
    pack = Pack.open(sys.argv[1])
    memory = MachineMemory(hugepage_record=None)  # the daemon's: its fix-it hint names the service unit
    source = CachedExpertSource(pack, "1M", hugepages="off", lock_memory="try", memory=memory)
    info = source.backing_info()
    print("try:", info["locked"], info["lock_errno"], len(info["notes"]))
    source.close()
    try:
        CachedExpertSource(pack, "1M", hugepages="off", lock_memory="required", memory=memory)
    except ExpertCacheError as exc:
        print("required:", exc)
        sys.exit(3)
""")


def test_lock_memory_required_fails_with_a_fix_when_the_limit_is_too_low(pack_path):
    """RLIMIT_MEMLOCK lowered to 64 KiB and CAP_IPC_LOCK dropped (root would bypass the limit)."""
    import resource

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_IPC_LOCK")

    def lower_limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))

    proc = subprocess.run(
        [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", _LOCK_SCRIPT, str(pack_path)],
        capture_output=True, text=True, timeout=120, preexec_fn=lower_limit,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "try: False ENOMEM 1" in proc.stdout
    message = proc.stdout.split("required:", 1)[1]
    for needle in ("lock_memory = \"required\"", "LimitMEMLOCK", "CAP_IPC_LOCK", "64.0 KiB"):
        assert needle in message


def test_sizes_parse_like_the_config_says():
    from colibrid.system.memory import parse_size

    assert parse_size("6G") == 6 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    assert parse_size(12345) == 12345 and parse_size("4096") == 4096
    assert parse_size("40%", available_bytes=1000) == 400
    assert 0 < parse_size("10%") < parse_size("20%")
    for bad in ("6X", "-1G", "0%", "150%", True):
        with pytest.raises(ValueError):
            parse_size(bad)


# ---- memory: RSS within budget, and a cgroup limit below the pack size --------------------------

_DECODE_SCRIPT = textwrap.dedent("""
    import json, sys
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack
    pack = Pack.open(sys.argv[1])
    baseline = rss()
    source = CachedExpertSource(pack, int(sys.argv[2]), hugepages="off", lock_memory="try")
    engine = Engine(pack, experts=source)
    session = engine.new_session(max_context=64)
    token, peak = 1, rss()
    for _ in range(int(sys.argv[3])):
        token = int(session.forward([token], all_logits=False)[-1].argmax())
        peak = max(peak, rss())
    stats = source.stats()["total"]
    c = engine.config
    kv_bytes = 2 * c.num_layers * session.max_context * c.num_kv_heads * c.head_dim * 4  # f32 keys + values
    print(json.dumps({"baseline": baseline, "peak": peak, "cache_bytes": source.n_slots * source.slot_bytes,
                      "dense_bytes": pack.manifest.dense_size, "kv_bytes": kv_bytes,
                      "misses": stats["misses"], "bytes_read": stats["bytes_read"]}))
""")

# Python-side working memory of a decode step (activations, logits, numpy temporaries, the
# loader threads' stacks as touched) on top of dense + cache + KV. Documented in the report.
RSS_OVERHEAD_BYTES = 32 << 20


@pytest.fixture(scope="module")
def big_pack(tmp_path_factory):
    """A pack whose experts (157 MiB) are larger than the memory limit below."""
    import importlib.util

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "bench_aepc.py")
    spec = importlib.util.spec_from_file_location("bench_aepc", bench)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("aepc") / "big.pack"
    return module.build_shaped_pack(out, num_layers=4, num_experts=48, top_k=4, hidden=512, ffn=512, vocab=2048,
                                    heads=8, kv_heads=8, quant="q8_0")


def _run_decode(pack, cache_bytes: int, tokens: int, preexec_fn=None):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT, str(pack), str(cache_bytes), str(tokens)],
                          capture_output=True, text=True, timeout=300, cwd=root, preexec_fn=preexec_fn)
    return proc


def test_resident_memory_stays_within_dense_plus_cache_plus_kv(big_pack):
    import json

    proc = _run_decode(big_pack, 12 << 20, 12)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    assert m["bytes_read"] > 12 << 20  # experts really streamed through the cache
    budget = m["dense_bytes"] + m["cache_bytes"] + m["kv_bytes"] + RSS_OVERHEAD_BYTES
    assert m["peak"] - m["baseline"] <= budget, m


CGROUP = "/sys/fs/cgroup/memory"


@pytest.mark.skipif(not os.access(CGROUP, os.W_OK), reason="needs a writable cgroup v1 memory controller")
def test_generation_completes_in_a_memory_cgroup_smaller_than_the_pack(big_pack, tmp_path):
    import json

    pack_bytes = sum(f.stat().st_size for f in big_pack.iterdir())
    limit = 112 << 20
    assert limit < pack_bytes
    group = os.path.join(CGROUP, f"colibri-test-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))

        def enter():
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        proc = _run_decode(big_pack, 8 << 20, 24, preexec_fn=enter)
        assert proc.returncode == 0, proc.stderr[-2000:]
        m = json.loads(proc.stdout)
        with open(os.path.join(group, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
        assert peak <= limit
        assert m["bytes_read"] > limit  # more expert bytes went through than the limit holds
    finally:
        os.rmdir(group)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/sys/vm/nr_hugepages", os.W_OK),
                    reason="raising vm.nr_hugepages needs root")
def test_hugepages_auto_raises_the_pool_and_gives_it_back(pack_path, reference, tmp_path):
    from colibrid.system.memory import meminfo

    from colibrid.system.cache_memory import MachineMemory

    before = int(open("/proc/sys/vm/nr_hugepages").read())
    engine, source = _cached_engine(pack_path, cache_bytes="2M", hugepages="auto",
                                    memory=MachineMemory(tmp_path / "hugepages.json"))
    try:
        info = source.backing_info()
        if info["backing"] != "hugetlb":  # the kernel could not find free 2 MiB pages
            assert info["notes"] and "hugetlb pages not used" in info["notes"][0]
        else:
            assert info["region_bytes"] % (2 << 20) == 0
            assert meminfo()["HugePages_Total"] >= before + info["hugepages_added"]
        assert np.array_equal(engine.forward(PROMPT), reference[0])
    finally:
        source.close()
    assert int(open("/proc/sys/vm/nr_hugepages").read()) == before


# ---- the memory budget and the hugepages it may take -------------------------------------------


def _budget(mem_available_bytes: int, cgroup_room_bytes: int | None):
    from colibrid.system.cgroup_memory import CgroupLimit
    from colibrid.system.memory import MemoryBudget

    limit = None if cgroup_room_bytes is None else CgroupLimit(
        1, "/colibri-test", "memory.limit_in_bytes", cgroup_room_bytes + (64 << 20), 64 << 20, counts_hugetlb=False)
    return MemoryBudget(mem_available_bytes, limit)


def _measured(budget, hugepage_record=None):
    """The daemon's CacheMemory, its budget ``budget`` (None: measured) instead of this machine's."""
    from colibrid.system.cache_memory import MachineMemory

    return MachineMemory(hugepage_record, budget)


@pytest.mark.parametrize("mem_available_slots, cgroup_room_slots, expected_slots", [
    (20, None, 10),  # no limit: half of MemAvailable (the pack has 16 experts)
    (20, 10, 5),  # a limit with less room than MemAvailable: half of that room
    (8, 30, 4),  # a limit with more room: MemAvailable still
])
def test_a_percentage_is_of_mem_available_or_the_room_under_the_cgroup_limit(pack_path, mem_available_slots,
                                                                             cgroup_room_slots, expected_slots):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    slot = _slot_bytes(pack_path)
    budget = _budget(mem_available_slots * slot, None if cgroup_room_slots is None else cgroup_room_slots * slot)
    with CachedExpertSource(Pack.open(pack_path), "50%", hugepages="off", memory=_measured(budget)) as source:
        assert source.n_slots == expected_slots
        status = source.budget_status()
    assert status["available_bytes"] == 2 * expected_slots * slot
    assert (status["cgroup_limit_bytes"] is not None) == (cgroup_room_slots is not None)
    assert status["basis"].startswith("cgroup v1 /colibri-test") == (cgroup_room_slots == 10)
    assert (status["cache_size"], status["cache_bytes"]) == ("50%", expected_slots * slot)


def test_a_cache_size_above_the_budget_is_a_visible_warning(pack_path):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    slot = _slot_bytes(pack_path)
    with CachedExpertSource(Pack.open(pack_path), 4 * slot, hugepages="off",
                            memory=_measured(_budget(1 << 30, 2 * slot))) as source:
        assert source.n_slots == 4
        (note,) = [n for n in source.backing_info()["notes"] if "above the memory available" in n]
    assert "cgroup v1 /colibri-test" in note and "OOM" in note


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/sys/vm/nr_hugepages", os.W_OK),
                    reason="raising vm.nr_hugepages needs root")
def test_hugepages_auto_never_raises_the_pool_under_a_cgroup_limit(big_pack, tmp_path):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.system.memory import meminfo
    from colibrid.pack.reader import Pack

    pack = Pack.open(big_pack)
    region = pack.manifest.experts_size
    if meminfo()["HugePages_Free"] * (2 << 20) >= region + (16 << 20):
        pytest.skip("enough free hugetlb pages for the whole pack: nothing would be raised anyway")
    before = int(open("/proc/sys/vm/nr_hugepages").read())
    budget = _budget(8 << 30, 4 * region)  # room for the whole pack under the limit
    with CachedExpertSource(pack, "50%", hugepages="auto",
                            memory=_measured(budget, tmp_path / "hugepages.json")) as source:
        assert int(open("/proc/sys/vm/nr_hugepages").read()) == before
        info = source.backing_info()
    assert info["backing"] != "hugetlb" and info["hugepages_added"] == 0
    assert any("not raised under a cgroup memory limit" in note for note in info["notes"])


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/proc/sys/vm/nr_hugepages", os.W_OK),
                    reason="raising vm.nr_hugepages needs root")
def test_a_cache_that_fails_after_raising_the_pool_gives_it_back(pack_path, tmp_path):
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack

    before = int(open("/proc/sys/vm/nr_hugepages").read())
    record = tmp_path / "hugepages.json"
    with pytest.raises(ExpertCacheError, match="io_queue_depth"):  # the loader is made after the pool is raised
        CachedExpertSource(Pack.open(pack_path), "2M", hugepages=before + 2, io_queue_depth=99,
                           memory=_measured(None, record))
    assert int(open("/proc/sys/vm/nr_hugepages").read()) == before
    assert not record.exists()

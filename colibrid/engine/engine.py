"""The engine: a loaded pack (model + tokenizer) and the sessions that run on it."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from colibrid.engine.batch import Batch
from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError, ExpertCacheSettings
from colibrid.engine.experts.source import ExpertSource, LoadingLimits, PreadExpertSource, apply_loading_limits
from colibrid.engine.generate import Generation, GenerationDone, GenerationEvent, generate
from colibrid.engine.forward.model import Model
from colibrid.engine.sampling import SamplingParams, model_sampling_defaults
from colibrid.engine.text.tokenizer import Tokenizer
from colibrid.models.model_config import parameter_counts
from colibrid.pack.reader import Pack

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 4096


class Session:
    """One sequence: its state (each layer's cache) and the model it runs on."""

    def __init__(self, model: Model, max_context: int, resumable: bool = False) -> None:
        self.model = model
        self.max_context = max_context
        self.state = model.new_state(max_context, resumable)

    @property
    def n_past(self) -> int:
        return self.state.length

    def forward(self, token_ids: Sequence[int] | np.ndarray, all_logits: bool = True) -> np.ndarray:
        """Append tokens; return their logits (T, V), or the last token's (1, V)."""
        return self.model.forward(np.asarray(token_ids, dtype=np.int64), self.state, all_logits=all_logits)


class Engine:
    """A loaded pack: the model, its tokenizer, and the expert source the model reads routed
    experts from - which the engine owns: it builds it, resizes and reopens it between
    steps, applies the loader's limits to it, and closes it.

    The source is ``experts`` when the caller made one (tests, tools, benches), else a
    CachedExpertSource built from ``cache`` (the daemon's settings), else a PreadExpertSource.
    Either way the engine closes it in close(); only a cache it built can be rebuilt.
    """

    def __init__(self, pack: Pack, experts: ExpertSource | None = None, max_context: int | None = None,
                 parse_special_tokens_in_content: bool = False, cache: ExpertCacheSettings | None = None,
                 lookahead_predictor: str = "router-on-moe-input", kv_cache_type: str = "f32") -> None:
        if experts is not None and cache is not None:
            raise ValueError("an engine takes an expert source or the settings to build its cache, not both")
        self.pack = pack
        self.config = pack.manifest.model
        # False (the daemon's default): special-token text a client writes in a chat stays text.
        self.tokenizer = Tokenizer.from_dir(pack.path, parse_special_tokens_in_content)
        self.sampling_defaults = _sampling_defaults(Path(pack.path))
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, self.config.max_position_embeddings)
        # No text longer than this can fit in max_context tokens (Tokenizer.max_token_bytes says
        # why), so longer prompts are refused before the tokenizer spends seconds and hundreds
        # of MB on them. Real text runs at about 4 bytes a token, so a prompt that fits is far below.
        self.max_prompt_bytes = self.max_context * self.tokenizer.max_token_bytes
        self.parameters_total, self.parameters_active = parameter_counts(self.config, pack.manifest.optional_tensors)
        # The cache the engine built from settings (None: the source was made by the caller, or
        # is a plain pread source) and those settings, to rebuild it from.
        self._cache: CachedExpertSource | None = None
        self._cache_settings = cache
        # The loader's limits the thermal watch set last (None: as built); guarded with the
        # swap of the source, so a limit set during a rebuild reaches the new source too.
        self._loading_limits: LoadingLimits | None = None
        self._experts_lock = threading.Lock()
        made_here = experts is None
        if cache is not None:
            experts = self._cache = self._build_cache(cache)
        elif experts is None:
            experts = PreadExpertSource(pack)
        try:
            self.model = Model(pack, experts, lookahead_predictor, kv_cache_type)
        except BaseException:
            if made_here:
                experts.close()  # frees the cache and gives back the hugepages raised for it
            raise
        self._experts = experts

    @property
    def experts(self) -> ExpertSource:
        """The source the model reads experts from now (a rebuild replaces it): for the engine's
        own use, tests and tools. The daemon asks cache_status() and memory_budget() instead."""
        return self._experts

    # ---- the expert cache ---------------------------------------------------------------

    def cache_status(self) -> dict:
        """The expert source's counters and make-up, as status shows them (ExpertSource.summary),
        and what the lookahead guesses from when it prefetches."""
        summary = self._experts.summary()
        if summary.get("prefetch"):
            summary["lookahead_predictor"] = self.model.lookahead_predictor
        return summary

    def memory_budget(self) -> dict | None:
        """The memory budget the cache was sized from (status' memory_budget); None when the
        source was not built from settings."""
        return self._cache.budget_status() if self._cache is not None else None

    def resident_buffers(self) -> dict:
        """The big buffers whose resident bytes status measures: ``dense`` (dense.bin, read
        into anonymous memory), ``expert_cache`` (the slab; None without a cache) and
        ``expert_cache_hugetlb`` (its pages are hugetlb ones, which RSS does not count)."""
        with self._experts_lock:  # never a cache a rebuild is closing
            cache = self._cache
            region = cache.region if cache is not None else None
            hugetlb = cache is not None and cache.backing_info()["backing"] == "hugetlb"
        return {"dense": self.pack.dense_buffer, "expert_cache": region, "expert_cache_hugetlb": hugetlb}

    def set_cache_policy(self, policy: str) -> None:
        """Eviction policy ("next-use", "lfu-decay", "lfru" or "lru"), from the next eviction on; any thread."""
        with self._experts_lock:  # never the cache a rebuild is closing
            if self._cache is None:
                return  # a source made by the caller: it has no policy setting to follow
            self._cache.set_policy(policy)
            self._cache_settings = dataclasses.replace(self._cache_settings, policy=policy)

    def rebuild_cache(self, settings: ExpertCacheSettings | None = None) -> bool:
        """Build a new cache (as ``settings`` say, by default as the current one was: reopening
        the experts file), swap it in and free the old one. Both exist for a moment; if the new
        one cannot be had, the old one stays (logged) and False is returned.
        Call only between steps, on the engine thread: a forward must never see the swap."""
        if self._cache is None:
            raise ValueError("this engine's expert source was made by its caller; it has no settings to rebuild it from")
        settings = settings or self._cache_settings
        try:
            new = self._build_cache(settings)
        except (ExpertCacheError, ValueError, OSError) as exc:
            log.error("cache_size = %s cannot be applied, keeping the current cache: %s", settings.cache_size, exc)
            return False
        with self._experts_lock:
            if self._loading_limits is not None:  # a new cache starts unthrottled: apply what the drive's heat allows
                apply_loading_limits(new, self._loading_limits)
            old = self._swap_experts(new)
            self._cache, self._cache_settings = new, settings
        old.close()
        return True

    def limit_loading(self, limits: LoadingLimits) -> None:
        """How the expert source may read now (the thermal watch calls this from its threads);
        remembered, and applied to every cache built later too."""
        with self._experts_lock:
            self._loading_limits = limits
            apply_loading_limits(self._experts, limits)

    def close(self) -> None:
        """Free the expert source (a cache's slab, and the hugepages raised for it). Only once
        nothing runs on the engine any more."""
        self._experts.close()

    def return_hugepages(self) -> None:
        """For a shutdown whose engine thread did not stop: give back the hugetlb pages raised
        for the cache without unmapping it (the thread may still read it); the kernel frees
        the slab when the process exits."""
        self._experts.return_hugepages()

    def _build_cache(self, settings: ExpertCacheSettings) -> CachedExpertSource:
        return CachedExpertSource.from_settings(self.pack, settings)

    def _swap_experts(self, experts: ExpertSource) -> ExpertSource:
        """Serve routed experts from ``experts`` from now on; returns the previous source."""
        previous, self._experts = self._experts, experts
        self.model.experts = experts
        for layer in self.model.layers:
            if layer.moe is not None:
                layer.moe.experts = experts
        return previous

    def new_session(self, max_context: int | None = None, resumable: bool = False) -> Session:
        return Session(self.model, min(max_context or self.max_context, self.max_context), resumable)

    def forward(self, token_ids: Sequence[int], session: Session | None = None) -> np.ndarray:
        """Logits (T, V) for ``token_ids`` appended to ``session`` (a fresh one by default)."""
        return (session or self.new_session()).forward(token_ids)

    def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None,
                   system: str | None = None, raw: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids for a raw prompt or a chat; chats go through the model's template, which
        also sees ``tools`` (function descriptions, as transformers passes them).

        A raw prompt is the client's whole text: special-token text in it becomes special tokens
        (there is no template whose roles it could forge). In a chat it stays text unless the
        tokenizer's parse_special_tokens_in_content is set.
        ValueError, before any tokenizing, if the text is too long to fit in max_context.
        """
        self._check_prompt_bytes(prompt, messages, system, tools)
        if messages is None:
            if tools and (raw or not self.tokenizer.has_chat_template):
                raise ValueError("tools are given to the model through its chat template; "
                                 + ("a raw prompt has none" if raw else "this model has none"))
            if raw or not self.tokenizer.has_chat_template:
                text = prompt if system is None else f"{system}\n\n{prompt}"
                return self.tokenizer.encode(text or "", add_special_tokens=True)
            messages = [{"role": "user", "content": prompt or ""}]
        return self.tokenizer.encode_chat(messages, system=system, tools=tools)

    def _check_prompt_bytes(self, prompt: str | None, messages: list[dict] | None, system: str | None,
                            tools: list[dict] | None = None) -> None:
        # Encoding to count costs about a millisecond per MB: nothing next to tokenizing it.
        prompt_bytes = sum(len(text.encode("utf-8", "surrogatepass"))
                           for text in _strings_in((prompt, system, messages, tools)))
        if prompt_bytes > self.max_prompt_bytes:
            raise ValueError(
                f"the prompt is {prompt_bytes} bytes; max_context {self.max_context} tokens of this model's "
                f"tokenizer (at most {self.tokenizer.max_token_bytes} bytes each) hold at most "
                f"{self.max_prompt_bytes} bytes"
            )

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 session: Session | None = None) -> Iterator[GenerationEvent | GenerationDone]:
        """The events of a generation of ``prompt_ids``; ``params`` were checked when they were built."""
        return generate(session or self.new_session(), self.tokenizer, prompt_ids, params,
                        skip_special_tokens=params.skip_special_tokens)

    def start_generation(self, prompt_ids: list[int], params: SamplingParams,
                         resumable: bool = False) -> tuple[Generation, Session]:
        """A generation ready to join a batch, on a session of its own sized for its prompt
        plus max_tokens (at most max_context): the KV cache it reserves while it runs;
        ``resumable`` for a batch that keeps prefixes (Batch.keeps_prefixes).
        ValueError if the prompt is empty or does not fit."""
        tokens = min(len(prompt_ids) + params.max_tokens, self.max_context)
        session = self.new_session(max_context=max(tokens, 1), resumable=resumable)
        return Generation(session, self.tokenizer, prompt_ids, params, params.skip_special_tokens), session

    def new_batch(self, max_batch: int, prefill_chunk: int, kv_budget_bytes: int, prefix_cache_bytes: int = 0) -> Batch:
        """An empty batch of generations on this engine's model (see engine/batch.py), keeping
        finished sequences' states for prefix reuse in up to ``prefix_cache_bytes``."""
        return Batch(self.model, max_batch, prefill_chunk, kv_budget_bytes,
                     expert_counts=lambda: self.experts.hits_and_misses(), prefix_cache_bytes=prefix_cache_bytes)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Token ids of a greedy continuation (ignores EOS), for tests and tools."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [e.token_id for e in self.generate(prompt_ids, params) if isinstance(e, GenerationEvent)]


def _strings_in(value) -> Iterator[str]:
    """Every string in a request's plain data (strings, lists, tuples, maps: keys and values).
    Iterative: the protocol bounds the nesting, but a caller in Python need not have."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


def _sampling_defaults(pack_dir: Path) -> dict:
    """SamplingParams fields the model's generation_config.json sets (see model_sampling_defaults)."""
    path = pack_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())  # the tokenizer has already read it: it parses
    return model_sampling_defaults(config) if isinstance(config, dict) else {}


def load(path: str | Path, max_context: int | None = None) -> Engine:
    """Open the pack at ``path`` and build an engine on it."""
    pack = Pack.open(path)
    engine = Engine(pack, max_context=max_context)
    log.info(
        "loaded %s: %s, %.2fB parameters (%.2fB active), quantization %s",
        path, engine.config.architecture, engine.parameters_total / 1e9, engine.parameters_active / 1e9,
        pack.manifest.quantization,
    )
    if engine.sampling_defaults:
        log.info("sampling defaults from generation_config.json: %s", engine.sampling_defaults)
    return engine

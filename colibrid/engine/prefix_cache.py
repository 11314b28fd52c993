"""Prefix reuse: finished sequences' states, kept so that a new request whose token ids begin
with the same ones prefills only the rest (the next turn of a chat: the previous prompt and
answer, then the new message; a shared system prompt; the same document asked twice).

An entry is a finished sequence's token ids and what of its state can be resumed from
(SequencePrefix: each layer says from which lengths it can resume with the numbers a fresh
prefill gives). Flat caches hand over views of their own buffers (the sequence has ended; the
pages its reservation never wrote are not resident), rings and recurrent states small copies.
Entries are found by their prefix blocks: the ids are cut into blocks of BLOCK_TOKENS and each
block's key is a hash chained over it and every block before it, so block i's key names the
whole prefix up to it and a lookup walks the prompt's blocks once, O(prompt / block). The
hash only finds candidates: the token ids themselves are compared before anything is reused,
so a collision (even a made one) costs a comparison, never a wrong token.

Every entry belongs to a scope (the daemon's: the asking user), the first input of its key
chain, and only requests of the same scope find it: whether a prefix is kept, and how fast a
prompt starts, says nothing about what another user asked.

The cache holds at most ``budget_bytes`` of entries (prefix_cache_size): the least recently
used leave first, and an entry that another one extends and can stand in for (same tokens
first, resumable wherever it was) leaves when that one comes. A new sequence gets a copy of an
entry's rows in its own state, which it reserved in the KV budget when it was admitted: an
entry is never written by a running sequence, and it can be evicted at any time.

Used by the batch on the engine thread only; status() reads counters another thread may read.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from colibrid.engine.forward.sequence_state import SequencePrefix, SequenceState

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # tokens per prefix block: shorter prefixes are not looked up
MAX_CANDIDATES = 32  # entries compared token by token in one lookup, at most
ENTRY_OVERHEAD_BYTES = 512  # an entry's bookkeeping besides its state and ids (counted in the budget)
DIGEST_BYTES = 16


def block_keys(token_ids: np.ndarray, scope: bytes = b"") -> list[bytes]:
    """One key per whole block of ``token_ids``: key i hashes ``scope`` and blocks 0 .. i (chained)."""
    ids = np.ascontiguousarray(token_ids, dtype="<i4")
    keys, key = [], hashlib.blake2b(scope, digest_size=DIGEST_BYTES).digest()
    for start in range(0, ids.shape[0] - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        key = hashlib.blake2b(key + ids[start:start + BLOCK_TOKENS].tobytes(), digest_size=DIGEST_BYTES).digest()
        keys.append(key)
    return keys


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass(eq=False)
class _Entry:
    token_ids: np.ndarray  # (L,) int32: the tokens the kept state holds
    scope: bytes  # only requests of this scope reuse it
    prefix: SequencePrefix
    keys: list[bytes]  # its block keys
    nbytes: int  # counted in the budget


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # least recently used first
        self._by_key: dict[bytes, dict[int, None]] = {}  # block key -> ids of the entries with that prefix
        self._next_id = 0
        # Counters, read by status() from any thread (each a plain int, written here only)
        self.entries = 0
        self.used_bytes = 0
        self.lookups = 0  # requests that looked for a prefix
        self.hits = 0  # ... and resumed from one
        self.tokens_reused = 0  # prompt tokens not prefilled thanks to a hit
        self.kept = 0  # finished sequences kept
        self.evicted = 0  # entries that left for room (not those an extending entry replaced)
        self.not_kept = 0  # finished sequences not kept: larger than the budget, or nothing to resume from

    # -- lookup -----------------------------------------------------------------------------

    def resume(self, state: SequenceState, prompt_ids: np.ndarray, scope: bytes = b"") -> int:
        """Restores into the fresh ``state`` the longest prefix of ``prompt_ids`` kept in
        ``scope`` that it can resume from, leaving at least the last prompt token to prefill;
        returns the number of tokens restored (0: none, ``state`` untouched)."""
        self.lookups += 1
        prompt_ids = np.asarray(prompt_ids)
        most = min(prompt_ids.shape[0] - 1, state.max_tokens)
        entry_id, length = self._find(prompt_ids, most, scope)
        if length == 0:
            return 0
        entry = self._entries[entry_id]
        entry.prefix.restore(state, length)
        self._entries.move_to_end(entry_id)
        self.hits += 1
        self.tokens_reused += length
        return length

    def _find(self, prompt_ids: np.ndarray, most: int, scope: bytes) -> tuple[int, int]:
        """(entry id, length) of the longest resumable prefix of at most ``most`` tokens; (-1, 0) if none."""
        levels = []  # entry ids sharing blocks 0 .. i with the prompt, for each i until none do
        for key in block_keys(prompt_ids[:most], scope):
            sharing = self._by_key.get(key)
            if not sharing:
                break
            levels.append(sharing)
        best_id, best_length, compared = -1, 0, set()
        for depth in range(len(levels) - 1, -1, -1):  # the longest shared prefixes first
            if best_length >= (depth + 2) * BLOCK_TOKENS:
                break  # an entry that shares no more blocks than this shares fewer tokens than found
            for entry_id in reversed(levels[depth]):  # the newest first
                if entry_id in compared:
                    continue
                if len(compared) == MAX_CANDIDATES:
                    return best_id, best_length
                compared.add(entry_id)
                entry = self._entries[entry_id]
                if entry.scope != scope:
                    continue
                length = entry.prefix.resume_length(min(most, common_prefix_length(entry.token_ids, prompt_ids)))
                if length > best_length:
                    best_id, best_length = entry_id, length
        return best_id, best_length

    # -- keeping ------------------------------------------------------------------------------

    def keep(self, token_ids: np.ndarray, state: SequenceState, scope: bytes = b"") -> bool:
        """Keeps what a finished sequence's ``state`` (holding ``token_ids``) can be resumed
        from, for the requests of ``scope``, if it fits in the budget (evicting the least
        recently used entries). The entry may take over the state's own buffers (views of its
        flat caches): the caller must never write ``state`` again."""
        token_ids = np.asarray(token_ids, dtype=np.int32)
        if token_ids.shape[0] != state.length:
            raise ValueError(f"{token_ids.shape[0]} token ids for a state of {state.length} tokens")
        nbytes = state.kept_nbytes() + token_ids.nbytes + ENTRY_OVERHEAD_BYTES
        if token_ids.shape[0] < BLOCK_TOKENS or nbytes > self.budget_bytes:
            self.not_kept += 1
            return False
        prefix = state.keep()
        if prefix is None:
            self.not_kept += 1
            return False
        keys = block_keys(token_ids, scope)
        for entry_id in self._replaced_by(token_ids, scope, prefix, keys):
            self._remove(entry_id)
        while self.used_bytes + nbytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            self.evicted += 1
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = _Entry(token_ids, scope, prefix, keys, nbytes)
        for key in keys:
            self._by_key.setdefault(key, {})[entry_id] = None
        self.entries, self.used_bytes, self.kept = len(self._entries), self.used_bytes + nbytes, self.kept + 1
        return True

    def _replaced_by(self, token_ids: np.ndarray, scope: bytes, prefix: SequencePrefix, keys: list[bytes]) -> list[int]:
        """The entries a new one makes useless: their tokens begin the new one's, and it
        resumes wherever they did."""
        candidates = {entry_id for key in keys for entry_id in self._by_key.get(key, ())}
        replaced = []
        for entry_id in candidates:
            entry = self._entries[entry_id]
            n = entry.token_ids.shape[0]
            if (entry.scope == scope and n <= token_ids.shape[0] and np.array_equal(entry.token_ids, token_ids[:n])
                    and prefix.resume_from <= entry.prefix.resume_from and entry.prefix.resume_to <= prefix.resume_to):
                replaced.append(entry_id)
        return replaced

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for key in entry.keys:
            sharing = self._by_key[key]
            del sharing[entry_id]
            if not sharing:
                del self._by_key[key]
        self.entries, self.used_bytes = len(self._entries), self.used_bytes - entry.nbytes

    def clear(self) -> None:
        for entry_id in list(self._entries):
            self._remove(entry_id)

    # -- observability ------------------------------------------------------------------------

    def status(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes, "entries": self.entries,
                "lookups": self.lookups, "hits": self.hits, "tokens_reused": self.tokens_reused,
                "kept": self.kept, "evicted": self.evicted, "not_kept": self.not_kept}

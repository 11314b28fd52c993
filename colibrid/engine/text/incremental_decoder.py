"""Generated ids to text, one token at a time: deltas that never split a UTF-8 character, in
O(1) decode work per token (IncrementalDecoder)."""

from __future__ import annotations

from colibrid.engine.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# After this many pushed tokens without the text tail ever completing, the tail is treated as
# genuinely invalid bytes and released, so a model emitting garbage cannot grow the window forever.
MAX_PENDING_TOKENS = 64


def _trailing_replacement_chars(text: str) -> int:
    """How many U+FFFD end `text`.

    All of them may still change: byte-level decoders render an unfinished character as one
    U+FFFD, but sentencepiece's byte fallback renders a whole run of byte tokens as one U+FFFD
    per byte until the run is valid UTF-8 (so "测" followed by a lone lead byte shows as four).
    """
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


class IncrementalDecoder:
    """Turns generated ids, one at a time, into text deltas.

    Decoding one token alone is wrong for most tokenizers (sentencepiece strips a leading
    space at the start of a decode; byte-level BPE splits characters across tokens), and
    decoding the whole sequence each step costs O(n^2). So each step decodes a short window
    ids[prefix_offset:] twice - without and with the tokens after read_offset - and emits the
    difference. The window moves forward only once a step produced new, complete text.

    A decoded tail ending in U+FFFD may be an unfinished UTF-8 character whose remaining bytes
    are in later tokens: the trailing replacement characters are held back (the text before
    them is emitted) until the character completes or other text follows them.

    The concatenation of all deltas plus `flush()` equals `tokenizer.decode_raw(all_ids)`,
    which is `decode(all_ids)` whenever the legacy space clean-up is off (always for BPE
    models). One exception, inherent to streaming: sentencepiece's byte fallback turns a whole
    run of byte tokens into U+FFFD, retroactively, when the run is not valid UTF-8; if a model
    emits invalid bytes, text already streamed from that run stays as it was streamed.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context tokens whose text was already emitted
        self._read_offset = 0  # tokens from here on have text not yet (fully) emitted
        self._held_emitted_chars = 0  # chars past the prefix text emitted while the tail was incomplete

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while text is held back)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        start = len(prefix_text) + self._held_emitted_chars
        held_chars = _trailing_replacement_chars(window_text)
        pending_tokens = len(self._ids) - self._read_offset
        if held_chars and pending_tokens <= MAX_PENDING_TOKENS:
            stable_end = len(window_text) - held_chars
            delta = window_text[start:stable_end]
            self._held_emitted_chars += len(delta)
            return delta
        delta = window_text[start:]
        if len(window_text) > len(prefix_text):
            # New complete text: the tokens just read become the next step's context.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._held_emitted_chars = 0
        return delta

    def flush(self) -> str:
        """Release the text still held back (an unfinished character at the very end).

        Call once, after the last push: released replacement characters are final.
        """
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        delta = window_text[len(prefix_text) + self._held_emitted_chars :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._held_emitted_chars = 0
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode_raw(ids, skip_special_tokens=self._skip_special_tokens)

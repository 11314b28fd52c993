"""IncrementalDecoder: streamed deltas add up to the full decode and never split a character."""

from __future__ import annotations

import random

import pytest

from colibrid.engine.text.incremental_decoder import REPLACEMENT_CHAR, IncrementalDecoder
from colibrid.engine.text.tokenizer import Tokenizer
from tests.engine.conftest import SAMPLE_TEXTS


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


@pytest.fixture(scope="module")
def tokenizers_by_style(bytelevel_dir, llama_style_dir, unigram_dir) -> dict[str, Tokenizer]:
    return {
        "bytelevel": Tokenizer.from_dir(bytelevel_dir),
        "llama_style": Tokenizer.from_dir(llama_style_dir),
        "unigram": Tokenizer.from_dir(unigram_dir),
    }


@pytest.mark.parametrize("style", ["bytelevel", "llama_style", "unigram"])
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_deltas_add_up_to_full_decode(tokenizers_by_style, style, skip_special_tokens):
    tokenizer = tokenizers_by_style[style]
    for text in SAMPLE_TEXTS + [" ".join(SAMPLE_TEXTS)]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _stream(tokenizer, ids, skip_special_tokens)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full, text
        if REPLACEMENT_CHAR not in full:
            assert not any(REPLACEMENT_CHAR in delta for delta in deltas), (text, deltas)
        assert all(not any(0xD800 <= ord(ch) <= 0xDFFF for ch in delta) for delta in deltas)


def test_sentencepiece_leading_space_survives_streaming(tokenizers_by_style):
    tokenizer = tokenizers_by_style["llama_style"]
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    # A "▁world" token decoded alone is "world"; streamed after "Hello" it must be " world".
    spaced = [i for i in range(1, len(ids)) if tokenizer.id_to_token(ids[i]).startswith("▁")]
    assert spaced, "fixture must have word-initial tokens after the first"
    for i in spaced:
        assert not tokenizer.decode([ids[i]]).startswith(" ")
        assert deltas[i].startswith(" "), (i, deltas)
    assert "".join(deltas) == "Hello world, this is a test."


def test_multibyte_characters_are_held_until_complete(tokenizers_by_style):
    for style in ("bytelevel", "llama_style"):
        tokenizer = tokenizers_by_style[style]
        # Characters absent from the training corpus are always split into byte tokens.
        ids = tokenizer.encode("🦀𝄞 漢字 Ωμέγα", add_special_tokens=False)
        single_token_texts = [tokenizer.decode([token_id]) for token_id in ids]
        assert any(REPLACEMENT_CHAR in text for text in single_token_texts), "fixture must split characters"
        deltas = _stream(tokenizer, ids)
        assert "" in deltas[:-1]  # something was held back
        assert "".join(deltas) == "🦀𝄞 漢字 Ωμέγα"
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


@pytest.mark.parametrize("style", ["bytelevel", "llama_style", "unigram"])
def test_incremental_matches_full_decode_on_random_ids(tokenizers_by_style, style):
    """Random ids: special tokens, and for byte-level BPE invalid UTF-8 (lone continuation bytes).

    Byte-fallback tokens (<0xNN>) are left out: a run of them that is invalid UTF-8 turns into
    U+FFFD retroactively in a full decode, which no stream can reproduce (see IncrementalDecoder).
    """
    tokenizer = tokenizers_by_style[style]
    allowed_ids = [i for i in range(tokenizer.vocab_size) if not tokenizer.id_to_token(i).startswith("<0x")]
    rng = random.Random(1234)
    for _ in range(30):
        ids = [rng.choice(allowed_ids) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert "".join(_stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_incremental_decode_work_is_constant_per_token(tokenizers_by_style, monkeypatch):
    tokenizer = tokenizers_by_style["bytelevel"]
    ids = tokenizer.encode(" ".join(SAMPLE_TEXTS) * 6, add_special_tokens=False)
    assert len(ids) > 500
    window_lengths = []
    original = tokenizer.decode_raw

    def counting_decode(token_ids, skip_special_tokens=False):
        window_lengths.append(len(token_ids))
        return original(token_ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode_raw", counting_decode)
    deltas = _stream(tokenizer, ids)
    assert max(window_lengths) <= 8
    monkeypatch.undo()
    assert "".join(deltas) == tokenizer.decode(ids)

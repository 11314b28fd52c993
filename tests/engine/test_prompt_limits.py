"""Prompts too long for the context are refused by their byte length, before the tokenizer runs;
the byte bound never refuses a text that would fit."""

from __future__ import annotations

import pytest

from colibrid.engine.text.tokenizer import Tokenizer
from tests.engine.conftest import SAMPLE_TEXTS

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def engine(demo_pack):
    from colibrid.engine import load

    return load(demo_pack, max_context=MAX_CONTEXT)


@pytest.fixture
def tokenizer_must_not_run(engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer ran on a prompt its length alone rules out")

    monkeypatch.setattr(engine.tokenizer, "encode", refuse)
    monkeypatch.setattr(engine.tokenizer, "encode_chat", refuse)


def test_the_prompt_byte_limit_is_the_context_times_the_longest_token(engine):
    assert engine.max_prompt_bytes == MAX_CONTEXT * engine.tokenizer.max_token_bytes
    longest = max(engine.tokenizer._backend.get_vocab(with_added_tokens=True), key=lambda e: len(e.encode()))
    assert engine.tokenizer.max_token_bytes == len(longest.encode())


@pytest.mark.parametrize("shape", ["raw", "chat", "system", "messages"])
def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing(engine, tokenizer_must_not_run, shape):
    too_long = "x" * (engine.max_prompt_bytes + 1)
    kwargs = {"raw": {"prompt": too_long, "raw": True}, "chat": {"prompt": too_long},
              "system": {"prompt": "hi", "system": too_long, "raw": True},
              "messages": {"messages": [{"role": "user", "content": "é" * (engine.max_prompt_bytes // 2 + 1)}]}}[shape]
    with pytest.raises(ValueError, match=r"the prompt is \d+ bytes; max_context 64 tokens"):
        engine.prompt_ids(**kwargs)


def test_a_prompt_at_the_byte_limit_is_tokenized_and_then_measured_in_tokens(engine):
    with pytest.raises(ValueError, match="tokens but the context has room for 64"):
        list(engine.generate(engine.prompt_ids(prompt="x" * engine.max_prompt_bytes, raw=True), _greedy()))


def _greedy():
    from colibrid.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1)


@pytest.mark.parametrize("tokenizer_dir", ["bytelevel_dir", "llama_style_dir", "unigram_dir"])
def test_no_text_needs_fewer_tokens_than_its_bytes_over_the_longest_token(request, tokenizer_dir):
    # What makes the byte limit safe: tokens >= bytes / max_token_bytes, for every kind of tokenizer
    # the tests know, on ordinary text and on text made of the longest token over and over.
    tokenizer = Tokenizer.from_dir(request.getfixturevalue(tokenizer_dir))
    vocab = tokenizer._backend.get_vocab(with_added_tokens=True)
    longest_texts = sorted(vocab, key=lambda entry: -len(entry.encode()))[:20]
    texts = [text * 40 for text in SAMPLE_TEXTS if text] + [tokenizer.decode([vocab[e]]) * 40 for e in longest_texts]
    for text in texts:
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert tokens * tokenizer.max_token_bytes >= len(text.encode()), (text[:40], tokens)

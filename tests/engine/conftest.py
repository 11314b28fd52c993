"""Tiny tokenizers built in-process (no network) for the engine's text tests.

- `bytelevel_dir`: a byte-level BPE (GPT-2/Qwen style) with ChatML special tokens, saved by
  transformers' save_pretrained so transformers can load it back as the oracle.
- `llama_style_dir`: a sentencepiece-like BPE (Prepend/Replace "▁" normalizer, byte fallback,
  decoder that strips the leading space), like Llama/Mixtral tokenizers.
- `unigram_dir`: a Unigram model with a Metaspace pre-tokenizer and decoder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

CORPUS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "Café résumé naïve élève è à ù",
    "中文 测试 你好 世界 中文",
    "emoji 😀 🎉 fun 👍🏽 ok",
    "def main():\n    print('hi')\n",
] * 8

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SAMPLE_TEXTS = [
    "Hello world, this is a test.",
    " leading space and  double  spaces ",
    "Café résumé naïve",
    "中文测试，你好世界",
    "emoji 😀🎉👍🏽 mixed 中文 and é",
    "special <|im_start|>user\nhi<|im_end|> inside",
    "new\nlines\n\n\ttabs",
    "unseen: Ωμέγα ∑ 🦀 ﬁ",
    "",
]


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")


def _train_bytelevel() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def bytelevel_dir(tmp_path_factory) -> Path:
    """Byte-level BPE + ChatML template (saved as chat_template.jinja) + generation_config.json."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("bytelevel")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_bytelevel(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    hf.save_pretrained(out)
    eos_ids = [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]
    _write_json(out / "generation_config.json", {"eos_token_id": eos_ids, "pad_token_id": eos_ids[1]})
    return out


def _byte_tokens() -> list[str]:
    return [f"<0x{value:02X}>" for value in range(256)]


def _train_llama_style() -> BackendTokenizer:
    """Sentencepiece-BPE shape: "▁" for spaces, byte fallback for characters outside the alphabet."""
    trainer_tok = BackendTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Like sentencepiece's split_by_whitespace: pieces never span words (only the trainer splits).
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    trainer_tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for token in _byte_tokens():
        vocab[token] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


@pytest.fixture(scope="session")
def llama_style_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama_style")
    _train_llama_style().save(str(out / "tokenizer.json"))
    # Written by hand, like a Mixtral config: add_bos_token is present (and ignored by transformers 5).
    _write_json(
        out / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False},
    )
    return out


@pytest.fixture(scope="session")
def unigram_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unigram")
    tok = BackendTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {"eos_token": "</s>", "unk_token": "<unk>"})
    return out

"""Kimi K2's tiktoken tokenizer, converted to tokenizer.json, encodes and decodes as tiktoken.

The tests write a checkpoint's tokenizer files the way Kimi K2 publishes them: a
tiktoken.model whose ranks come from a byte-level BPE the test trains with `tokenizers`
(single bytes in the trained alphabet's order, not byte order, then one rank per learned
merge), tokenizer_config.json with added_tokens_decoder and a chat template, and a
tokenization_kimi.py whose pat_str is Kimi's pattern written as "|".join([...]) of raw string
literals. The oracle is tiktoken itself (a test-only dependency) with the same ranks,
pattern and special tokens; a reference BPE-by-ranks written here checks the derived merges
without it.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from colibrid.tools.convert.tiktoken_tokenizer import (
    KIMI_K2_PATTERN,
    TiktokenError,
    byte_level,
    convert_tiktoken,
    derive_merges,
    read_tiktoken,
)

RESERVED = 8  # the class file says num_reserved_special_tokens = 8 (Kimi K2: 256)
NAMED_SPECIALS = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>", 4: "<|im_user|>", 5: "<|im_assistant|>"}  # offset from num_base
CHAT_TEMPLATE = "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_assistant|>"

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! I'll say we're done, you've seen it.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\n\n",
    "混合专家模型把每个词元路由到少数几个专家。中文文本和English混在一起。",
    "Numbers: 1234567890, 3.14159, 2026-12-01, 100000 tokens per second.",
    "Café naïve résumé Ünïcödé ǅungla ÀBCdef ΑΒΓ αβγ Привет мир 🙂🙂🚀",
    "    indented\tcode\t\twith   runs   of    spaces\r\n\r\nand CRLF lines",
] * 8

# Text the encoders are compared on: unicode (Han next to Latin, combining marks, emoji,
# titlecase), digit runs, whitespace runs of every kind, contractions in both cases, special
# tokens inside text and next to each other, and characters the training never saw.
CORPUS = [
    "",
    "The quick brown fox jumps over the lazy dog.",
    "I'LL tell you: we're here, THEY'VE gone, it's fine, don'T",
    "12345678901 3.14159 007 1,000,000 ٣٤٥ ⅫⅢ ²³",
    "混合专家模型把每个词元路由到少数几个专家。中文English混在一起abc中",
    "Café naïve re\u0301sume\u0301 ǅungla ÀBCdef ΑΒΓαβγ Привет мир",
    "emoji 🙂🙂🚀 and a ZWJ family 👨\u200d👩\u200d👧 and flags 🇫🇷",
    "    indented\n\tcode\t\twith   runs   of    spaces   \r\n\r\n\n\n  \u00a0\u2003\u3000 end  ",
    "trailing spaces    ",
    "\n\n\n",
    "<|im_user|>Hi there<|im_end|><|im_assistant|>Hello![EOS]",
    "[BOS][BOS]<|im_end|>text<|reserved_token_999|> and <|reserved_token_{reserved}|>",
    "never seen: ŉ ǈ ǋ ῼ ﬀ ℌ ⓐ ∀x∈ℝ: x²≥0 — “quotes” ‘single’ …",
    "control \x00\x01\x7f bytes and a lone surrogate-free \ufffd replacement",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
]


def _train_ranks() -> dict[bytes, int]:
    """Ranks of a byte-level BPE trained here: the 256 bytes first (in the trained alphabet's
    order), then each merge's result in the order BPE learned them."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(KIMI_K2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    model = json.loads(tok.to_str())["model"]
    char_to_byte = {byte_level(bytes([b])): b for b in range(256)}
    ranks: dict[bytes, int] = {}
    for text, _id in sorted(model["vocab"].items(), key=lambda item: item[1])[:256]:
        ranks[bytes([char_to_byte[text]])] = len(ranks)
    assert len(ranks) == 256
    for left, right in model["merges"]:
        token = bytes(char_to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def _kimi_class_file(reserved: int) -> str:
    """tokenization_kimi.py as Kimi K2 writes its pattern: raw literals joined with "|"."""
    alternatives = KIMI_K2_PATTERN.split("|")
    # the contraction groups hold "|" too: rejoin them into the eight alternatives Kimi lists
    merged, depth = [], 0
    for piece in alternatives:
        if merged and depth:
            merged[-1] += "|" + piece
        else:
            merged.append(piece)
        depth += piece.count("(") - piece.count(")")
    assert "|".join(merged) == KIMI_K2_PATTERN and len(merged) == 8
    literals = "".join(f'            r"""{part}""",\n' for part in merged)
    return (
        "import tiktoken\n\n"
        "class TikTokenTokenizer(PreTrainedTokenizer):\n"
        f"    num_reserved_special_tokens = {reserved}\n"
        '    pat_str = "|".join(\n        [\n' + literals + "        ]\n    )\n\n"
        "    def __init__(self, vocab_file, **kwargs):\n        raise RuntimeError('never run')\n"
    )


def write_kimi_tokenizer(directory: Path, ranks: dict[bytes, int], class_file: str | None = None,
                         specials: dict[int, str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    num_base = len(ranks)
    specials = NAMED_SPECIALS if specials is None else specials
    config = {
        "added_tokens_decoder": {str(num_base + offset): {"content": text, "lstrip": False, "normalized": False,
                                                          "rstrip": False, "single_word": False, "special": True}
                                 for offset, text in specials.items()},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenization_kimi.py").write_text(class_file if class_file is not None else _kimi_class_file(RESERVED))
    return directory


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return _train_ranks()


@pytest.fixture(scope="module")
def converted(ranks, tmp_path_factory) -> tuple[Path, tokenizers.Tokenizer]:
    directory = write_kimi_tokenizer(tmp_path_factory.mktemp("kimi"), ranks)
    return directory, tokenizers.Tokenizer.from_str(convert_tiktoken(directory))


def _special_ids(num_base: int) -> dict[str, int]:
    return {NAMED_SPECIALS.get(i, f"<|reserved_token_{num_base + i}|>"): num_base + i for i in range(RESERVED)}


def _corpus(num_base: int) -> list[str]:
    return [text.replace("{reserved}", str(num_base + 6)) for text in CORPUS] + TRAINING_TEXT[:6]


# --- against tiktoken -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(ranks):
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.Encoding("kimi-test", pat_str=KIMI_K2_PATTERN, mergeable_ranks=ranks,
                             special_tokens=_special_ids(len(ranks)))


def test_encodes_as_tiktoken(converted, oracle, ranks):
    _, tok = converted
    merged_somewhere = False
    for text in _corpus(len(ranks)):
        expected = oracle.encode(text, allowed_special="all")
        assert tok.encode(text, add_special_tokens=False).ids == expected, text
        merged_somewhere |= any(i >= 256 for i in expected)
    assert merged_somewhere  # the corpus exercises merges, not only single bytes


def test_decodes_as_tiktoken(converted, oracle, ranks):
    """Whole texts round-trip; arbitrary id sequences (partial UTF-8 characters, special
    tokens) decode to the same text, with the same replacement characters."""
    import numpy as np

    _, tok = converted
    for text in _corpus(len(ranks)):
        ids = oracle.encode(text, allowed_special="all")
        assert tok.decode(ids, skip_special_tokens=False) == oracle.decode(ids) == text
    rng = np.random.default_rng(0)
    vocab = len(ranks) + RESERVED
    for _ in range(200):
        ids = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        assert tok.decode(ids, skip_special_tokens=False) == oracle.decode(ids, errors="replace"), ids


def test_special_tokens_keep_their_ids(converted, ranks):
    _, tok = converted
    for text, token_id in _special_ids(len(ranks)).items():
        assert tok.token_to_id(text) == token_id
        assert tok.id_to_token(token_id) == text
    added = tok.get_added_tokens_decoder()
    assert sorted(added) == list(range(len(ranks), len(ranks) + RESERVED))
    assert all(token.special for token in added.values())
    assert tok.get_vocab_size(with_added_tokens=True) == len(ranks) + RESERVED


# --- without tiktoken: BPE by ranks, written here -----------------------------------------


def reference_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's byte-pair merging: a piece that is a token is that token; else join the
    adjacent pair whose bytes have the lowest rank, leftmost first, until none is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while True:
        candidates = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not candidates:
            return [ranks[part] for part in parts]
        _, at = min(candidates)
        parts[at : at + 2] = [parts[at] + parts[at + 1]]


def test_merges_reproduce_bpe_by_ranks(converted, ranks):
    """Each pre-tokenized piece of the corpus encodes to the reference's BPE-by-ranks ids."""
    _, tok = converted
    split = pre_tokenizers.Split(tokenizers.Regex(KIMI_K2_PATTERN), behavior="isolated")
    pieces = [piece for text in TRAINING_TEXT[:6] + CORPUS[:10] for piece, _ in split.pre_tokenize_str(text)]
    assert len(pieces) > 100
    for piece in pieces:
        assert tok.encode(piece, add_special_tokens=False).ids == reference_bpe(piece.encode(), ranks), piece


def _hand_made_ranks(*tokens: bytes) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in tokens:
        ranks[token] = len(ranks)
    return ranks


@pytest.mark.parametrize("tokens, texts", [
    # the same token from two splits ("ab"+"a" and "a"+"ba"): the leftmost is joined first
    ((b"ab", b"ba", b"aba"), ["ababa", "abababab", "babab"]),
    # a token its bytes cannot reach by merging ("abcd": a b c d -> ab c d, stuck) is made
    # only as a whole piece
    ((b"ab", b"bc", b"abcd"), ["abcd", "abcdabcd", "xabcd"]),
    # ranks that are not in BPE's order: "xyz" ranks before "xy" yet forms from xy + z
    ((b"xyz", b"xy", b"yz"), ["xyz", "xyzxyz", "xxyz"]),
])
def test_hand_made_ranks(tmp_path, tokens, texts):
    ranks = _hand_made_ranks(*tokens)
    directory = write_kimi_tokenizer(tmp_path, ranks, class_file='pat_str = r"""\\S+|\\s+"""\n', specials={})
    tok = tokenizers.Tokenizer.from_str(convert_tiktoken(directory))
    for text in texts:
        assert tok.encode(text, add_special_tokens=False).ids == reference_bpe(text.encode(), ranks), text


def test_derived_merges_are_in_rank_order(ranks):
    merges = derive_merges(ranks)
    merged_ranks = [ranks[left + right] for left, right in merges]
    assert merged_ranks == sorted(merged_ranks) and len(merges) == len(ranks) - 256


# --- hostile files ----------------------------------------------------------------------------


def _with_model_text(tmp_path: Path, text: str) -> Path:
    directory = write_kimi_tokenizer(tmp_path, _hand_made_ranks())
    (directory / "tiktoken.model").write_text(text)
    return directory


@pytest.mark.parametrize("text, message", [
    ("QQ== 0\nQQ== 1\n", "listed twice"),
    ("QQ==\n", "expected 'base64 rank'"),
    ("QQ== -1\n", "expected 'base64 rank'"),
    ("QQ== 1e3\n", "expected 'base64 rank'"),
    ("!!!! 0\n", "invalid base64"),
    ("QQ== 5\n", "not 0 .. 0"),
    ("QQ== 0\n", "single bytes are not tokens"),
])
def test_bad_tiktoken_model_is_refused(tmp_path, text, message):
    with pytest.raises(TiktokenError, match=message):
        read_tiktoken(_with_model_text(tmp_path, text))


@pytest.mark.parametrize("class_file", [
    'import os\npat_str = os.environ["PATTERN"]\n',
    'pat_str = f"{1}"\n',
    'PARTS = ["a", "b"]\npat_str = "|".join(PARTS)\n',
    'pat_str = "a"\npat_str = "b"\n',
    "class T:\n    def pattern(self):\n        return 'x'\n",
    "def broken(:\n",
])
def test_pattern_that_is_not_a_literal_is_refused(tmp_path, class_file):
    directory = write_kimi_tokenizer(tmp_path, _hand_made_ranks(), class_file=class_file, specials={})
    with pytest.raises(TiktokenError, match="--tokenizer-pattern kimi-k2"):
        read_tiktoken(directory)
    # the option gives it; the class file is never run
    assert read_tiktoken(directory, "kimi-k2").pattern == KIMI_K2_PATTERN
    assert read_tiktoken(directory, r"\S+|\s+").pattern == r"\S+|\s+"


def test_class_file_is_never_executed(tmp_path):
    marker = tmp_path / "ran"
    class_file = f'open({str(marker)!r}, "w").close()\npat_str = "\\\\S+|\\\\s+"\n'
    directory = write_kimi_tokenizer(tmp_path / "ckpt", _hand_made_ranks(), class_file=class_file, specials={})
    assert read_tiktoken(directory).pattern == r"\S+|\s+"
    assert not marker.exists()


def test_bad_pattern_and_special_tokens_are_refused(tmp_path):
    ranks = _hand_made_ranks()
    with pytest.raises(TiktokenError, match="does not compile"):
        read_tiktoken(write_kimi_tokenizer(tmp_path / "a", ranks), "([unclosed")
    with pytest.raises(TiktokenError, match="outside the special ids"):
        read_tiktoken(write_kimi_tokenizer(tmp_path / "b", ranks, specials={-1: "<|low|>"}))
    with pytest.raises(TiktokenError, match="outside the special ids"):
        read_tiktoken(write_kimi_tokenizer(tmp_path / "c", ranks, specials={RESERVED: "<|high|>"}))
    with pytest.raises(TiktokenError, match="two ids"):
        read_tiktoken(write_kimi_tokenizer(tmp_path / "d", ranks, specials={0: "<|x|>", 1: "<|x|>"}))


# --- through colibri-convert ------------------------------------------------------------------


def _kimi_checkpoint(packs, tmp_path: Path, ranks, class_file: str | None = None) -> Path:
    """A tiny checkpoint whose tokenizer is published as Kimi K2's: no tokenizer.json."""
    import shutil

    from tests.tiny_checkpoints import CheckpointSpec

    ckpt = tmp_path / "ckpt"
    shutil.copytree(packs.checkpoint(CheckpointSpec("glm4_moe")), ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (ckpt / name).unlink(missing_ok=True)
    # Kimi K2's generation_config.json ends a turn on <|im_end|>
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": len(ranks) + 3}))
    return write_kimi_tokenizer(ckpt, ranks, class_file=class_file)


def _run_cli(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "colibrid.tools.convert.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_converted_pack_carries_the_tokenizer_and_chat_template(packs, tmp_path, ranks, converted):
    from colibrid.engine.text.tokenizer import Tokenizer
    from colibrid.pack import Pack

    ckpt = _kimi_checkpoint(packs, tmp_path, ranks)
    result = _run_cli(str(ckpt), str(tmp_path / "out"), "--quant", "f32")
    assert result.returncode == 0, result.stderr
    manifest = Pack.open(tmp_path / "out").manifest
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest.tokenizer_files)
    assert manifest.source["tokenizer"] == "tokenizer.json converted from tiktoken.model"
    assert not list((tmp_path / "out").glob("*.py"))  # the class file is not part of the pack

    tokenizer = Tokenizer.from_dir(tmp_path / "out")
    _, expected = converted
    for text in _corpus(len(ranks)):
        assert tokenizer.encode(text, add_special_tokens=False) == expected.encode(text, add_special_tokens=False).ids
    num_base = len(ranks)
    assert tokenizer.eos_token == "[EOS]" and tokenizer.eos_token_ids == {num_base + 3}
    # the chat template comes from tokenizer_config.json; its special tokens are the template's ids
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi <|im_end|> 中文"}])
    assert ids[0] == num_base + 4 and ids[-2:] == [num_base + 3, num_base + 5]
    assert ids.count(num_base + 3) == 1  # the user's "<|im_end|>" stayed text
    assert tokenizer.decode(ids) == "<|im_user|>Hi <|im_end|> 中文<|im_end|><|im_assistant|>"


def test_unreadable_pattern_fails_before_writing_and_the_option_fixes_it(packs, tmp_path, ranks):
    ckpt = _kimi_checkpoint(packs, tmp_path, ranks, class_file="import re\npat_str = re.compile('x').pattern\n")
    result = _run_cli(str(ckpt), str(tmp_path / "out"), "--quant", "f32")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "glm4_moe tokenizer" in lines[0] and "--tokenizer-pattern kimi-k2" in lines[0], lines
    assert not (tmp_path / "out").exists()

    result = _run_cli(str(ckpt), str(tmp_path / "out"), "--quant", "f32", "--tokenizer-pattern", "kimi-k2")
    assert result.returncode == 0, result.stderr
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tokenizer.encode("中文abc 123", add_special_tokens=False).ids == \
        [i for piece in ("中文", "abc", " ", "123") for i in reference_bpe(piece.encode(), ranks)]


def test_no_tokenizer_at_all_names_both_files(packs, tmp_path, ranks):
    ckpt = _kimi_checkpoint(packs, tmp_path, ranks)
    (ckpt / "tiktoken.model").unlink()
    result = _run_cli(str(ckpt), str(tmp_path / "out"))
    assert result.returncode == 1 and "tokenizer.json" in result.stderr and "tiktoken.model" in result.stderr


def test_tokenizer_config_nested_too_deep_is_refused(tmp_path):
    directory = write_kimi_tokenizer(tmp_path, _hand_made_ranks(), specials={})
    (directory / "tokenizer_config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(TiktokenError, match="not JSON"):
        read_tiktoken(directory)

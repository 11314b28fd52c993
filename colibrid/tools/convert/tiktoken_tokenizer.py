"""A tiktoken tokenizer (Kimi K2's ``tiktoken.model``) as a `tokenizers` tokenizer.json.

Kimi K2 publishes no tokenizer.json: its tokenizer is three pieces, each read here as
hostile input (bounded sizes, every number checked, nothing executed):

    tiktoken.model         one line per token: base64(token bytes), a space, its rank (= its id)
    tokenizer_config.json  the special tokens' ids and texts (added_tokens_decoder), and
                           auto_map naming the Python file of the tokenizer class
    tokenization_*.py      that class, whose ``pat_str`` is the pre-tokenizer regex. The file is
                           parsed (Python's ast), never imported or run: the pattern is taken
                           only if it is a plain string literal, or literals joined with + or
                           "sep".join([...]) (Kimi K2 writes it that way); anything else is
                           refused and --tokenizer-pattern gives it (``kimi-k2`` names Kimi K2's)

and becomes the byte-level BPE the engine's tokenizer runs (engine/tokenizer.py):

    pre-tokenizer  Split(pattern, isolated), then ByteLevel without its own regex: the same
                   pieces tiktoken's regex cuts, each mapped to GPT-2's byte alphabet
    model          BPE with vocab = the ranks and ``ignore_merges`` (a piece that is a token is
                   that token, as tiktoken looks a piece up whole before merging), and one
                   merge per multi-byte token, in rank order: the pair BPE itself would build
                   it from (derive_merges) - then merging by merge rank is tiktoken's merging
                   by the rank of the merged bytes, pair for pair
    added tokens   the special tokens at their ids (num_base .. num_base + reserved - 1):
                   the named ones from added_tokens_decoder, ``<|reserved_token_{id}|>`` for
                   the rest, as Kimi's tokenizer class names them
    decoder        ByteLevel

One difference is left on purpose: Kimi's Python class cuts inputs at 25,000 consecutive
whitespace or non-whitespace characters before encoding (a work-around for tiktoken's stack
use); texts with such runs may be cut into other tokens there.
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

log = logging.getLogger(__name__)

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Bounds on what a checkpoint may make the converter read or build. Kimi K2's tiktoken.model
# is 2.8 MB for 163,584 tokens; its tokenizer_config.json (chat template included) ~10 kB.
MAX_TIKTOKEN_FILE_BYTES = 64 * 1024 * 1024
MAX_BASE_TOKENS = 1 << 21
MAX_TOKEN_BYTES = 1024
MAX_TOKENIZER_CONFIG_BYTES = 16 * 1024 * 1024
MAX_PYTHON_FILE_BYTES = 1024 * 1024
MAX_PATTERN_CHARS = 16 * 1024
MAX_SPECIAL_TOKENS = 65536
MAX_SPECIAL_TOKEN_CHARS = 256

# Kimi K2's count of special-token ids after the base tokens (its class's
# num_reserved_special_tokens, read from the file when it is a plain integer).
DEFAULT_RESERVED_SPECIAL_TOKENS = 256

# The pre-tokenizer pattern of Kimi K2 (moonshotai/Kimi-K2-Instruct, tokenization_kimi.py,
# TikTokenTokenizer.pat_str): runs of Han characters; words without Han (case-aware, with
# English contractions); up to three digits; punctuation runs; newlines; other whitespace.
# The ``&&`` is a character-class intersection (tiktoken's and oniguruma's regex both have it).
KIMI_K2_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NAMED_PATTERNS = {"kimi-k2": KIMI_K2_PATTERN}
PATTERN_OPTION_HINT = "--tokenizer-pattern REGEX, or --tokenizer-pattern kimi-k2 for Kimi K2's published pattern"

_DECIMAL = re.compile(r"[0-9]{1,12}")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")


class TiktokenError(ValueError):
    """The tiktoken files cannot be converted; the message names the file and says why."""


@dataclass(frozen=True)
class TiktokenTokenizer:
    ranks: dict[bytes, int]  # token bytes -> rank, which is its id: 0 .. num_base - 1
    pattern: str  # the pre-tokenizer regex
    special_tokens: dict[int, str]  # id -> text, ids num_base .. num_base + reserved - 1


# --------------------------------------------------------------------------------------------
# Reading the files
# --------------------------------------------------------------------------------------------


def _read_bounded(path: Path, limit_bytes: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit_bytes + 1)
    except OSError as exc:
        raise TiktokenError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit_bytes:
        raise TiktokenError(f"{path}: larger than {limit_bytes} bytes, refused")
    return data


def read_ranks(path: Path) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken.model file: ``base64 rank`` per line, ranks 0 .. n-1
    each once, every one of the 256 bytes a token (byte-level BPE must encode any input)."""
    ranks: dict[bytes, int] = {}
    lines = _read_bounded(path, MAX_TIKTOKEN_FILE_BYTES).split(b"\n")
    for number, line in enumerate(lines, start=1):
        line = line.rstrip(b"\r")
        if not line:
            continue
        fields = line.split(b" ")
        if len(fields) != 2 or not _DECIMAL.fullmatch(fields[1].decode("ascii", "replace")):
            raise TiktokenError(f"{path}:{number}: expected 'base64 rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise TiktokenError(f"{path}:{number}: invalid base64 {fields[0][:80]!r}") from None
        rank = int(fields[1])
        if not 1 <= len(token) <= MAX_TOKEN_BYTES:
            raise TiktokenError(f"{path}:{number}: a token of {len(token)} bytes (1 to {MAX_TOKEN_BYTES} allowed)")
        if token in ranks:
            raise TiktokenError(f"{path}:{number}: token {token!r} listed twice")
        if len(ranks) >= MAX_BASE_TOKENS:
            raise TiktokenError(f"{path}: more than {MAX_BASE_TOKENS} tokens, refused")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TiktokenError(f"{path}: the ranks are not 0 .. {len(ranks) - 1}, each once (they are the token ids)")
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise TiktokenError(f"{path}: {len(missing)} single bytes are not tokens (e.g. {bytes([missing[0]])!r}): "
                            "not a byte-level BPE")
    return ranks


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_bounded(path, MAX_TOKENIZER_CONFIG_BYTES))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise TiktokenError(f"{path}: not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise TiktokenError(f"{path}: expected a JSON object")
    return value


def special_tokens(config: dict[str, Any], num_base: int, reserved: int, source: Path) -> dict[int, str]:
    """id -> text of every special token: ``added_tokens_decoder``'s named ones, and
    ``<|reserved_token_{id}|>`` for the other ids of the reserved range."""
    named: dict[int, str] = {}
    entries = config.get("added_tokens_decoder") or {}
    if not isinstance(entries, dict) or len(entries) > MAX_SPECIAL_TOKENS:
        raise TiktokenError(f"{source}: added_tokens_decoder must be an object of at most {MAX_SPECIAL_TOKENS} entries")
    for key, entry in entries.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not _DECIMAL.fullmatch(key) or not isinstance(content, str) or not 0 < len(content) <= MAX_SPECIAL_TOKEN_CHARS:
            raise TiktokenError(f"{source}: added_tokens_decoder entry {key[:40]!r} needs a decimal id and a "
                                f"'content' of 1 to {MAX_SPECIAL_TOKEN_CHARS} characters")
        token_id = int(key)
        if not num_base <= token_id < num_base + reserved:
            raise TiktokenError(f"{source}: special token {content!r} has id {token_id}, outside the special ids "
                                f"{num_base} .. {num_base + reserved - 1} after the {num_base} tiktoken ranks")
        named[token_id] = content
    tokens = {token_id: named.get(token_id, f"<|reserved_token_{token_id}|>")
              for token_id in range(num_base, num_base + reserved)}
    texts = list(tokens.values())
    if len(set(texts)) != len(texts):
        duplicate = next(text for text in texts if texts.count(text) > 1)
        raise TiktokenError(f"{source}: special token {duplicate!r} is given two ids")
    return tokens


# --------------------------------------------------------------------------------------------
# The pre-tokenizer pattern, from the tokenizer class's source without running it
# --------------------------------------------------------------------------------------------


def _static_string(node: ast.AST) -> str | None:
    """The value of a string literal, of literals joined by +, or of "sep".join([literals]);
    None for anything else (a name, a call, a format string: what only running code knows)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _static_string(node.left), _static_string(node.right)
        return None if left is None or right is None else left + right
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))):
        separator = _static_string(node.func.value)
        parts = [_static_string(element) for element in node.args[0].elts]
        return None if separator is None or None in parts else separator.join(parts)
    return None


def _static_int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _assignments(tree: ast.AST, name: str) -> list[ast.AST]:
    """The values assigned to ``name`` anywhere in the module (class bodies included)."""
    values = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            values.append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name and node.value:
            values.append(node.value)
    return values


def tokenizer_class_file(src: Path, config: dict[str, Any]) -> Path | None:
    """The Python file of the tokenizer class: auto_map's module (a plain name, in ``src``),
    else the one tokenization_*.py there."""
    auto_map = config.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    reference = entry[0] if isinstance(entry, list) and entry else entry
    if isinstance(reference, str) and "." in reference:
        module = reference.rsplit(".", 1)[0]
        if _MODULE_NAME.fullmatch(module) and (src / f"{module}.py").is_file():
            return src / f"{module}.py"
    candidates = sorted(src.glob("tokenization_*.py"))
    return candidates[0] if len(candidates) == 1 else None


def _parse_python(path: Path) -> ast.AST:
    try:
        return ast.parse(_read_bounded(path, MAX_PYTHON_FILE_BYTES), filename=str(path))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise TiktokenError(f"{path}: not Python that can be parsed ({type(exc).__name__}); "
                            f"give the pattern with {PATTERN_OPTION_HINT}") from None


def pattern_from_source(path: Path, tree: ast.AST) -> str:
    values = _assignments(tree, "pat_str")
    if not values:
        raise TiktokenError(f"{path} assigns no pat_str (the pre-tokenizer pattern); give it with {PATTERN_OPTION_HINT}")
    patterns = {_static_string(value) for value in values}
    if None in patterns or len(patterns) != 1:
        raise TiktokenError(f"{path}: pat_str is not one plain string literal (Colibri never runs a checkpoint's "
                            f"code to compute it); give it with {PATTERN_OPTION_HINT}")
    return patterns.pop()


def reserved_from_source(path: Path, tree: ast.AST) -> int:
    """num_reserved_special_tokens when the class sets it to a plain integer, else Kimi K2's 256."""
    values = {_static_int(value) for value in _assignments(tree, "num_reserved_special_tokens")}
    if len(values) != 1 or None in values:
        return DEFAULT_RESERVED_SPECIAL_TOKENS
    reserved = values.pop()
    if not 0 <= reserved <= MAX_SPECIAL_TOKENS:
        raise TiktokenError(f"{path}: num_reserved_special_tokens {reserved} is not in 0 .. {MAX_SPECIAL_TOKENS}")
    return reserved


def check_pattern(pattern: str, origin: str) -> str:
    if not 0 < len(pattern) <= MAX_PATTERN_CHARS:
        raise TiktokenError(f"{origin}: the pre-tokenizer pattern must have 1 to {MAX_PATTERN_CHARS} characters")
    try:
        tokenizers.Regex(pattern)
    except Exception as exc:  # the binding raises a plain Exception for a bad regex
        raise TiktokenError(f"{origin}: the pre-tokenizer pattern does not compile ({exc})") from None
    return pattern


# --------------------------------------------------------------------------------------------
# Merges and the tokenizer.json
# --------------------------------------------------------------------------------------------


def _parts_before(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's merging of ``token``'s bytes alone, stopped at two parts: repeatedly join the
    adjacent pair whose bytes have the lowest rank (the leftmost of equals). More than two
    parts come back when merging gets stuck before (no adjacent pair is a token)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = None, -1
        for at in range(len(parts) - 1):
            rank = ranks.get(parts[at] + parts[at + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, at
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the two parts tiktoken's merging of the
    token's bytes alone reaches just before it forms the token. Wherever tiktoken forms a
    token inside a longer piece, the merges inside its span happen in the same order as on
    the token alone (each is the lowest-ranked pair of the piece, so of the span too), so
    that pair is the only one it ever joins into the token; and with one merge per token,
    ordered by the token's rank, BPE's lowest-merge-first is tiktoken's lowest-rank-first.
    A token whose bytes get stuck at three or more parts gets no merge: tiktoken, and BPE
    with ignore_merges, produce it only as a whole pre-tokenized piece."""
    merges, unreachable = [], 0
    for token, _rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = _parts_before(token, ranks)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            unreachable += 1
    if unreachable:
        log.info("%d tiktoken tokens are reachable only as whole pre-tokenized pieces (no merge)", unreachable)
    return merges


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> one printable character. The printable Latin-1
    bytes stand for themselves; the others (controls, space, soft hyphen) take U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, shifted = [""] * 256, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


BYTE_ALPHABET = _byte_alphabet()


def byte_level(token: bytes) -> str:
    return "".join(BYTE_ALPHABET[byte] for byte in token)


def to_tokenizer_json(model: TiktokenTokenizer) -> str:
    vocab = {byte_level(token): rank for token, rank in model.ranks.items()}
    merges = [(byte_level(left), byte_level(right)) for left, right in derive_merges(model.ranks)]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(model.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    ordered = [model.special_tokens[token_id] for token_id in sorted(model.special_tokens)]
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in ordered])
    for token_id, text in model.special_tokens.items():
        if tokenizer.token_to_id(text) != token_id:
            # e.g. a special token whose text is also a base token's byte-level text
            raise TiktokenError(f"special token {text!r} cannot keep its id {token_id}")
    return tokenizer.to_str(pretty=False)


def read_tiktoken(src: Path, pattern: str | None = None) -> TiktokenTokenizer:
    """Read a checkpoint directory's tiktoken tokenizer. ``pattern``: --tokenizer-pattern
    (a regex, or a name in NAMED_PATTERNS), which wins over the class file's pat_str."""
    ranks = read_ranks(src / TIKTOKEN_FILE)
    config_path = src / TOKENIZER_CONFIG_FILE
    config = read_tokenizer_config(config_path)
    class_file = tokenizer_class_file(src, config)
    tree = None
    if pattern is not None:
        pattern = check_pattern(NAMED_PATTERNS.get(pattern, pattern), "--tokenizer-pattern")
        try:
            tree = _parse_python(class_file) if class_file else None  # for the reserved count only
        except TiktokenError as exc:
            log.warning("%s", exc)
    elif class_file is None:
        raise TiktokenError(f"{src} has {TIKTOKEN_FILE} but no tokenizer class file (tokenization_*.py) to read "
                            f"the pre-tokenizer pattern from; give it with {PATTERN_OPTION_HINT}")
    else:
        tree = _parse_python(class_file)
        pattern = check_pattern(pattern_from_source(class_file, tree), str(class_file))
    reserved = reserved_from_source(class_file, tree) if tree is not None else DEFAULT_RESERVED_SPECIAL_TOKENS
    specials = special_tokens(config, len(ranks), reserved, config_path)
    return TiktokenTokenizer(ranks, pattern, specials)


def convert_tiktoken(src: Path, pattern: str | None = None) -> str:
    """The tokenizer.json text for a checkpoint that ships tiktoken.model (TiktokenError if not)."""
    return to_tokenizer_json(read_tiktoken(src, pattern))

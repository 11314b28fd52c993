"""What a pack's tokenizer files say besides the pipeline itself, read once: the named special
tokens, the ids that end a generation, the pad id, the default chat template.

A pack carries verbatim copies of the checkpoint's tokenizer files:

    tokenizer.json           the `tokenizers` pipeline (normalizer, pre-tokenizer, model,
                             post-processor, decoder) - required; Tokenizer.from_dir loads it
    tokenizer_config.json    special tokens, chat template, clean-up flag - optional
    special_tokens_map.json  legacy special tokens - optional
    generation_config.json   eos_token_id (int or list), pad_token_id - optional
    chat_template.jinja      the chat template as a file - optional, wins over the config
    config.json              eos_token_id, the last fallback - optional

The rules are transformers 5.x's, without importing transformers.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIG_FILE = "config.json"

# The named special tokens transformers exposes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES),
# in its order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class TokenizerFiles:
    """What a pack's tokenizer files say, parsed once; the inputs of `Tokenizer`."""

    special_tokens: dict[str, str]  # "bos_token" -> "<s>", only the tokens that are set
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    chat_template: str | None
    clean_up_tokenization_spaces: bool


def read_tokenizer_files(pack_dir: str, backend: tokenizers.Tokenizer) -> TokenizerFiles:
    """The optional files of ``pack_dir`` beside its tokenizer.json, whose pipeline ``backend``
    is (it gives the ids of the special tokens the files name)."""
    tokenizer_config = _read_json(os.path.join(pack_dir, TOKENIZER_CONFIG_FILE))
    special_tokens_map = _read_json(os.path.join(pack_dir, SPECIAL_TOKENS_MAP_FILE))
    generation_config = _read_json(os.path.join(pack_dir, GENERATION_CONFIG_FILE))
    model_config = _read_json(os.path.join(pack_dir, MODEL_CONFIG_FILE))
    _log_ignored_bos_eos_flags(tokenizer_config)

    special_tokens = _special_tokens(tokenizer_config, special_tokens_map)
    return TokenizerFiles(
        special_tokens=special_tokens,
        eos_token_ids=_resolve_eos_token_ids(backend, special_tokens, generation_config, model_config),
        pad_token_id=_resolve_pad_token_id(backend, special_tokens, generation_config),
        chat_template=_select_chat_template(pack_dir, tokenizer_config),
        clean_up_tokenization_spaces=bool(tokenizer_config.get("clean_up_tokenization_spaces", False)),
    )


def _read_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`, or {} if the file is absent (every file but tokenizer.json is optional)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        value = json.load(handle)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as configured: a string, an AddedToken dict {"content": ...}, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognised special token entry: {value!r}")


def _special_tokens(tokenizer_config: dict[str, Any], special_tokens_map: dict[str, Any]) -> dict[str, str]:
    """The named special tokens (bos_token, ...) that are set, as transformers resolves them.

    transformers reads special_tokens_map.json only for configs without "added_tokens_decoder"
    (the legacy layout), and there it overrides tokenizer_config.json.
    """
    merged = {name: tokenizer_config.get(name) for name in SPECIAL_TOKEN_NAMES}
    if "added_tokens_decoder" not in tokenizer_config:
        for name in SPECIAL_TOKEN_NAMES:
            if name in special_tokens_map:
                merged[name] = special_tokens_map[name]
    resolved = {name: _token_content(value) for name, value in merged.items()}
    return {name: content for name, content in resolved.items() if content is not None}


def _ids_from_config_value(value: Any) -> list[int]:
    """An `eos_token_id`-style entry: an int, a list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ValueError(f"expected a token id or a list of token ids, got {value!r}")
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"expected a token id or a list of token ids, got {value!r}")
    return ids


def _select_chat_template(pack_dir: str, tokenizer_config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja wins over the config entry, as in transformers."""
    template_path = os.path.join(pack_dir, CHAT_TEMPLATE_FILE)
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as handle:
            return handle.read()
    entry = tokenizer_config.get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        # The multi-template layout: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {item.get("name"): item.get("template") for item in entry if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        logger.warning("chat templates %s have none named 'default'; chat is disabled", sorted(map(str, named)))
        return None
    raise ValueError(f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list, got {type(entry).__name__}")


def _log_ignored_bos_eos_flags(tokenizer_config: dict[str, Any]) -> None:
    flags = {key: tokenizer_config[key] for key in ("add_bos_token", "add_eos_token") if key in tokenizer_config}
    if flags:
        logger.debug("ignoring %s: tokenizer.json's post-processor adds special tokens (as in transformers 5)", flags)


def _resolve_eos_token_ids(
    backend: tokenizers.Tokenizer,
    special_tokens: dict[str, str],
    generation_config: dict[str, Any],
    model_config: dict[str, Any],
) -> frozenset[int]:
    # generation_config.json is what transformers' generate() stops on, and it lists every end
    # token of chat models (e.g. <|eot_id|> and <|end_of_text|>), so it comes first.
    ids = _ids_from_config_value(generation_config.get("eos_token_id"))
    if not ids and "eos_token" in special_tokens:
        eos_id = backend.token_to_id(special_tokens["eos_token"])
        ids = [] if eos_id is None else [eos_id]
    if not ids:
        ids = _ids_from_config_value(model_config.get("eos_token_id"))
    if not ids:
        logger.warning("no end-of-sequence token found; generations end only on length or stop strings")
    return frozenset(ids)


def _resolve_pad_token_id(
    backend: tokenizers.Tokenizer, special_tokens: dict[str, str], generation_config: dict[str, Any]
) -> int | None:
    if "pad_token" in special_tokens:
        pad_id = backend.token_to_id(special_tokens["pad_token"])
        if pad_id is not None:
            return pad_id
    pad_ids = _ids_from_config_value(generation_config.get("pad_token_id"))
    return pad_ids[0] if pad_ids else None

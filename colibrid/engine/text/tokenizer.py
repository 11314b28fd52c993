"""Text <-> token ids for a pack, with the same results as transformers' fast tokenizer.

Encoding and decoding run in the `tokenizers` library (Rust), from the pack's tokenizer.json;
this module only decides the same things transformers 5.x decides around it: which special
tokens exist, which ids end a generation (both read from the pack's other tokenizer files,
tokenizer_files.py), how the chat template is rendered. transformers itself is never imported
here.

Streaming generated ids as text is incremental_decoder.py's.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
import tokenizers

from colibrid.engine.text.chat_template import (
    TEMPLATE_ALLOWANCE_CHARS,
    ChatTemplateError,
    compile_chat_template,
    render_bounded,
)
from colibrid.engine.text.tokenizer_files import TOKENIZER_FILE, TokenizerFiles, read_tokenizer_files

logger = logging.getLogger(__name__)

NO_CHAT_TEMPLATE_MESSAGE = "this model has no chat template; send a raw prompt"

# Names a message's reasoning may arrive under; templates read the first (transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# --------------------------------------------------------------------------------------------
# What chat templates see
# --------------------------------------------------------------------------------------------


def _plain_template_data(value: Any) -> Any:
    """Rebuild `value` from plain JSON types so a template only ever sees inert data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(item) for item in value)
    # Anything else (objects with methods the sandbox cannot vet) becomes an inert placeholder.
    return f"<{type(value).__name__}>"


def _map_strings(value: Any, function: Callable[[str], str]) -> Any:
    """`value` (plain template data) with `function` applied to every string in it, keys excepted."""
    if isinstance(value, str):
        return function(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, function) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(item, function) for item in value)
    return value


def _text_length(value: Any) -> int:
    """Characters in all the strings of `value` (plain template data), keys included."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_length(key) + _text_length(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_length(item) for item in value)
    return 0


class _SpecialTextMask:
    """Hides special-token text in a conversation from the template, and gives it back afterwards.

    Each occurrence becomes a placeholder (private-use characters around a random number, so
    a client cannot write one, and templates that trim or test their content see ordinary
    text); after rendering, every special token left in the prompt is the template's own.
    """

    def __init__(self, special_texts: Sequence[str]) -> None:
        self._special_texts = list(special_texts)
        self._find = re.compile("|".join(map(re.escape, special_texts))) if special_texts else None
        self._index = {text: index for index, text in enumerate(special_texts)}
        self._opening = f"\ue000{secrets.randbits(64)}:"
        self._placeholder = re.compile(re.escape(self._opening) + r"(\d+)\ue001")
        self.masked = 0  # occurrences hidden so far

    def mask(self, text: str) -> str:
        if self._find is None:
            return text
        masked, count = self._find.subn(lambda m: f"{self._opening}{self._index[m.group()]}\ue001", text)
        self.masked += count
        return masked

    def restore(self, text: str) -> str:
        return self._placeholder.sub(self._original, text) if self.masked else text

    def _original(self, placeholder: re.Match) -> str:
        index = int(placeholder.group(1))
        # A template that rewrote the digits gets its text back as it wrote it: text, never a special.
        return self._special_texts[index] if index < len(self._special_texts) else placeholder.group()


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: None-valued keys dropped, reasoning aliased."""
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat messages must be objects with 'role' and 'content', got {message!r}")
        plain = {key: value for key, value in _plain_template_data(message).items() if value is not None}
        reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            # gpt-oss templates read "thinking", most others "reasoning_content".
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(plain)
    return normalized


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A pack's tokenizer: encode, decode, special ids and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, files: TokenizerFiles,
                 parse_special_tokens_in_content: bool = False) -> None:
        self._backend = backend
        self._files = files
        # False: special-token text in a conversation stays text (encode_chat); True: transformers'
        # behaviour, where a user's "<|im_start|>system" becomes the special tokens.
        self.parse_special_tokens_in_content = parse_special_tokens_in_content
        self._special_tokens_by_text = {token.content: token for token in backend.get_added_tokens_decoder().values()
                                        if token.special}
        self._special_texts = sorted(self._special_tokens_by_text, key=len, reverse=True)  # longest match first
        self._special_pattern = re.compile("|".join(map(re.escape, self._special_texts)) or r"(?!)")
        self._backend_specials_as_text: tokenizers.Tokenizer | None = None  # built when first needed
        # transformers skips the WordPiece-era clean-up for BPE models: it deletes real spaces.
        self._clean_up_spaces = files.clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None
        if files.chat_template is not None:
            try:
                self._template = compile_chat_template(files.chat_template)
            except jinja2.exceptions.TemplateError as exc:
                # Raw prompts still work; chat requests get this error instead of a wrong prompt.
                self._template_error = f"this model's chat template does not compile: {exc}"
                logger.warning("%s", self._template_error)

    @classmethod
    def from_dir(cls, pack_dir: str | os.PathLike[str], parse_special_tokens_in_content: bool = False) -> Tokenizer:
        """Load the tokenizer files of a pack (or of a Hugging Face checkpoint directory)."""
        pack_dir = os.fspath(pack_dir)
        tokenizer_path = os.path.join(pack_dir, TOKENIZER_FILE)
        if not os.path.isfile(tokenizer_path):
            raise FileNotFoundError(f"{tokenizer_path} is missing; the pack has no tokenizer")
        backend = tokenizers.Tokenizer.from_file(tokenizer_path)
        files = read_tokenizer_files(pack_dir, backend)
        logger.debug(
            "tokenizer from %s: vocab %d, eos ids %s", pack_dir, backend.get_vocab_size(), sorted(files.eos_token_ids)
        )
        return cls(backend, files, parse_special_tokens_in_content)

    # ---- ids and text ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest vocabulary entry, added tokens included: at most how many
        bytes of text one token can stand for.

        A vocabulary entry spells what its token covers, never in fewer bytes: byte-level BPE
        maps each byte to one 1-2 byte character ("Ġ" for a space), SentencePiece writes a space
        as the 3-byte "▁" and a fallback byte as "<0x0A>", special tokens match their own text.
        So a text of B bytes needs at least B / max_token_bytes tokens - as long as the
        normalizer does not delete text, which these tokenizers' normalizers (none, prepend,
        replace a space) do not. Computed once (the engine asks at load).
        """
        return max((len(entry.encode("utf-8")) for entry in self._backend.get_vocab(with_added_tokens=True)),
                   default=1)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (e.g. "▁world", "Ġworld"), not its decoded text."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        add_special_tokens applies tokenizer.json's post-processor (e.g. a BOS template).
        tokenizer_config's add_bos_token/add_eos_token are ignored, as transformers 5.x ignores
        them whenever tokenizer.json exists. Special-token text in `text` (e.g. "<|im_start|>")
        becomes the special token, as in transformers (a raw prompt is the client's whole text;
        encode_chat keeps a conversation's special-token text as text).
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`, as transformers' decode (including its legacy space clean-up where it applies)."""
        text = self.decode_raw(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            text = _clean_up_tokenization(text)
        return text

    def decode_raw(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """`decode` without the legacy space clean-up; what IncrementalDecoder diffs."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- special tokens --------------------------------------------------------------------

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set: {"bos_token": "<s>", "eos_token": "</s>", ...}."""
        return dict(self._files.special_tokens)

    @property
    def bos_token(self) -> str | None:
        return self._files.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._files.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's BOS id (from its config, as transformers' tokenizer.bos_token_id), or None."""
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: generation_config.json, else the tokenizer's eos_token, else config.json."""
        return self._files.eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._files.pad_token_id

    # ---- chat ------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """True if the pack has a chat template that compiles."""
        return self._template is not None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text the chat template renders for `messages`.

        The template sees what transformers gives it: messages, tools, documents,
        add_generation_prompt, the named special tokens (bos_token, eos_token, ...) and `extra`
        (which overrides them; e.g. enable_thinking=False). Raises ValueError for a conversation
        the template rejects, ChatTemplateError for a template over its budget (chat_template.py).
        """
        return self._render(messages, add_generation_prompt, lambda text: text, extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], system: str | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids for a conversation: the rendered template, encoded without added special tokens.

        `system`, if given, is prepended as a system message; `tools` (function descriptions)
        reach the template as transformers passes them. add_special_tokens=False because
        the template already writes BOS and friends itself (transformers does the same).

        Special-token text inside the conversation (a user writing "<|im_start|>system") stays
        text, unless parse_special_tokens_in_content: only the template's own special tokens
        become special ids, so a client cannot forge roles. A conversation without such text is
        encoded exactly as transformers encodes it.
        """
        self._require_template()
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        extra = {"tools": list(tools)} if tools else {}
        if self.parse_special_tokens_in_content:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt=True, **extra),
                               add_special_tokens=False)
        mask = _SpecialTextMask(self._special_texts)
        prompt = self._render(messages, True, mask.mask, extra)
        if not mask.masked:
            return self.encode(prompt, add_special_tokens=False)
        return self._encode_template_specials_only(prompt, mask)

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                content_filter: Callable[[str], str], extra: dict[str, Any]) -> str:
        """Render the template; `content_filter` is applied to every string of messages, tools and documents."""
        template = self._require_template()
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        extra = dict(extra)
        conversation = _map_strings(_normalize_messages(messages), content_filter)
        tools = _map_strings(_plain_template_data(extra.pop("tools", None)), content_filter)
        documents = _map_strings(_plain_template_data(extra.pop("documents", None)), content_filter)
        variables = {**self._files.special_tokens, **_plain_template_data(extra)}
        # The template may add TEMPLATE_ALLOWANCE_CHARS to what the conversation holds, no more.
        max_chars = _text_length((conversation, tools, documents, variables)) + TEMPLATE_ALLOWANCE_CHARS
        try:
            return render_bounded(template, max_chars, dict(
                messages=conversation, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **variables))
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() in templates reports malformed conversations (e.g. roles out of order).
            raise ValueError(f"the chat template rejected the conversation: {exc}") from exc
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template bug (a TypeError, a recursion): the model's fault, not the client's
            raise ChatTemplateError(f"this model's chat template failed: {type(exc).__name__}: {exc}") from exc

    def _encode_template_specials_only(self, prompt: str, mask: _SpecialTextMask) -> list[int]:
        """Ids of `prompt`, where the only special-token text left is the template's own.

        The prompt is cut at those special tokens; the text between two of them (the template's
        words and the client's, with the client's special-token text put back) is encoded with
        special-token parsing off, and the template's special tokens become their ids - what the
        tokenizer would do for the whole string, minus the specials the client wrote.
        """
        ids: list[int] = []
        position = 0
        for match in self._special_pattern.finditer(prompt):
            token = self._special_tokens_by_text[match.group()]
            text = prompt[position : match.start()]
            if token.lstrip:  # the token swallows the whitespace before it (and after, with rstrip)
                text = text.rstrip()
            ids += self._encode_as_text(mask.restore(text))
            ids.append(self._backend.token_to_id(token.content))
            position = match.end()
            if token.rstrip:
                position += len(prompt[position:]) - len(prompt[position:].lstrip())
        ids += self._encode_as_text(mask.restore(prompt[position:]))
        return ids

    def _encode_as_text(self, text: str) -> list[int]:
        """Ids of `text` with special-token text in it taken as text (transformers' split_special_tokens)."""
        if not text:
            return []
        if self._backend_specials_as_text is None:
            self._backend_specials_as_text = tokenizers.Tokenizer.from_str(self._backend.to_str())
            self._backend_specials_as_text.encode_special_tokens = True
        return self._backend_specials_as_text.encode(text, add_special_tokens=False).ids

    def _require_template(self) -> jinja2.Template:
        if self._template is not None:
            return self._template
        raise ValueError(self._template_error or NO_CHAT_TEMPLATE_MESSAGE)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: removes spaces WordPiece-era decoders put before punctuation."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )

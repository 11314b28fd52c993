"""Checkpoints that wrap a supported text model in a multimodal one (Kimi-VL wraps
DeepSeek-V3's decoder, LLaVA-style models wrap Mistral/Mixtral decoders): config.json has
the text model's configuration under ``text_config`` and the weights sit under a prefix
(``model.language_model.`` in transformers 5's layout, ``language_model.model.`` in the
older one). Colibri converts the text model and leaves the vision tower and projector out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Checkpoint name prefixes of a wrapped text model -> the names family modules use.
TEXT_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
# Keys a wrapper's config.json may keep at its top level for the text model too; the
# text_config's own value wins where both have one (as transformers' get_text_config()).
INHERITED_KEYS = ("tie_word_embeddings", "quantization_config", "bos_token_id", "eos_token_id", "vocab_size")


@dataclass(frozen=True)
class TextModelConfig:
    config: dict[str, Any]  # what the family module reads
    wrapper: str | None  # the wrapper's model_type, None for a plain text checkpoint


def text_model_config(hf: dict[str, Any], is_supported) -> TextModelConfig:
    """The text model's configuration: config.json itself when its model_type is a supported
    family (or it has no text_config), else its text_config with the inherited keys."""
    inner = hf.get("text_config")
    if is_supported(hf.get("model_type")) or not isinstance(inner, dict):
        return TextModelConfig(hf, None)
    merged = {key: hf[key] for key in INHERITED_KEYS if key in hf}
    merged.update(inner)
    return TextModelConfig(merged, str(hf.get("model_type")))

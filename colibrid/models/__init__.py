"""Architecture registry: one module per Hugging Face MoE family, one line each here."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import Architecture, UnsupportedConfig
from colibrid.models.deepseek_v2 import DeepseekV2
from colibrid.models.deepseek_v3 import DeepseekV3
from colibrid.models.gemma4 import Gemma4
from colibrid.models.glm4_moe import Glm4Moe
from colibrid.models.gpt_oss import GptOss
from colibrid.models.llama4 import Llama4
from colibrid.models.mixtral import Mixtral
from colibrid.models.olmoe import Olmoe
from colibrid.models.qwen2_moe import Qwen2Moe
from colibrid.models.qwen3_5_moe import Qwen35Moe
from colibrid.models.qwen3_moe import Qwen3Moe
from colibrid.models.qwen3_next import Qwen3Next

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch for arch in (Olmoe(), Mixtral(), Qwen2Moe(), Qwen3Moe(), Glm4Moe(), DeepseekV2(), DeepseekV3(), GptOss(),
                                 Qwen35Moe(), Qwen3Next(), Llama4(), Gemma4())
}


class UnsupportedArchitecture(ValueError):
    """config.json names a model family Colibri cannot run."""


def supported_names() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(hf_config: dict[str, Any]) -> Architecture:
    """Pick the architecture module for a Hugging Face config.json (by model_type)."""
    model_type = hf_config.get("model_type")
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    named = model_type or ", ".join(hf_config.get("architectures") or []) or "none given"
    raise UnsupportedArchitecture(
        f"unsupported architecture {named!r}; supported: {', '.join(supported_names())}"
    )


__all__ = ["ARCHITECTURES", "Architecture", "UnsupportedArchitecture", "UnsupportedConfig", "architecture_for"]

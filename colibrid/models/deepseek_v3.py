"""DeepSeek-V3 / R1 (deepseek-ai/DeepSeek-V3) and Kimi K2 (moonshotai/Kimi-K2-Instruct, whose
config.json says model_type kimi_k2 and DeepseekV3ForCausalLM): DeepSeek-V2's latent
attention (interleaved rope pairs unless rope_interleave is false), shared experts and dense
first layers, with sigmoid routing: a choice-only e_score_correction_bias, groups scored by
their best two experts, the top-k weights renormalised (norm_topk_prob) and scaled by
routed_scaling_factor. The multi-token-prediction layers published after the last decoder
layer are not converted."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import UnsupportedConfig
from colibrid.models.deepseek_v2 import DeepseekV2
from colibrid.models.glm4_moe import Glm4Moe


class DeepseekV3(DeepseekV2):
    name = "deepseek_v3"
    hf_model_types = ("deepseek_v3", "kimi_k2")

    def rope_interleaved(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("rope_interleave", True))

    def routing_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        if (hf.get("scoring_func") or "sigmoid") != "sigmoid":
            raise UnsupportedConfig(f"{self.name}: scoring_func {hf['scoring_func']!r} is not supported (only sigmoid)")
        return dict(norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_scoring="sigmoid",
                    router_groups=int(hf.get("n_group") or 1),
                    router_groups_kept=int(hf.get("topk_group") or 1), router_group_score="top2_sum")

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        return frozenset({"router_choice_bias"})  # e_score_correction_bias

    conversion_notes = Glm4Moe.conversion_notes  # the same MTP layers past num_hidden_layers, skipped

"""The model shapes bench/bench_kernels.py measures (``--shape``), one module each: the
Hugging Face config, the random checkpoint's tensors, and the GGUF with the same values."""

from shapes import deepseek_v3, gpt_oss_20b, olmoe
from shapes.common import Shape, Variant, log

SHAPES: dict[str, Shape] = {s.name: s for s in (olmoe.SHAPE, deepseek_v3.SHAPE, gpt_oss_20b.SHAPE)}

__all__ = ["SHAPES", "Shape", "Variant", "log"]

"""The ``--quant`` option: which element type each class of tensor is stored in.

Classes:
  experts     routed experts (the bulk of an MoE model, streamed from disk)
  dense       attention projections, shared experts, dense MLP layers
  embeddings  the input embedding and the output head
Norm weights, biases, routers and the shared-expert gate are always f32: they are
tiny, and quantizing a router would let precision change which experts are chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from colibrid.native import TensorType

TENSOR_CLASSES = ("experts", "dense", "embeddings")
TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_g64", "mxfp4")

# Experts dominate both the bytes streamed per token and the file size, so they get
# the 4-bit type; attention and embeddings are read every token but are a small share
# of the bytes, so they keep 8 bits for quality.
DEFAULT_QUANT = {"experts": "q4_g64", "dense": "q8_0", "embeddings": "q8_0"}


@dataclass(frozen=True)
class QuantSpec:
    experts: TensorType
    dense: TensorType
    embeddings: TensorType
    # classes whose type the user named: the converter keeps published MXFP4 experts as
    # mxfp4 only when "experts" is not among them
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    def for_class(self, tensor_class: str) -> TensorType:
        return getattr(self, tensor_class)

    def with_type(self, tensor_class: str, type_: TensorType) -> "QuantSpec":
        return replace(self, **{tensor_class: type_})

    def to_json(self) -> dict[str, str]:
        return {c: self.for_class(c).name_in_pack for c in TENSOR_CLASSES}


def parse_quant(text: str | None) -> QuantSpec:
    """``q8_0`` sets every class; ``experts=q4_g64,dense=q8_0`` overrides some of the defaults."""
    chosen = dict(DEFAULT_QUANT)
    explicit: set[str] = set()
    if text:
        for item in text.split(","):
            item = item.strip()
            if "=" in item:
                cls, _, type_name = item.partition("=")
                cls, type_name = cls.strip(), type_name.strip()
                if cls not in TENSOR_CLASSES:
                    raise ValueError(f"--quant: unknown tensor class {cls!r}; classes: {', '.join(TENSOR_CLASSES)}")
                chosen[cls] = type_name
                explicit.add(cls)
            else:
                chosen = dict.fromkeys(TENSOR_CLASSES, item)
                explicit.update(TENSOR_CLASSES)
    for cls, type_name in chosen.items():
        if type_name not in TYPE_NAMES:
            raise ValueError(f"--quant: unknown type {type_name!r} for {cls}; types: {', '.join(TYPE_NAMES)}")
    return QuantSpec(**{cls: TensorType.from_name(name) for cls, name in chosen.items()}, explicit=frozenset(explicit))

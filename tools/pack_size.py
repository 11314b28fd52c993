"""The size of a model's pack, computed from its config.json alone, with the converter's
layout (tensor alignment, expert records padded to it, f32 fallbacks): how docs/models.md's
pack sizes are computed. No weights are read.

    python tools/pack_size.py CONFIG.json [--quant SPEC ...] [--align BYTES]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colibrid.tools.convert.quant_spec import parse_quant  # noqa: E402
from colibrid.tools.convert.wrapped import text_model_config  # noqa: E402
from colibrid.models import ARCHITECTURES, architecture_for  # noqa: E402
from colibrid.models.model_config import ModelConfig, parameter_counts  # noqa: E402
from colibrid.pack.layout import (  # noqa: E402
    expected_dense_shape,
    expected_expert_shapes,
    expert_part_names,
    expert_part_type,
    requested_type,
    stored_type,
)
from colibrid.pack.manifest import EXPERT_PART_ALIGN_BYTES  # noqa: E402


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _tensor_bytes(wanted, shape: tuple[int, ...]) -> int:
    type_ = stored_type(wanted, shape)
    if len(shape) == 1:
        return 4 * shape[0]
    return shape[0] * type_.row_bytes(shape[1])


def pack_bytes(config: ModelConfig, optional: frozenset[str], quant: dict[str, str], align: int = 4096) -> tuple[int, int]:
    """(dense.bin, experts.bin) bytes of the pack the converter writes for ``config`` with the
    ``optional`` tensors (biases, sinks ...: Architecture.optional_tensors, or a manifest's)."""
    dense = 0
    for name in ARCHITECTURES[config.architecture].dense_tensor_names(config, optional):
        shape = expected_dense_shape(name, config)
        dense = _round_up(dense, align) + _tensor_bytes(requested_type(name, len(shape), quant), shape)
    from colibrid import native

    experts_type = native.TensorType.from_name(quant["experts"])
    shapes = expected_expert_shapes(config, optional)
    cursor = 0
    for part in expert_part_names(optional):  # the matrices, then their biases (f32) if the model has them
        cursor = _round_up(cursor + _tensor_bytes(expert_part_type(experts_type, shapes[part]), shapes[part]),
                           EXPERT_PART_ALIGN_BYTES)
    record = _round_up(cursor, align)
    return dense, record * config.num_experts * len(config.moe_layer_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--quant", action="append", default=None,
                        help="a colibri-convert --quant SPEC; repeat for several (default: the default, q8_0, bf16)")
    parser.add_argument("--align", type=int, default=4096)
    args = parser.parse_args(argv)
    hf = json.loads(Path(args.config).read_text())
    hf = text_model_config(hf, lambda t: any(t in a.hf_model_types for a in ARCHITECTURES.values())).config
    arch = architecture_for(hf)
    config, optional = arch.model_config(hf), arch.optional_tensors(hf)
    total, active = parameter_counts(config, optional)
    print(f"{config.architecture}: {total / 1e9:.1f} B parameters, {active / 1e9:.1f} B active per token")
    for spec in args.quant or [None, "q8_0", "bf16"]:
        quant = parse_quant(spec).to_json()
        dense, experts = pack_bytes(config, optional, quant, args.align)
        label = ",".join(f"{k}={v}" for k, v in quant.items())
        print(f"{label:50s} dense {dense / 1e9:6.1f} GB  experts {experts / 1e9:7.1f} GB  total {(dense + experts) / 1e9:7.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

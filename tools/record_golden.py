"""Record the default model's golden continuations (golden.json beside the checkpoint).

    python tools/record_golden.py models/colibri-olmoe-stdlib

Run once, right after training, and again only when the model itself is retrained: the
golden test (tests/models/test_default_model.py) then holds every later change to the
converter and the engine to these exact token ids. Two records per prompt:

- "transformers": the greedy continuation of the checkpoint in transformers (float32 compute
  on the bf16 weights). A bf16 pack holds those weights exactly, so Colibri must reproduce it.
- "default_pack": the greedy continuation of the pack the README's run command builds (the
  converter's default quantization), computed by Colibri when the model was recorded; the
  quantized model is a slightly different function, so it is pinned separately.

Development-only (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# The oracle the architecture tests use (tests/tiny_checkpoints.py): the same transformers
# model in float32 and the same greedy loop.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.tiny_checkpoints import load_reference, reference_greedy  # noqa: E402

GOLDEN_FILE = "golden.json"
GREEDY_TOKENS = 32
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
    'if __name__ == "__main__":\n',
    "    for key, value in sorted(",
]


def default_pack_greedy(checkpoint: Path, prompts: list[str], n_tokens: int) -> list[tuple[list[int], list[int]]]:
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine import load

    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "default.pack"
        convert(checkpoint, pack, parse_quant(None), progress=False)
        engine = load(pack)
        results = []
        for prompt in prompts:
            ids = engine.prompt_ids(prompt, raw=True)
            results.append((ids, engine.greedy(ids, n_tokens)))
        return results


def main(argv: list[str] | None = None) -> int:
    from colibrid.tools.convert.quant_spec import parse_quant

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    args = parser.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    reference = load_reference(checkpoint)
    records = []
    for prompt, (ids, pack_ids) in zip(PROMPTS, default_pack_greedy(checkpoint, PROMPTS, GREEDY_TOKENS)):
        records.append({"prompt": prompt, "prompt_ids": ids,
                        "transformers": reference_greedy(reference, ids, GREEDY_TOKENS),
                        "default_pack": pack_ids})
        agree = sum(a == b for a, b in zip(records[-1]["transformers"], pack_ids))
        print(f"{prompt!r}: default pack agrees with transformers on {agree}/{GREEDY_TOKENS} greedy tokens")
    golden = {"greedy_tokens": GREEDY_TOKENS, "default_quant": parse_quant(None).to_json(), "prompts": records}
    (checkpoint / GOLDEN_FILE).write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {checkpoint / GOLDEN_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do Colibri and llama.cpp compute the same model? Greedy tokens from one pack and the GGUF
bench_kernels.py wrote with the same weights, from the same prompt, side by side.

The GGUF's placeholder vocabulary gives every id one character of its own
(shapes/common.py), so llama-completion reads the prompt as exactly its ids and its output
text maps back to ids. Weights are the same bytes where both sides have the type (q8_0 /
Q8_0, mxfp4 / MXFP4); activations are rounded differently (each side quantizes them its own
way), so on random weights, whose logits are close together, the sequences may part after a
few tokens: the first tokens and Colibri's rank of llama.cpp's token say whether the model is
the same.

    python bench/greedy_agreement.py ~/.cache/colibri-bench/gpt_oss_20b-mxfp4.pack \\
        ~/.cache/colibri-bench/gpt_oss_20b-MXFP4_Q8_0.gguf --llama-completion .../bin/llama-completion
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import ResidentExpertSource  # noqa: E402
from shapes.common import FIRST_TEXT_ID, placeholder_id, placeholder_piece  # noqa: E402


def colibri_greedy(pack_dir: Path, prompt: list[int], n_tokens: int, threads: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy ids and the logits (V) each was chosen from."""
    from colibrid import native
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    native.configure_default_pool(n_threads=threads)
    pack = Pack.open(pack_dir)
    engine = Engine(pack, experts=ResidentExpertSource(pack))
    session = engine.new_session(len(prompt) + n_tokens + 8)
    logits = session.forward(prompt, all_logits=False)[0]
    ids, all_logits = [], []
    for _ in range(n_tokens):
        all_logits.append(np.asarray(logits, dtype=np.float32).copy())
        ids.append(int(np.argmax(logits)))
        logits = session.forward([ids[-1]], all_logits=False)[0]
    return ids, all_logits


def llama_greedy(binary: Path, gguf_path: Path, prompt: list[int], n_tokens: int, threads: int) -> list[int]:
    text = "".join(placeholder_piece(i) for i in prompt)
    # llama-completion's last tokens sometimes never reach stdout before it exits: ask for more
    extra = 8
    cmd = [str(binary), "-m", str(gguf_path), "-p", text, "-n", str(n_tokens + extra), "--temp", "0", "-t", str(threads),
           "-c", str(len(prompt) + n_tokens + extra + 16), "-no-cnv", "--no-display-prompt", "--no-warmup", "--simple-io",
           "--seed", "0", "--ignore-eos"]
    out = subprocess.run(cmd, check=True, capture_output=True).stdout.decode("utf-8", errors="replace")
    return [placeholder_id(ch) for ch in out if ord(ch) >= 0x10000][:n_tokens]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-completion", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from colibrid.pack.reader import Pack

    vocab = Pack.open(args.pack).manifest.model.vocab_size
    prompt = [int(i) for i in np.random.default_rng(0).integers(FIRST_TEXT_ID, vocab, args.prompt_tokens)]
    ours, logits = colibri_greedy(args.pack, prompt, args.tokens, args.threads)
    theirs = llama_greedy(args.llama_completion, args.gguf, prompt, args.tokens, args.threads)
    print(f"prompt    {prompt}")
    print(f"colibri   {ours}")
    print(f"llama.cpp {theirs}")
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    print(f"the first {same} of {args.tokens} tokens agree")
    if same < min(len(ours), len(theirs)):
        step = logits[same]
        rank = int(np.sum(step > step[theirs[same]]))
        print(f"at token {same}: llama.cpp's choice is Colibri's rank {rank} (logit {step[theirs[same]]:.4f} "
              f"vs Colibri's best {step.max():.4f}; logits' std {step.std():.4f})")
    return 0 if same >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())

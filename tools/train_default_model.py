"""Train Colibri's default model: a small OLMoE trained from scratch on the Python
standard library's own sources (a corpus every machine has).

    python tools/train_default_model.py --out models/colibri-olmoe-stdlib --resume
    python tools/train_default_model.py --shape olmoe64 --out models/colibri-olmoe64-stdlib --resume

--shape picks the model's shape and step count (each setting can still be given on its own):
``default``, 16 experts, top-2, 4 layers; ``olmoe64``, OLMoE-1B-7B's routing ratio (64 experts,
top-8, 8 layers, experts 128 wide so 8 of them are 4x the hidden size, as OLMoE's), sized so
training takes about 100 minutes on 2 cores (~900 tokens/s measured: 1,300 steps of 16 x 256
tokens, 5.3M tokens, ~1.8 passes over the corpus).

Development-only: needs torch and transformers (the test extras), never needed to run
Colibri. Deterministic for a given --seed, Python version and file list (both recorded in
training.json next to the checkpoint). Writes a Hugging Face checkpoint: config.json,
model.safetensors (bf16), tokenizer.json, tokenizer_config.json, generation_config.json,
plus training.json (the loss curve, the data description, the command).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
# Test suites are left out: they are large, repetitive and not what users ask about.
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
VALIDATION_EVERY = 20  # one file in 20 (chosen by a hash of its path) is held out

# --shape: what each model is made of, and how long it trains.
SHAPES = {
    "default": {"steps": 4500, "experts": 16, "top_k": 2, "layers": 4, "expert_ffn": 256},
    "olmoe64": {"steps": 1300, "experts": 64, "top_k": 8, "layers": 8, "expert_ffn": 128},
}
# Why each shape is the size it is (the model card quotes it).
SHAPE_REASONS = {
    "default": "the largest OLMoE that trains in about 90 minutes on the 2 cores of the machines Colibri is "
               "built on (~3,800 tokens/s at hidden 256, 4 layers, 16 experts of 256, top-2, context 256); "
               "16 experts in 4 layers give a cache something to choose from",
    "olmoe64": "OLMoE-1B-7B's routing ratio (64 experts, top-8, 8 of them 4x the hidden size) at the depth "
               "that trains in about 100 minutes on 2 cores (~900 tokens/s): enough choices per layer to "
               "tell expert-cache policies apart on real routing",
}


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not EXCLUDED_PARTS & set(p.relative_to(root).parts)]
    return root, files


def is_validation(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % VALIDATION_EVERY == 0


def describe_corpus(root: Path, files: list[Path]) -> dict:
    listing = "\n".join(str(p.relative_to(root)) for p in files)
    return {
        "source": "the Python standard library's .py sources, test suites excluded",
        "python_version": platform.python_version(),
        "files": len(files),
        "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "license": "Python Software Foundation License Version 2 (the sources' own license)",
    }


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_split(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tok.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def model_config(args, vocab_size: int, eos_id: int):
    import transformers

    return transformers.OlmoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.expert_ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=args.context * 4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, norm_topk_prob=False,
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None, tie_word_embeddings=False,
        router_aux_loss_coef=0.01, output_router_logits=True,
    )


def batches(data: np.ndarray, batch: int, context: int, rng: np.random.Generator):
    import torch

    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        window = np.stack([data[s : s + context + 1] for s in starts])
        yield torch.from_numpy(window)


def evaluate(model, data: np.ndarray, context: int, max_windows: int = 64) -> float:
    """Mean next-token loss over consecutive validation windows."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, min(len(data) - context - 1, max_windows * context), context):
            window = torch.from_numpy(data[start : start + context + 1])[None]
            losses.append(float(model(input_ids=window[:, :-1], labels=window[:, :-1]).loss))
    model.train()
    return float(np.mean(losses))


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args) -> None:
    import torch
    import transformers

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    root, files = stdlib_files()
    texts = {str(p.relative_to(root)): p.read_text(encoding="utf-8", errors="replace") for p in files}
    train_texts = [t for name, t in texts.items() if not is_validation(name)]
    val_texts = [t for name, t in texts.items() if is_validation(name)]
    tok = train_tokenizer(train_texts, args.vocab)
    train_ids, val_ids = encode_split(tok, train_texts), encode_split(tok, val_texts)
    eos_id = tok.token_to_id(EOS)
    print(f"corpus: {len(train_texts)} train files ({len(train_ids)} tokens), "
          f"{len(val_texts)} validation files ({len(val_ids)} tokens), vocab {tok.get_vocab_size()}", flush=True)

    config = model_config(args, tok.get_vocab_size(), eos_id)
    # The eager expert loop is the fastest of transformers' expert implementations on CPU here.
    model = transformers.OlmoeForCausalLM._from_config(config, experts_implementation="eager")
    total = sum(p.numel() for p in model.parameters())
    print(f"model: {total / 1e6:.1f}M parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    data = batches(train_ids, args.batch, args.context, rng)
    state_path = Path(args.out) / "train_state.pt"
    first_step, curve, spent_s = 0, [], 0.0
    if args.resume and state_path.exists():
        first_step, curve, spent_s = resume(state_path, model, optimizer, rng)
        print(f"resumed at step {first_step}", flush=True)
    started = time.monotonic() - spent_s
    model.train()
    for step in range(first_step, args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        window = next(data)
        loss = model(input_ids=window[:, :-1], labels=window[:, :-1]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.monotonic() - started
            point = {"step": step, "train_loss": round(loss.item(), 4), "elapsed_s": round(elapsed, 1),
                     "tokens_per_s": round((step + 1) * args.batch * args.context / elapsed)}
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps - 1:
                point["val_loss"] = round(evaluate(model, val_ids, args.context), 4)
            curve.append(point)
            print(json.dumps(point), flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint_state(state_path, model, optimizer, rng, step + 1, curve, time.monotonic() - started)
    save(args, model, tok, curve, describe_corpus(root, files), len(train_ids), len(val_ids))


def checkpoint_state(path: Path, model, optimizer, rng: np.random.Generator, next_step: int, curve: list,
                     spent_s: float) -> None:
    """Everything needed to continue bit-for-bit where training stopped (--resume)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "next_step": next_step,
                "numpy_rng": rng.bit_generator.state, "curve": curve, "spent_s": spent_s}, tmp)
    tmp.replace(path)


def resume(path: Path, model, optimizer, rng: np.random.Generator) -> tuple[int, list, float]:
    import torch

    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["numpy_rng"]
    return state["next_step"], state["curve"], state["spent_s"]


def generation_config(eos_id: int) -> dict:
    """What transformers' generate() and Colibri use when a request names no sampling
    settings: a small model writes more coherent code a little below temperature 1."""
    return {"eos_token_id": eos_id, "do_sample": True, "temperature": 0.7, "top_p": 0.95}


def save(args, model, tok, curve, corpus: dict, train_tokens: int, val_tokens: int) -> None:
    import torch
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    # Shards under 50 MB: no single file in the repository grows past what git hosts accept.
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="50MB")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(generation_config(tok.token_to_id(EOS)), indent=1) + "\n")
    record = {"command": "python " + " ".join(sys.argv), "arguments": vars(args), "corpus": corpus,
              "train_tokens": train_tokens, "validation_tokens": val_tokens, "curve": curve}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "train_state.pt").unlink(missing_ok=True)
    print(f"wrote {out}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default",
                        help="the model's shape and step count (see above); explicit flags override it")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-ffn", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="steps between loss lines (>= 1)")
    parser.add_argument("--eval-every", type=int, default=500, help="steps between validation losses (0: at the end only)")
    parser.add_argument("--save-every", type=int, default=250, help="steps between resumable states (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt if present")
    args = parser.parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix reuse through the daemon: a chat whose every turn resends the conversation so far
prefills only what is new, answers exactly as a daemon without prefix reuse does, and says
how many prompt tokens it reused; status shows the prefix cache."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from colibrid.engine.prefix_cache import BLOCK_TOKENS, common_prefix_length
from tests.daemon.wire import WireClient

QUESTIONS = ("Tell me about the quick brown fox and the lazy dog, please.", "And the dog?", "Why?")


def _chat(socket_path, system, questions=QUESTIONS, **sampling):
    """Three turns, each carrying the earlier ones: (messages sent, tokens, done) per turn."""
    messages, turns = [], []
    with WireClient(socket_path) as client:
        client.hello()
        for n, question in enumerate(questions):
            messages = messages + [{"role": "user", "content": question}]
            client.send({"op": "ask", "id": n, "messages": messages, "system": system, "max_tokens": 8,
                         "ignore_eos": True, **sampling})
            tokens, done = client.collect(n)
            assert done["event"] == "done", done
            turns.append((messages, [t for event in tokens for t in event["token_ids"]], done))
            messages = messages + [{"role": "assistant", "content": done["text"]}]
    return turns


def _status(socket_path) -> dict:
    with WireClient(socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        return client.recv()


def test_a_chat_reuses_each_turn_s_prefix_and_answers_as_without_reuse(start_daemon, demo_pack):
    from colibrid.engine import load

    with_reuse = start_daemon("--prefix-cache-size", "64M")
    without = start_daemon("--prefix-cache-size", "0", socket_name="without.sock")
    for system, sampling in (("Be brief.", dict(temperature=0)), ("Be kind.", dict(temperature=0.8, seed=3))):
        reused = _chat(with_reuse.socket_path, system, **sampling)
        fresh = _chat(without.socket_path, system, **sampling)
        assert [(t[1], t[2]["text"]) for t in reused] == [(t[1], t[2]["text"]) for t in fresh]
        assert [t[2]["usage"]["cached_prompt_tokens"] for t in fresh] == [0, 0, 0]

        # What the daemon held after each turn: that turn's prompt and the answer's tokens but the last.
        engine = load(demo_pack)
        prompts = [engine.prompt_ids(messages=messages, system=system) for messages, _, _ in reused]
        held = [prompt + answer[:-1] for prompt, (_, answer, _) in zip(prompts, reused)]
        expected = [0] + [common_prefix_length(np.array(before), np.array(prompt))
                          for before, prompt in zip(held, prompts[1:])]
        expected = [n if n >= BLOCK_TOKENS else 0 for n in expected]
        assert [t[2]["usage"]["cached_prompt_tokens"] for t in reused] == expected
        assert expected[1] >= len(prompts[0]) and expected[2] >= len(prompts[1])  # each previous prompt at least
        if sampling["temperature"] == 0:  # and these answers' tokens are what their text tokenizes to again
            assert expected[1] > len(prompts[0]) and expected[2] > len(prompts[1])
        assert [t[2]["usage"]["prompt_tokens"] for t in reused] == [len(p) for p in prompts]

    status = _status(with_reuse.socket_path)["prefix_cache"]
    assert status["budget_bytes"] == 64 << 20 and 0 < status["used_bytes"] <= status["budget_bytes"]
    assert status["hits"] >= 4 and status["tokens_reused"] > 0 and status["entries"] >= 1
    assert status["lookups"] == 6 and status["kept"] == 6
    off = _status(without.socket_path)["prefix_cache"]
    assert off["budget_bytes"] == 0 and off["entries"] == 0 and off["lookups"] == 0


def test_prefix_cache_size_must_be_a_size(demo_pack, socket_dir):
    result = subprocess.run([sys.executable, "-m", "colibrid", "--model", str(demo_pack), "--socket",
                             str(socket_dir / "x.sock"), "--prefix-cache-size", "lots"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "prefix_cache_size" in result.stderr and "0 for off" in result.stderr

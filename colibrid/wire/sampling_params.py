"""SamplingParams: how a request picks tokens and when it stops - a value, valid by construction.

It lives outside the engine because two sides share it: the wire protocol builds one from an
ask (colibrid/wire/requests.py, which imports nothing from the engine) and the engine's sampler
and generation loop read it. Building one checks every field (ValueError naming the first bad
one), and it is frozen, so a SamplingParams that exists is valid: nothing downstream checks it
again. Values from clients are checked once, where they enter - the protocol's parse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from colibrid.wire.values import is_int, is_number

# A temperature below this samples as greedy (argmax). Dividing logits by a tiny temperature
# overflows (1e-310 is a denormal: every score becomes +-inf and softmax NaN, garbage tokens);
# long before that, softmax(scores / T) puts all its mass on the best token anyway. vLLM uses
# the same threshold.
GREEDY_TEMPERATURE_BELOW = 1e-5
# OpenAI and vLLM cap alternatives per token at 20; more is rarely useful and costs a sort.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults mean: plain sampling at temperature 1.

    ValueError at construction for any value out of range; ``stop`` is kept as a tuple, so
    the stop strings cannot change after they were checked either.
    """

    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already in prompt or output
    seed: int | None = None  # None = a fresh, unpredictable seed
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # any sequence of strings is accepted and kept as a tuple
    logprobs: int | None = None  # None = no alternatives; n = the n most likely tokens per step
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens the model writes (EOS aside) appear in the text

    def __post_init__(self) -> None:
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        self._check()

    def _check(self) -> None:
        """Raise ValueError naming the first field that is out of range and what it accepts.
        Construction runs it; a SamplingParams that exists has passed it."""
        _check_real("temperature", self.temperature, "a number >= 0 (0 = greedy)", lambda v: v >= 0)
        _check_int("top_k", self.top_k, "an integer >= 0 (0 = off)", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "a number in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        _check_real("min_p", self.min_p, "a number in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        _check_real("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)", lambda v: v > 0)
        if self.seed is not None:
            _check_int("seed", self.seed, "null or an integer >= 0", lambda v: v >= 0)
        _check_int("max_tokens", self.max_tokens, "an integer >= 1", lambda v: v >= 1)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.logprobs is not None:
            allowed = f"null or an integer in [0, {MAX_TOP_LOGPROBS}]"
            _check_int("logprobs", self.logprobs, allowed, lambda v: 0 <= v <= MAX_TOP_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be true or false, got {self.skip_special_tokens!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_BELOW


def _check_real(name: str, value: object, allowed: str, in_range) -> None:
    ok = is_number(value) and math.isfinite(value) and in_range(value)
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value: object, allowed: str, in_range) -> None:
    if not (is_int(value) and in_range(value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

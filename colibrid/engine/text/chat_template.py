"""The chat template sandbox: transformers' rendering environment, bounded in size and time.

A chat template is code from the pack, and a pack may come from anyone. jinja2's immutable
sandbox already keeps it away from Python's internals; this module also keeps it from
exhausting the daemon, which the sandbox does not try to do: `{{ 'a' * 10**7 }}` renders a
10 MB prompt that then takes the tokenizer a minute and gigabytes, and two nested loops over
`range(100000)` never end. So every render runs under a RenderBudget:

  - size: no string or list the template builds, and not the prompt it writes, may exceed
    `max_chars` (the conversation's own characters plus TEMPLATE_ALLOWANCE_CHARS). Every
    operation that can multiply a size (`*`, `**`, `%`, `+`, `~`, the str methods and filters
    that take a width or a count, `lipsum`) is checked BEFORE it runs, so the big value is
    never built; every filter's and call's result is checked after, and the output is counted
    as it streams, so rendering stops at the first piece past the limit.
  - time: a render may run for RENDER_TIME_LIMIT_S; a trace function on the template's own
    frames (jinja compiles templates to Python) checks the clock at every line.

A template over budget raises ChatTemplateError, which the daemon answers with an `engine`
error for that request only (the model's template is at fault, not the client).
"""

from __future__ import annotations

import functools
import json
import re
import string
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older jinja2 releases have known sandbox escapes; chat templates are untrusted code from the Hub.
MIN_JINJA2_VERSION = (3, 1, 6)

# What a template may add to the conversation's own text: special tokens, role headers, a
# default system prompt, tool descriptions. A quarter of a million characters tokenizes in
# about a third of a second; templates in the wild add a few thousand.
TEMPLATE_ALLOWANCE_CHARS = 256 * 1024
# Rendering takes milliseconds; a template still running after this is looping on purpose.
RENDER_TIME_LIMIT_S = 1.0
# Integers a template computes (x * y, x ** y) stay below this many bits; Python's big
# integers would otherwise let `10 ** 10 ** 9` run for hours.
MAX_INT_BITS = 1 << 16

TEMPLATE_FILENAME = "<template>"  # the file name jinja compiles templates under (from_string)


class ChatTemplateError(Exception):
    """The chat template went over its budget or failed; str() says how, for the client and the log."""


@dataclass(frozen=True)
class RenderBudget:
    max_chars: int  # longest string (or list) the template may build, and the longest prompt it may write
    deadline_s: float  # time.monotonic() by which rendering must end


# The budget of the render running in this thread (renders do not nest).
_budget: ContextVar[RenderBudget | None] = ContextVar("chat_template_budget", default=None)


def _limit() -> int:
    budget = _budget.get()
    return sys.maxsize if budget is None else budget.max_chars


def _check_size(size: int, what: str) -> None:
    limit = _limit()
    if size > limit:
        raise ChatTemplateError(f"this model's chat template tried to build {what} of {size} items or characters, "
                                f"above its limit of {limit} for this conversation")


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateError(f"this model's chat template tried to compute a {bits}-bit integer "
                                f"(limit {MAX_INT_BITS} bits)")


def _is_sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple, dict))


def _deep_size(value: Any, seen: dict[int, int] | None = None) -> int:
    """About how many characters str(value) takes, counting a list shared by reference once per
    reference: `[x] * 100000` is small, but printing it prints x 100000 times. Memoised by id,
    so it costs one visit per distinct object; strings and numbers inside are counted inline
    (no call per element: the render's trace function sees every Python call)."""
    if not isinstance(value, (list, tuple, dict)):
        return _scalar_size(value)
    seen = {} if seen is None else seen
    if id(value) not in seen:
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = len(items)
        for item in items:
            if type(item) is str:
                total += len(item)
            elif type(item) is int:
                total += item.bit_length() // 3 + 1
            elif isinstance(item, (list, tuple, dict)):
                total += _deep_size(item, seen)
            else:
                total += _scalar_size(item)
        seen[id(value)] = total
    return seen[id(value)]


def _scalar_size(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 1  # decimal digits, about
    return 1


def _check_result(value: Any, what: str) -> Any:
    if _is_sized(value):
        _check_size(_deep_size(value), what)
    return value


# --------------------------------------------------------------------------------------------
# Checks before the operations that multiply sizes
# --------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_multiply(left: Any, right: Any) -> None:
    if _is_int(left) and _is_int(right):
        _check_int_bits(left.bit_length() + right.bit_length())
    elif _is_sized(left) and _is_int(right):
        _check_size(_deep_size(left) * max(right, 0), "a repeated string or list")
    elif _is_int(left) and _is_sized(right):
        _check_size(_deep_size(right) * max(left, 0), "a repeated string or list")


def _check_power(base: Any, exponent: Any) -> None:
    if _is_int(base) and _is_int(exponent) and exponent > 0:
        _check_int_bits(max(base.bit_length(), 1) * exponent)


def _check_add(left: Any, right: Any) -> None:
    if _is_sized(left) and _is_sized(right):
        _check_size(_deep_size(left) + _deep_size(right), "a concatenation")


# %-formatting: "%-999999999s" pads to any width; so do "{:>999999999}" and `center(10**9)`.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
_NUMBER = re.compile(r"\d+")


def _int_arguments(values: Iterable[Any]) -> list[int]:
    return [value for value in values if _is_int(value)]


def _check_padding(padding: int, text_len: int, width_arguments: list[int]) -> None:
    _check_size(text_len + padding + sum(max(width, 0) for width in width_arguments), "a formatted string")


def _check_percent_format(text: Any, arguments: Any) -> None:
    if not isinstance(text, str):
        return
    widths = [int(n) for spec in _PERCENT_SPEC.finditer(text) for n in spec.groups() if n and n != "*"]
    # "%*d": the width is an argument; counting every integer argument as one over-estimates, safely.
    values = arguments if isinstance(arguments, tuple) else (arguments,)
    _check_padding(sum(widths), len(text), _int_arguments(values) if "*" in text else [])


def _check_str_format(text: str, args: tuple, kwargs: dict[str, Any]) -> None:
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(text) if spec]
    except ValueError:
        return  # malformed: format() raises on its own
    widths = [int(n) for spec in specs for n in _NUMBER.findall(spec)]
    nested = any("{" in spec for spec in specs)  # "{:{w}}": the width is an argument
    _check_padding(sum(widths), len(text), _int_arguments([*args, *kwargs.values()]) if nested else [])


def _check_replace(text: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        occurrences = text.count(old) if old else len(text) + 1
        if _is_int(count) and count >= 0:
            occurrences = min(occurrences, count)
        _check_size(len(text) + occurrences * len(new), "a replaced string")


def _check_join(separator: Any, items: Any) -> None:
    if isinstance(separator, str) and isinstance(items, (list, tuple)):
        pieces = sum(len(item) for item in items if isinstance(item, str))
        _check_size(pieces + len(separator) * max(len(items) - 1, 0), "a joined string")


def _check_width(text: Any, width: Any) -> None:
    if _is_int(width) and isinstance(text, str):
        _check_size(max(width, len(text)), "a padded string")


def _check_str_method(method: Callable, args: tuple, kwargs: dict[str, Any]) -> None:
    """Checks for the str methods whose result can be far larger than their inputs."""
    text, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill"):
        _check_width(text, args[0] if args else kwargs.get("width"))
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if _is_int(tabsize):
            _check_size(len(text) + text.count("\t") * max(tabsize, 0), "a string with expanded tabs")
    elif name == "replace":
        _check_replace(text, *args[:3])
    elif name == "join" and args:
        _check_join(text, list(args[0]) if not isinstance(args[0], (list, tuple, str)) else args[0])


# --------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------


def _bounded_filter(name: str, function: Callable, check: Callable[..., None] | None) -> Callable:
    """`function` with `check(*args, **kwargs)` before and a size check of its result after."""

    @functools.wraps(function)  # keeps jinja's pass_context/pass_eval_ctx marker (in __dict__)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if check is not None:
            check(*args, **kwargs)
        return _check_result(function(*args, **kwargs), f"the result of the `{name}` filter")

    return bounded


def _filter_checks() -> dict[str, Callable[..., None]]:
    """Per filter, the check of its arguments (after jinja's own context argument, if any)."""

    def width(value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
        _check_width(str(value), width)

    def indent(value: Any, width: Any = 4, *_: Any, **__: Any) -> None:
        text = str(value)
        per_line = width if _is_int(width) else len(str(width))
        _check_size(len(text) + (text.count("\n") + 1) * max(per_line, 0), "an indented string")

    def replace(_eval_ctx: Any, value: Any, old: Any, new: Any, count: Any = None) -> None:
        _check_replace(str(value), str(old), str(new), -1 if count is None else count)

    def format_(value: Any, *args: Any, **kwargs: Any) -> None:
        _check_percent_format(str(value), tuple(args) or tuple(kwargs.values()))

    def join(_eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> None:
        items = [str(item) for item in value] if isinstance(value, (list, tuple)) else []
        _check_join(str(d), items)

    def count(value: Any, count: Any, *_: Any, **__: Any) -> None:
        if _is_int(count):
            _check_size(count, "a list of batches or slices")

    def tojson(value: Any, ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> None:
        if _is_int(indent):  # written once per nested line: bounded by the value's size times this
            _check_size(_deep_size(value) * (max(indent, 0) + 1), "indented JSON")

    def wordwrap(_environment: Any, value: Any, width: Any = 79, break_long_words: Any = True,
                 wrapstring: Any = None, *_: Any, **__: Any) -> None:
        text = str(value)  # at most one wrapstring per character
        _check_size(len(text) * (1 + len(str(wrapstring or "\n"))), "a wrapped string")

    def sum_(_environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> None:
        if _is_sized(start) and isinstance(iterable, (list, tuple)):
            seen: dict[int, int] = {}
            _check_size(_deep_size(start, seen) + sum(_deep_size(item, seen) for item in iterable), "a sum of lists")

    return {"center": width, "indent": indent, "replace": replace, "format": format_, "join": join,
            "batch": count, "slice": count, "tojson": tojson, "wordwrap": wordwrap, "sum": sum_}


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders its body unchanged.

    transformers uses the tag to find assistant tokens for training masks; templates that
    contain it must still compile here, and the tag adds no text.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict` for templates: constructing and fromkeys only, so no attribute access escapes the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` for templates, refusing underscore names that could reach CPython internals."""

    # No named `self`: jinja's signature trick, so that namespace(self=...) still works.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &, '), which changes the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    if _is_int(n) and _is_int(max):
        _check_size(n * max * 16, "lorem ipsum text")
    return _check_result(jinja2.utils.generate_lorem_ipsum(n, html, min, max), "lorem ipsum text")


def _bounded_str_join(seq: Iterable[Any]) -> str:
    """`a ~ b`: the pieces' total length is checked before they are joined."""
    pieces = [str(piece) for piece in seq]
    _check_size(sum(map(len, pieces)), "a `~` concatenation")
    return "".join(pieces)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with every size-multiplying operation checked first."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    _BINOP_CHECKS = {"*": _check_multiply, "**": _check_power, "+": _check_add, "%": _check_percent_format}

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        checks = _filter_checks()
        self.filters = {name: _bounded_filter(name, function, checks.get(name))
                        for name, function in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace
        self.globals["lipsum"] = _bounded_lipsum

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self._BINOP_CHECKS[operator](left, right)
        return _check_result(super().call_binop(context, operator, left, right), f"the result of `{operator}`")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(getattr(__obj, "__self__", None), str) and hasattr(__obj, "__name__"):
            _check_str_method(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_result(result, f"the result of {getattr(__obj, '__name__', 'a call')}()")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        text = value.__self__

        @functools.wraps(sandboxed)
        def bounded(*args: Any, **kwargs: Any) -> str:
            _check_str_format(text, args, kwargs)
            return sandboxed(*args, **kwargs)

        return bounded

    def from_string(self, source: Any, globals: Any = None, template_class: Any = None) -> jinja2.Template:
        template = super().from_string(source, globals, template_class)
        # `~` compiles to a call of jinja2.runtime's str_join (markup_join under autoescape),
        # imported into the template's own module namespace; bound it there.
        namespace = template.root_render_func.__globals__
        namespace["str_join"] = namespace["markup_join"] = _bounded_str_join
        return template


def _check_jinja2_version() -> None:
    parts = []
    for part in jinja2.__version__.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_JINJA2_VERSION:
        wanted = ".".join(map(str, MIN_JINJA2_VERSION))
        raise RuntimeError(f"chat templates need jinja2>={wanted} (sandbox fixes); installed {jinja2.__version__}")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders chat templates in (bounded)."""
    _check_jinja2_version()
    return BoundedSandbox().from_string(source)


# --------------------------------------------------------------------------------------------
# Rendering under a budget
# --------------------------------------------------------------------------------------------


def render_bounded(template: jinja2.Template, max_chars: int, variables: dict[str, Any],
                   time_limit_s: float | None = None) -> str:
    """The template's text for `variables`; ChatTemplateError past max_chars or time_limit_s
    (default RENDER_TIME_LIMIT_S).

    Output is consumed as it is generated, so a template writing too much stops at the first
    piece past the limit. jinja2's TemplateError (raise_exception, sandbox refusals) passes through.
    The trace function replaces a debugger's or coverage's for the few milliseconds of a render.
    """
    time_limit_s = RENDER_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    budget = RenderBudget(max_chars, time.monotonic() + time_limit_s)
    token = _budget.set(budget)
    previous_trace = sys.gettrace()
    sys.settrace(_deadline_tracer(budget.deadline_s, time_limit_s))
    try:
        pieces, length = [], 0
        for piece in template.generate(**variables):
            length += len(piece)
            _check_size(length, "a prompt")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        sys.settrace(previous_trace)
        _budget.reset(token)


def _deadline_tracer(deadline_s: float, time_limit_s: float) -> Callable:
    """A sys.settrace function that traces only the template's frames and raises past the deadline."""

    def check_line(frame: Any, event: str, arg: Any) -> Callable | None:
        if event == "line" and time.monotonic() > deadline_s:
            raise ChatTemplateError(f"this model's chat template ran for more than {time_limit_s:g} s; "
                                    "it was stopped")
        return check_line

    def on_call(frame: Any, event: str, arg: Any) -> Callable | None:
        return check_line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    return on_call

"""What every colibrictl command shares: the exit codes, choosing the socket and connecting,
--json, the generation options, and how an unreachable daemon is reported. ask and status
(colibrictl/cli.py), chat and top all build on it; it imports none of them."""

from __future__ import annotations

import argparse
import os
import sys

from colibrictl import __version__
from colibrid.wire.client import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_SOCKET_PATH, Connection
from colibrid.wire.errors import DaemonUnreachable

SOCKET_ENV = "COLIBRI_SOCKET"
CLIENT_NAME = f"colibrictl {__version__}"  # sent in hello, for the daemon's logs

# Exit codes (sysexits.h where one fits), documented in EPILOG.
EXIT_OK = 0
EXIT_REQUEST_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE
EXIT_PROTOCOL = 76  # EX_PROTOCOL
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

START_HINT = "start it with `systemctl start colibrid` or `colibrid --model PACK --socket PATH`"

def add_sampling_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The generation options ask and chat share (sent only when given: sampling_fields);
    returns their group, for a command's own additions."""
    sampling = parser.add_argument_group("generation (omitted: the daemon's defaults)")
    sampling.add_argument("--max-tokens", type=int, metavar="N", help="generate at most N tokens")
    sampling.add_argument("--temperature", type=float, metavar="T", help="0 picks the likeliest")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest")
    sampling.add_argument("--top-p", type=float, metavar="P",
                          help="sample among the likeliest tokens whose probabilities sum to P")
    sampling.add_argument("--min-p", type=float, metavar="P",
                          help="drop tokens less likely than P times the likeliest")
    sampling.add_argument("--repeat-penalty", type=float, metavar="R",
                          help="penalise tokens already seen (the protocol's repetition_penalty)")
    sampling.add_argument("--seed", type=int, metavar="S", help="make sampling reproducible")
    sampling.add_argument("--stop", action="append", metavar="TEXT",
                          help="end the answer at this text (repeatable)")
    return sampling


def socket_path(args: argparse.Namespace) -> str:
    """The one place the socket is chosen: --socket, then the environment, then the default."""
    return getattr(args, "socket", None) or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET_PATH


def connect(args: argparse.Namespace) -> Connection:
    timeout_s = getattr(args, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    return Connection.open(socket_path(args), CLIENT_NAME, timeout_s=timeout_s if timeout_s > 0 else None)


def wants_json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def print_error(message: str) -> None:
    print(f"colibrictl: {message}", file=sys.stderr, flush=True)


def drop_final_newline(text: str) -> str:
    """'class Stack:\n' → 'class Stack:'. echo, a here-string and an editor all end the text
    with a newline nobody means as part of the prompt, and a raw prompt that ends in one is
    continued differently. Only one goes: a blank line the writer added on purpose stays."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


# argparse destination → protocol field, for the generation options (add_sampling_options),
# which are sent only when given.
_SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
}


def sampling_fields(args: argparse.Namespace) -> dict:
    """The generation fields of an ask; options left out are not sent, so the daemon's
    defaults (documented in one place, the daemon's config) apply."""
    return {field: getattr(args, option) for option, field in _SAMPLING_FIELDS.items()
            if getattr(args, option) is not None}


def report_unreachable(error: DaemonUnreachable) -> None:
    print_error(str(error))
    if isinstance(error.__cause__, PermissionError):
        print_error("ask for access to that socket (its group), or use another with --socket")
    else:
        print_error(f"is colibrid running? {START_HINT}; "
               f"or point --socket / ${SOCKET_ENV} at a running daemon")

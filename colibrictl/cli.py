"""The ``colibrictl`` command: ask, chat (colibrictl/chat.py), status, models.

The command is a pipe citizen: the answer (and nothing else) goes to stdout, streamed and
flushed per token; diagnostics go to stderr; the exit code says what happened (see EPILOG).
When the reader of stdout goes away (``| head``) or the user presses Ctrl-C, the open request
is cancelled on the daemon, so an abandoned question stops costing disk and CPU at once.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from typing import Any

from colibrictl import __version__, display
from colibrictl import chat as chat_command
from colibrictl.command import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROTOCOL,
    EXIT_REQUEST_ERROR,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    SOCKET_ENV,
    add_sampling_options,
    connect,
    drop_final_newline,
    print_error,
    report_unreachable,
    sampling_fields,
    wants_json,
)
from colibrictl import verify as verify_command
from colibrictl.top import add_top_parser
from colibrid.wire.client import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_SOCKET_PATH, Connection
from colibrid.wire.errors import ClientError, DaemonUnreachable, ProtocolViolation, RequestError
from colibrid.wire.events import DoneEvent, ErrorEvent, TokenEvent
from colibrid.wire.requests import AskFields

EPILOG = f"""\
socket:
  --socket PATH, else ${SOCKET_ENV}, else {DEFAULT_SOCKET_PATH}.

ask:
  The prompt is the words after `ask`; with none it is read from stdin, so
  `cat notes.txt | colibrictl ask --system "Summarize this"` works. One final
  newline of stdin is dropped: `echo "class Stack:" | colibrictl ask --raw` asks
  what `colibrictl ask --raw "class Stack:"` asks. --stdin-verbatim sends stdin's
  exact bytes.
  The answer is written to stdout as it is generated (flushed per token;
  --no-stream: once, at the end). Always, on a terminal or not, it
  ends with a newline unless it is empty or already ends with one -- also
  when an error or Ctrl-C cuts it short.
  --json writes one JSON object per event per line: token events (token_ids, text;
  with --logprobs N also logprob and top_logprobs), then the done event
  (finish_reason, text, usage), or an error event. After Ctrl-C the last line is
  {{"event": "cancelled", "id", "text", "generated_tokens"}}: what was received
  before the interrupt. So the last line tells a complete answer (done) from a
  failed (error) or a cut-off (cancelled) one.
  --debug-routing (with --json) adds `routing` to each token event: the step,
  the MoE layers, and per layer the experts (best first) and their weights
  chosen for the position the token was sampled from (the last prompt token
  for the first one). Prompt positions before the last are not reported.

top:
  A live view like htop (q quits); `colibrictl top --help` describes the
  screen. --once prints one snapshot, --json one JSON object per interval.

verify:
  The daemon checks its whole pack at idle I/O priority; `colibrictl verify
  --help` says more. Exit 65 when damage is found.

chat:
  A conversation: every turn sends the earlier ones. On a terminal, with line
  editing and history, a tok/s status line after each answer (stderr), the
  commands /system TEXT, /reset, /save FILE, /load FILE, /help, /exit, and
  Ctrl-C to stop an answer without leaving. Otherwise one turn per line of
  stdin, one answer per turn on stdout. `colibrictl chat --help` says more.

exit status:
  0    ok (also when stdout was closed early, e.g. `| head`; the request is cancelled)
  1    the daemon refused or failed the request: "colibrictl: error [code]: message"
  2    usage error (bad option, empty prompt)
  69   daemon not reachable (EX_UNAVAILABLE), or it did not accept and answer
       hello within --connect-timeout; the message names the socket tried and
       how to start the daemon
  76   the daemon broke the protocol (EX_PROTOCOL)
  130  interrupted by Ctrl-C; the open request is cancelled first
"""


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _common_options() -> argparse.ArgumentParser:
    """Options accepted both before and after the command (`colibrictl --json status` and
    `colibrictl status --json`). SUPPRESS keeps a subcommand's absent option from
    overwriting the value given before the command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket", metavar="PATH", default=argparse.SUPPRESS,
        help=f"daemon socket (default: ${SOCKET_ENV} or {DEFAULT_SOCKET_PATH})",
    )
    common.add_argument(
        "--connect-timeout", type=float, metavar="SECONDS", default=argparse.SUPPRESS,
        help=f"give up (exit 69) if the daemon has not accepted and answered hello within SECONDS "
             f"(default {DEFAULT_CONNECT_TIMEOUT_S:g}; 0: wait forever); the request itself has no limit",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS,
        help="machine-readable output: JSON, one object per line",
    )
    return common


def _add_ask_options(ask: argparse.ArgumentParser) -> None:
    ask.add_argument("prompt", nargs="*", help="the prompt (default: read from stdin)")
    ask.add_argument("--system", metavar="TEXT", help="system prompt")
    ask.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    ask.add_argument("--stdin-verbatim", action="store_true",
                     help="send stdin's exact bytes as the prompt, its final newline included")
    ask.add_argument("--no-stream", dest="stream", action="store_false",
                     help="print the answer once, when it is complete "
                          "(with --json: only the done event)")
    sampling = add_sampling_options(ask)
    sampling.add_argument("--logprobs", type=int, metavar="N",
                          help="report the top N alternatives per token (shown with --json)")
    ask.add_argument("--debug-routing", action="store_true",
                     help="with --json: each token event carries `routing`, the experts (and their weights) "
                          "each MoE layer chose for the position the token was sampled from")


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = argparse.ArgumentParser(
        prog="colibrictl",
        description="Talk to colibrid, the Colibri Mixture-of-Experts daemon.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"colibrictl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ask = commands.add_parser("ask", parents=[common], help="ask the model; stream the answer",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_ask_options(ask)
    ask.set_defaults(run=run_ask, parser=ask)
    chat = commands.add_parser("chat", parents=[common], help="hold a conversation with the model",
                               description="Hold a conversation: interactive on a terminal, "
                                           "one turn per line of stdin otherwise.",
                               epilog=chat_command.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--system", metavar="TEXT", help="system prompt (/system changes it)")
    add_sampling_options(chat)
    chat.set_defaults(run=chat_command.run_chat, parser=chat)
    status = commands.add_parser("status", parents=[common], help="the daemon's state")
    status.set_defaults(run=run_status, parser=status)
    models = commands.add_parser("models", parents=[common], help="the models the daemon serves")
    models.set_defaults(run=run_models, parser=models)
    verify_command.add_parser(commands, common, run_verify)
    add_top_parser(commands, common, argparse.RawDescriptionHelpFormatter)
    return parser


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _emit(text: str) -> None:
    """Write to stdout and flush now: a reader sees each token when it is generated."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _emit_json(message: Any) -> None:
    # default=str: a future field msgpack can carry but JSON cannot (bytes) still prints.
    _emit(json.dumps(message, ensure_ascii=False, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# ask
# --------------------------------------------------------------------------------------------


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the command line, or else all of stdin as UTF-8, less one final newline
    unless --stdin-verbatim."""
    if args.prompt:
        prompt = " ".join(args.prompt)
    elif sys.stdin is None:
        args.parser.error("no prompt given and no stdin to read one from")
    else:
        if sys.stdin.isatty():  # otherwise a bare `colibrictl ask` would seem to hang
            print_error("reading the prompt from stdin; end it with Ctrl-D")
        prompt = sys.stdin.buffer.read().decode("utf-8", errors="replace")
        if not args.stdin_verbatim:
            prompt = drop_final_newline(prompt)
    if not prompt.strip():
        args.parser.error("the prompt is empty")
    return prompt


def ask_fields(args: argparse.Namespace, prompt: str) -> AskFields:
    """The ask: the prompt, and the options given (the daemon's defaults fill the rest)."""
    return AskFields(prompt=prompt, system=args.system, raw=args.raw, logprobs=args.logprobs,
                     debug_routing=getattr(args, "debug_routing", False), **sampling_fields(args))


def run_ask(args: argparse.Namespace) -> int:
    if args.debug_routing and not (wants_json(args) and args.stream):
        args.parser.error("--debug-routing shows the routing in the token events: use it with --json "
                          "(and without --no-stream)")
    # The prompt is read before connecting: a usage error needs no daemon, and the daemon
    # does not hold a connection open while someone types.
    fields = ask_fields(args, read_prompt(args))
    with connect(args) as connection:
        request_id = None
        try:
            request_id = connection.ask(fields)
            if wants_json(args):
                _print_events_as_json(connection, request_id, args.stream)
            else:
                _print_answer(connection, request_id, args.stream)
        except (KeyboardInterrupt, BrokenPipeError):
            # Nobody will read the rest: stop the generation before we go (main picks the
            # exit code). The cancel is sent before the connection closes.
            if request_id is not None:
                connection.cancel(request_id)
            raise
    return EXIT_OK


def _print_answer(connection: Connection, request_id: int, stream: bool) -> None:
    shown = ""  # what stdout has received so far
    try:
        for event in connection.events(request_id):
            if isinstance(event, TokenEvent) and stream:
                if event.text:
                    _emit(event.text)
                    shown += event.text
            elif isinstance(event, DoneEvent):
                final = event.text
                if final.startswith(shown) and final != shown:
                    # --no-stream prints it all here; streaming prints a tail it was not sent.
                    _emit(final[len(shown):])
                    shown = final
    except (ClientError, KeyboardInterrupt):
        # Cut short: still end the line, so the error message (or the shell's prompt) starts
        # on a line of its own. A failure to write must not hide the real reason we stop.
        try:
            _end_line(shown)
        except OSError:
            pass
        raise
    _end_line(shown)


def _end_line(shown: str) -> None:
    """The documented rule: a final newline unless the answer is empty or has one."""
    if shown and not shown.endswith("\n"):
        _emit("\n")


def _print_events_as_json(connection: Connection, request_id: int, stream: bool) -> None:
    received: list[str] = []  # the text of every token event, for the cancelled line
    received_tokens = 0
    try:
        for event in connection.events(request_id):
            if isinstance(event, TokenEvent):
                received.append(event.text)
                received_tokens += len(event.token_ids)
            if stream or not isinstance(event, TokenEvent):
                _emit_json(event.to_wire())
    except RequestError as error:
        # A machine reading stdout learns of the failure in the same format as the rest.
        _emit_json(ErrorEvent(error.request_id, error.code, error.message).to_wire())
        raise
    except KeyboardInterrupt:
        # Without a last line of its own, an answer cut by Ctrl-C would look like one whose
        # done line is still to come. A failure to write must not hide the interrupt.
        try:
            _emit_json({"event": "cancelled", "id": request_id, "text": "".join(received),
                        "generated_tokens": received_tokens})
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------------------------
# status, models
# --------------------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    with connect(args) as connection:
        status = connection.status()
    if wants_json(args):
        _emit_json(status.to_wire())
    else:
        _emit(display.format_status(status.fields) + "\n")
    return EXIT_OK


def run_models(args: argparse.Namespace) -> int:
    with connect(args) as connection:
        reply = connection.models()
    if wants_json(args):
        _emit_json(reply.to_wire())
        return EXIT_OK
    _emit(display.format_models(reply.models) + "\n")
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    max_mb_per_s = verify_command.max_mb_per_s(args)
    with connect(args) as connection:
        request_id = connection.verify(args.background, max_mb_per_s, args.stop)
        if args.background or args.stop:
            event = next(connection.events(request_id))
            if wants_json(args):
                _emit_json(event.to_wire())
            elif args.stop:
                print_error("the running verify is stopping (if one ran)")
            else:
                print_error("verify started in the background; `colibrictl status` shows its progress")
            return EXIT_OK
        try:
            return verify_command.follow(connection, request_id, wants_json(args), _emit, _emit_json)
        except (KeyboardInterrupt, BrokenPipeError):
            connection.cancel(request_id)  # nobody watches it any more
            raise


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _silence_stdout() -> None:
    """After the reader of stdout is gone: point stdout at /dev/null, so the interpreter's
    final flush does not fail again (the recipe in Python's signal module docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # stdout is not a file descriptor (an embedding caller's stream); nothing to do


def main(argv: list[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):
        # Model text is Unicode; a terminal with a narrower encoding gets '?' rather than a crash.
        sys.stdout.reconfigure(errors="replace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as exit_request:  # argparse: --help (0) and usage errors (2)
        code = exit_request.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_USAGE)
    except DaemonUnreachable as error:
        report_unreachable(error)
        return EXIT_UNAVAILABLE
    except RequestError as error:
        print_error(f"error [{error.code}]: {error.message}")
        return EXIT_REQUEST_ERROR
    except ProtocolViolation as error:
        print_error(f"protocol error: {error} (is that socket really colibrid's?)")
        return EXIT_PROTOCOL
    except ClientError as error:  # a future subclass: still a clean message, never a traceback
        print_error(str(error))
        return EXIT_REQUEST_ERROR
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

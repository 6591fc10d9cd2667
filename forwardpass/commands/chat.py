"""``forwardpass chat``: an interactive conversation using the model's chat template.

The prompt is ``prompt_toolkit``: line editing, history (↑/↓, kept in ``$XDG_STATE_HOME/forwardpass/
chat_history``), Alt-Enter or a trailing ``\\`` for a new line. Replies stream as they are generated;
Ctrl-C stops a reply (the conversation goes on), Ctrl-C at the prompt clears the line, Ctrl-D or ``/bye``
quits. Commands start with ``/`` (``/help`` lists them); ``//text`` sends ``/text`` to the model. With
standard input not a terminal (``echo hi | forwardpass chat``) each line is one message.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Self

from forwardpass.commands._common import (
    add_model_args,
    add_quantization_arg,
    add_sampling_args,
    add_verbose_arg,
)

HELP = """commands:
  /help            this list
  /reset           forget the conversation (keeps the system message)
  /system TEXT     set the system message (no TEXT: remove it) and start over
  /save FILE       write the conversation to FILE as JSON (OpenAI messages)
  /bye             quit (also /exit, /quit, Ctrl-D)
keys: ↑/↓ history, Alt-Enter or a line ending in \\ for a new line, Ctrl-C stops a reply"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat using the model's chat template",
                       description="Chat with a model in the terminal. " + HELP.replace("\n", " "),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_verbose_arg(p)
    add_quantization_arg(p)
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-history", action="store_true", help="do not read or write the input history file")
    p.set_defaults(func=run)


class Conversation:
    """The messages so far and the ``/`` commands that change them."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.turns: list[dict[str, str]] = []

    @property
    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def command(self, line: str) -> str | None:
        """Run a ``/`` command; return what to print, or ``None`` to quit."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        if name in ("bye", "exit", "quit"):
            return None
        if name in ("help", "?"):
            return HELP
        if name in ("reset", "clear"):
            self.turns = []
            return "(conversation cleared)"
        if name == "system":
            self.system, self.turns = rest or None, []
            return "(system message set; conversation cleared)" if rest else "(system message removed)"
        if name == "save":
            if not rest:
                return "usage: /save FILE"
            try:
                Path(rest).expanduser().write_text(
                    json.dumps(self.messages, indent=2, ensure_ascii=False) + "\n")
            except OSError as exc:
                return f"could not save: {exc}"
            return f"(saved {len(self.messages)} messages to {rest})"
        return f"unknown command /{name}; /help lists the commands (//text sends '/text' to the model)"


def _history_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "forwardpass" / "chat_history"


def _make_prompt(use_history: bool):
    """A ``read() -> str`` on prompt_toolkit (raises EOFError on Ctrl-D, KeyboardInterrupt on Ctrl-C)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    history = InMemoryHistory()
    if use_history:
        path = _history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path))
        except OSError:
            pass
    keys = KeyBindings()

    @keys.add("escape", "enter")  # Alt-Enter: a new line in the message
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    @keys.add("enter")
    def _submit_or_continue(event) -> None:
        buf = event.current_buffer
        if buf.document.text_before_cursor.endswith("\\") and buf.document.is_cursor_at_the_end:
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    session: PromptSession = PromptSession(history=history, key_bindings=keys, multiline=True,
                                           prompt_continuation=lambda width, *_: "." * (width - 1) + " ")
    return lambda: session.prompt(">>> ")


def _plain_prompt() -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


class _StopOnCtrlC:
    """While a reply streams, Ctrl-C sets a flag the loop checks between engine steps (so a step is never
    cut in half), instead of raising KeyboardInterrupt."""

    def __init__(self) -> None:
        self.stopped = False

    def __enter__(self) -> Self:
        self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.stopped = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._old)


def run(args: argparse.Namespace) -> int:
    from forwardpass.commands._common import (
        check_oversubscription,
        load_engine,
        sampling_params_from_args,
        stream,
        write,
    )
    from forwardpass.errors import ForwardpassError

    engine = load_engine(args)
    if engine.tokenizer is None:
        raise ForwardpassError("this model has no tokenizer, so chat is not possible")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    read = _make_prompt(not args.no_history) if interactive else _plain_prompt
    chat = Conversation(args.system)
    if interactive:
        print("Chatting with the model. /help for commands, Ctrl-C stops a reply, Ctrl-D or /bye quits.")
    turn = 0
    while True:
        try:
            line = read()
        except KeyboardInterrupt:  # at the prompt: drop the line, like a shell
            continue
        except EOFError:
            if interactive:
                print()
            break
        if not line.strip():
            continue
        if line.startswith("/") and not line.startswith("//"):
            said = chat.command(line.strip())
            if said is None:
                break
            print(said)
            continue
        if line.startswith("//"):
            line = line[1:]
        chat.turns.append({"role": "user", "content": line})
        params = sampling_params_from_args(engine, args)  # a fresh random seed per reply unless --seed
        text = engine.tokenizer.apply_chat_template(chat.messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        reply = ""
        with _StopOnCtrlC() as ctrl_c:
            for delta in stream(engine, ids, params, request_id=f"chat-{turn}", stop=lambda: ctrl_c.stopped):
                reply += delta
                write(delta)
        write("\n[stopped]\n" if ctrl_c.stopped else "\n")
        check_oversubscription(engine)  # once per process: decode far slower than predicted, under load
        chat.turns.append({"role": "assistant", "content": reply})  # what was shown, stopped or not
        turn += 1
    return 0

"""``forwardpass chat`` driven through a pseudo-terminal, as a person at a keyboard would (issue 22):
history with ↑, Ctrl-C stopping a reply (not the session), multi-line input, and the / commands."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.helpers.server import REPO

pexpect = pytest.importorskip("pexpect")
UP = "\x1b[A"
# A new prompt starts by switching bracketed paste on; the redraw of the line just entered does not, so this
# marks "the reply is over, the REPL waits for input".
PROMPT = re.escape("\x1b[?2004h")


@pytest.fixture
def chat(tmp_path):
    def spawn(*flags: str):
        # HOME stays: the compiled decode kernel is cached under it (a fresh HOME would rebuild it, ~30 s)
        env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TERM": "xterm",
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PROMPT_TOOLKIT_NO_CPR": "1",
               "PYTHONPATH": str(REPO)}
        child = pexpect.spawn(sys.executable, ["-m", "forwardpass.cli", "chat", "--temperature", "0", *flags],
                              env=env, encoding="utf-8", timeout=60, dimensions=(40, 200))
        child.expect("/help for commands")
        child.expect(PROMPT)
        return child

    children = []
    yield lambda *f: children.append(spawn(*f)) or children[-1]
    for c in children:
        c.close(force=True)


def _saved(child, path) -> list[dict]:
    child.sendline(f"/save {path}")
    child.expect(r"\(saved \d+ messages")
    child.expect(PROMPT)
    return json.loads(path.read_text())


def test_commands_history_and_multiline(chat, tmp_path):
    c = chat("--max-tokens", "6")
    c.sendline("/help")
    c.expect("/system TEXT")
    c.expect(PROMPT)
    c.sendline("Who is Elizabeth?")
    c.expect(PROMPT)  # the reply streamed, then the prompt is back
    c.send(UP)  # ↑ recalls the last line; Enter sends it again
    c.expect("Who is Elizabeth")
    c.send("\r")
    c.expect(PROMPT)
    c.send("first line\\\r")  # a trailing backslash continues the message on a new line
    c.send("second line\r")
    c.expect(PROMPT)
    msgs = _saved(c, tmp_path / "a.json")
    users = [m["content"] for m in msgs if m["role"] == "user"]
    assert users == ["Who is Elizabeth?", "Who is Elizabeth?", "first line\nsecond line"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3
    assert all(m["content"] for m in msgs if m["role"] == "assistant")

    c.sendline("/system You answer in one word.")
    c.expect("system message set")
    c.expect(PROMPT)
    c.sendline("Hello")
    c.expect(PROMPT)
    msgs = _saved(c, tmp_path / "b.json")
    assert msgs[0] == {"role": "system", "content": "You answer in one word."}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    c.sendline("/reset")
    c.expect("conversation cleared")
    c.expect(PROMPT)
    assert _saved(c, tmp_path / "c.json") == [{"role": "system", "content": "You answer in one word."}]
    c.sendline("")  # an empty line does not quit
    c.expect(PROMPT)
    c.sendline("/nonsense")
    c.expect("unknown command")
    c.expect(PROMPT)
    c.sendline("/bye")
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0


def test_ctrl_c_stops_the_reply_not_the_session(chat, tmp_path):
    c = chat("--max-tokens", "900", "--ignore-eos")
    c.sendline("Tell me a long story about Elizabeth and Darcy.")
    c.expect("Darcy")  # the echo of the line
    # Ctrl-C only once the reply streams: before the prompt has taken the line it just clears the line (as it
    # did on a loaded CI machine a second after the echo). Leaving the prompt switches bracketed paste off;
    # then two letters in a row are reply text (the terminal's escape sequences end in one letter each).
    c.expect(re.escape("\x1b[?2004l"))
    c.expect("[a-z]{2}")
    c.sendintr()  # 900 tokens take seconds: the reply is still streaming
    c.expect(r"\[stopped\]", timeout=20)
    c.expect(PROMPT)
    msgs = _saved(c, tmp_path / "s.json")
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    c.sendintr()  # Ctrl-C at the prompt only clears the line
    c.expect(PROMPT)
    c.sendeof()  # Ctrl-D quits
    c.expect(pexpect.EOF)
    c.close()
    assert c.exitstatus == 0

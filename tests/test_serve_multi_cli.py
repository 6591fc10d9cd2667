"""``forwardpass serve A B ...`` start-up errors: one line, exit code 1, before anything loads. Flags that
name or split one model are refused with several (not guessed), and the several-models flags with one."""

from __future__ import annotations

import pytest

from forwardpass.cli import main

TWO = ["forwardpass-default", "forwardpass-speech"]


@pytest.mark.parametrize("argv,match", [
    ([*TWO, "--served-model-name", "x"], "--served-model-name names one model"),
    ([*TWO, "--lora", "x=/nonexistent"], "--lora adapters belong to one base model"),
    ([*TWO, "--task", "embed"], "each one's task is its kind"),
    ([*TWO, "--data-parallel-size", "2"], "one engine per model"),
    ([*TWO, "--models-max", "0"], "--models-max must be >= 1"),
    ([*TWO, "--models-memory", "-1"], "--models-memory must be a positive number of GB"),
    ([*TWO, "--models-memory", "0.001"], "the default model forwardpass-default needs about"),
    (["forwardpass-default", "forwardpass-default"], "the same name forwardpass-default"),
    (["forwardpass-default", "/nonexistent/model"], "does not exist"),
    (["forwardpass-default", "--models-max", "2"], "--models-max applies to a server of several models"),
    ([*TWO, "--model", "forwardpass-default"], "list every model as a positional argument"),
])  # fmt: skip
def test_startup_errors_are_one_line(capsys, argv, match):
    assert main(["serve", "--port", "0", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err

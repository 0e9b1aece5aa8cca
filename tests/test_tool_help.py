"""Every flag of every tool says what it does in `--help`."""

import os
import re
import subprocess
import sys

import pytest

from tests.tools_util import ROOT

TOOLS = ["train", "sample", "grpo", "serve", "launch_local", "make_tiny_data"]


def _undescribed(help_text: str) -> list[str]:
    """Flags whose help entry holds nothing but the flag, its metavar and its default."""
    entries, current = [], None
    for line in help_text.splitlines():
        body = line.strip().strip("│").rstrip()
        if re.match(r"^\s?-", body):
            current = [body]
            entries.append(current)
        elif current is not None and body.startswith(" ") and body.strip() and not re.match(r"^[─╰╭]", body.strip()):
            current.append(body)
        else:
            current = None
    missing = []
    for entry in entries:
        first = entry[0].strip()
        flag = first.split()[0].rstrip(",")
        if flag in ("-h", "--help"):
            continue
        text = " ".join([first] + entry[1:])
        text = re.sub(r"\(default: [^)]*\)", "", text)
        text = re.sub(r"^\S+(,\s*\S+)*", "", text.strip())  # the flag (and its negation)
        text = re.sub(r"^\s*(\{[^}]*\}(\|[A-Z]+)?|[A-Z][A-Z_ ]*\]?|\[[A-Z ]+\[[A-Z ]+\.\.\.\]\])", "", text.strip())
        if not re.search(r"[a-z]{3}", text):
            missing.append(flag)
    return missing


@pytest.mark.parametrize("tool", TOOLS)
def test_every_flag_has_a_description(tool):
    env = dict(os.environ, COLUMNS="80", EQX_TX_SYSTEM_MALLOC="1")
    out = subprocess.run([sys.executable, f"{ROOT}/tools/{tool}.py", "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--" in out.stdout
    usage = out.stdout.splitlines()[0]
    assert "{" not in usage, usage  # no bare positional (a subcommand to choose)
    assert _undescribed(out.stdout) == [], out.stdout


@pytest.mark.parametrize("tool, flags, message", [
    ("train", ["--learning-rate", "-2e-4"], r"learning_rate \(--learning-rate\) must be a\s+finite number > 0"),
    ("grpo", ["--model", "x", "--learning-rate", "-1"], r"learning_rate \(--learning-rate\) must be a\s+finite"),
    ("train", ["--b2", "1.5"], r"b2 \(--b2\) must be in \[0, 1\)"),
])
def test_bad_optimizer_flags_are_refused_naming_the_flag_and_range(tool, flags, message):
    env = dict(os.environ, COLUMNS="200", EQX_TX_SYSTEM_MALLOC="1")
    out = subprocess.run([sys.executable, f"{ROOT}/tools/{tool}.py", *flags], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode != 0
    assert re.search(message, re.sub(r"[│ ]+", " ", out.stderr + out.stdout)), out.stderr

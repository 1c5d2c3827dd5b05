"""A newcomer's first hour (issue 43), the parts that need no process: every option says what it does."""


import re

import pytest

from minddp.tools import sample


def option_help(text: str) -> dict[str, str]:
    """argparse's --help options section as {option: its help text} (help on the option's line, or
    on the lines indented below it)."""
    entries, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"^  (-[-\w]+)(?:, (--[-\w]+))?( [A-Z_]+)?\s*(.*)$", line)
        if m:
            current = m.group(2) or m.group(1)
            entries[current] = m.group(4)
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
    return entries


def test_every_sample_option_has_help_text(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    entries = option_help(capsys.readouterr().out)
    assert set(entries) >= {"--prompt", "--prompt-ids", "--data", "--tokens", "--temperature", "--top-k",
                            "--seed"}, entries
    assert all(text.strip() for text in entries.values()), entries
    assert "(default: 200)" in entries["--tokens"]

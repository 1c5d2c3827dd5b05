"""A newcomer's first hour (issue 43), the parts that need no process: every option says what it does."""


import math
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


def test_no_mfu_on_a_cpu_unless_its_peak_is_given():
    """A matmul timed at start-up on a shared CPU moves with the neighbours: no MFU from it."""
    import torch

    from minddp.train.metrics import flops

    cpu = torch.device("cpu")
    peak, source = flops.peak_tflops(cpu)
    assert math.isnan(peak) and "cpu" in source
    assert flops.utilisation(5e4, 1e7, peak, 1)[1] is None
    assert flops.peak_phrase(None) == "no MFU (no known peak: train.peak_tflops=N sets one)"
    assert flops.peak_tflops(cpu, 2.0) == (2.0, "train.peak_tflops")
    assert flops.utilisation(5e4, 1e7, 2.0, 1)[1] == pytest.approx(0.25)
    assert flops.peak_phrase(2.0) == "peak 2 TFLOP/s"


def test_progress_on_a_non_terminal_says_the_first_step_and_elapsed_and_eta(tmp_path, caplog):
    """Slurm logs and CI: a line once the first step is done, then every 10 steps, each with the time
    elapsed and an estimate of what is left."""
    import logging
    from types import SimpleNamespace

    from minddp.train.metrics.tracking import Tracker

    tracker = Tracker(tmp_path, {}, SimpleNamespace(mode="disabled"), "run", 40, start_step=20)
    assert not tracker.interactive  # pytest captures stderr
    with caplog.at_level(logging.INFO, logger="minddp"):
        for step in range(21, 31):
            tracker.step_done(step)
            tracker.log({"step": step, "loss": 2.0, "tokens_per_s": 100.0})
    tracker.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"step 21/40 done elapsed 00:\d\d eta 00:\d\d", lines[0]), lines
    assert re.fullmatch(r"step 30/40 loss 2.0000 tok/s 100 elapsed 00:\d\d eta 00:\d\d", lines[1]), lines

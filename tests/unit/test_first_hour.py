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
            if step == 21:  # the trainer calls it once, after its first step
                tracker.first_step_done(step)
            tracker.log({"step": step, "loss": 2.0, "tokens_per_s": 100.0})
    tracker.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"step 21/40 done elapsed 00:\d\d eta 00:\d\d", lines[0]), lines
    assert re.fullmatch(r"step 30/40 loss 2.0000 tok/s 100 elapsed 00:\d\d eta 00:\d\d", lines[1]), lines


def _study(folder, caps, worlds=(1, 2)):
    """An earlier study's run folders (what `minddp scaling --reuse` reads)."""
    import json

    from minddp.perf import study

    for cap in caps:
        for world in worlds:
            run = folder / study.run_name("ddp", world, cap, 0)
            run.mkdir(parents=True)
            rows = [{"step": i + 1, "step_time_s": 0.5 * world, "tokens_per_s": 2000.0 / world,
                     "comm/busy_s": 0.01 * world * cap, "comm/exposed_wait_s": 0.001, "comm/bytes": 4e6,
                     "comm/collectives": 4} for i in range(6)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("mode,batch", [("strong", "fixed global batch"), ("weak", "fixed batch per rank")])
def test_scaling_writes_into_its_study_and_its_plot_reads_at_a_glance(tmp_path, monkeypatch, drawn_figures,
                                                                      mode, batch):
    """Not into docs/ (make docs does that); the title says the mode that ran; one colour per cap for
    measured and model; caps in numeric order."""
    from minddp.tools import scaling

    monkeypatch.chdir(tmp_path)  # where docs/scaling.* would have landed
    monkeypatch.setattr(scaling.os, "sched_getaffinity", lambda pid: {0, 1})
    _study(tmp_path / "study", [1, 5, 25, 100])
    scaling.main(["--reuse", str(tmp_path / "study"), "--worlds", "1,2", "--caps", "25,100,1,5",
                  "--warmup", "1",
                  "--mode", mode, "--preset", "this-machine-gloo"])
    assert (tmp_path / "study" / "scaling.md").exists() and (tmp_path / "study" / "scaling.png").exists()
    assert not (tmp_path / "docs").exists()
    (fig,) = drawn_figures
    throughput, busy = fig.axes
    assert throughput.get_title() == f"throughput ({mode} scaling, {batch})"
    assert [t.get_text() for t in throughput.get_legend().get_texts()] == [
        "cap 1 MB", "cap 5 MB", "cap 25 MB", "cap 100 MB"]
    assert [t.get_text() for t in busy.get_legend().get_texts()] == [
        "cap 1 MB", "cap 5 MB", "cap 25 MB", "cap 100 MB"]  # 4 entries, not 8
    lines = busy.get_lines()
    measured, model = lines[0::2], lines[1::2]
    assert [m.get_color() for m in measured] == [m.get_color() for m in model]  # a cap: one colour
    assert len({m.get_color() for m in measured}) == 4
    assert {m.get_linestyle() for m in measured} == {"-"} and {m.get_linestyle() for m in model} == {"--"}
    assert "measured (solid) vs calibrated model (dashed)" in busy.get_title()


@pytest.mark.slow  # wandb starts its service process
def test_one_report_run_per_study_however_often_it_is_reported(tmp_path, monkeypatch):
    """`minddp scaling` ends in a report run; `minddp report DIR --wandb` after it updates that run
    (the same W&B id), not a second one in the group."""
    import json

    from minddp.tools import report
    from tests.wandb_offline import runs_under

    monkeypatch.setenv("WANDB_MODE", "offline")
    study = tmp_path / "sweep-7"
    for world in (1, 2):
        run = study / f"ws{world}-cap25"
        run.mkdir(parents=True)
        rows = [{"step": i + 1, "loss": 5.0 - i * 0.1, "step_time_s": 0.4 / world,
                 "tokens_per_s": 1000.0 * world,
                 "comm/busy_s": 0.01, "comm/exposed_wait_s": 0.001} for i in range(6)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = {"ddp": {"bucket_cap_mb": 25}, "seed": 1, "wandb": {"group": "sweep-7", "project": "minddp"}}
        (run / "run.json").write_text(json.dumps({"world_size": world, "config": config}))
    report.main([str(study), "--wandb"])
    report.main([str(study), "--wandb"])
    first, second = runs_under(study)
    assert first["id"] == second["id"] == "report-sweep-7" and first["job_type"] == "report"

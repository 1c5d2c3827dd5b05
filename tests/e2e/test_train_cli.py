"""End to end: the real CLI under `python` and `torchrun`, reading what the runs wrote."""


import json
import math

import pytest
import torch
from torch.testing import assert_close

from tests.conftest import BIN, ROOT, SMALL, assert_same_curves, final_model, metrics  # noqa: F401
from tests.launch import run_train
from tests.wandb_offline import records

pytestmark = pytest.mark.slow


def test_loss_curve_does_not_depend_on_how_the_batch_is_split(tmp_path):
    steps = ["train.max_steps=6"]
    run_train(tmp_path / "one", *SMALL, *steps)  # 1 process, 4 micro-batches of 4
    run_train(tmp_path / "two", *SMALL, *steps, nproc=2)  # 2 ranks x 2 micro-batches
    run_train(tmp_path / "two_mb2", *SMALL, *steps, "train.micro_batch_size=2", nproc=2)  # 2 x 4
    one, two, two_mb2 = (metrics(tmp_path / d) for d in ("one", "two", "two_mb2"))
    assert len(one) == 6 and one[-1]["loss"] < one[0]["loss"]
    assert_same_curves(one, two)
    assert_same_curves(one, two_mb2)
    ref = final_model(tmp_path / "one")
    for d in ("two", "two_mb2"):
        got = final_model(tmp_path / d)
        for k in ref:
            assert_close(got[k], ref[k], atol=1e-5, rtol=1e-4)


def test_resume_gives_the_same_run_as_no_interruption(tmp_path):
    args = [*SMALL, "train.max_steps=6", "train.ckpt_every=2"]
    run_train(tmp_path / "full", *args, nproc=2)
    run_train(tmp_path / "cut", *args, "train.stop_at_step=3", nproc=2)
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2, 3]
    p = run_train(tmp_path / "cut", *args, "train.resume=auto", nproc=2)
    assert "resumed from" in p.stdout + p.stderr
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert_same_curves(full, cut, atol=1e-6)
    a, b = final_model(tmp_path / "full"), final_model(tmp_path / "cut")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # nothing half-written is left behind
    assert not list((tmp_path / "cut" / "checkpoints").glob(".*tmp*"))


def test_metrics_jsonl_and_single_run_dir_written_by_rank_0(tmp_path):
    # no MINDDP_RUN_DIR: every rank must still agree on one run directory
    run_train(None, *SMALL, "train.max_steps=3", nproc=2, cwd=tmp_path, launcher="torchrun")
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1, runs
    run = runs[0]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "lr", "step_time_s", "tokens_per_s", "comm/collectives", "comm/bytes",
                "comm/time_s", "comm/busy_s", "comm/exposed_wait_s"):
        assert key in rows[0], key
    assert rows[0]["comm/collectives"] >= 1 and rows[0]["comm/bytes"] > 0
    assert "val_loss" in rows[2]  # evaluated at the end
    assert (run / ".hydra" / "config.yaml").exists()
    assert (run / "train.log").read_text().count("parameters, world 2") == 1  # rank 0 only


def test_wandb_offline_run_holds_the_logged_metrics(tmp_path):
    run_train(tmp_path / "run", *SMALL, "train.max_steps=3", "wandb.mode=offline",
              "wandb.group=scaling", nproc=2)
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1  # one W&B run per job (rank 0 only)
    history, config, run_info = [], {}, {}
    for r in records(files[0]):  # W&B's offline file, read back (tests/wandb_offline.py)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in r.history.item})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            run_info = {"group": r.run.run_group, "name": r.run.display_name}
    logged = metrics(tmp_path / "run")
    assert [h["_step"] for h in history] == [1, 2, 3]
    for h, m in zip(history, logged):
        assert h["loss"] == pytest.approx(m["loss"])
    assert config["train"]["max_steps"] == 3 and config["model"]["n_layer"] == 2
    assert run_info["group"] == "scaling" and "ws2" in run_info["name"]


def test_unknown_key_fails_fast_with_a_clear_message(tmp_path):
    p = run_train(tmp_path / "x", *SMALL, "train.max_stepz=3", check=False)
    assert p.returncode == 2, p.stderr[-3000:]  # a configuration error, not a traceback's exit 1
    assert "max_stepz" in p.stderr and "minddp: configuration error" in p.stderr


def test_wrong_type_fails_fast(tmp_path):
    p = run_train(tmp_path / "x", *SMALL, "train.max_steps=five", check=False)
    assert p.returncode == 2, p.stderr[-3000:]  # a configuration error, not a traceback's exit 1
    assert "max_steps" in p.stderr and "minddp: configuration error" in p.stderr


def test_indivisible_batch_fails_on_every_rank(tmp_path):
    p = run_train(tmp_path / "x", *SMALL, "train.global_batch_size=10", nproc=2, check=False,
                  timeout=120)
    assert p.returncodes == [2, 2], p.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] minddp: configuration error: train.global_batch_size=10" in p.stderr
    assert "multiple of 8" in p.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_multirun_sweep_single_process(tmp_path):
    p = run_train(None, "-m", *SMALL, "train.max_steps=2", "optim.lr=0.001,0.002",
                  "hydra.sweep.dir=" + str(tmp_path / "sweep"))
    assert p.returncode == 0
    lrs = []
    for job in ("0", "1"):
        rows = metrics(tmp_path / "sweep" / job)
        assert [r["step"] for r in rows] == [1, 2]
        lrs.append(rows[-1]["lr"])
    assert lrs[1] == pytest.approx(2 * lrs[0])


def test_text_data_from_a_folder(tmp_path, in_process_trainer):
    t = in_process_trainer("model=mlp", "data=text", f"data.path={ROOT / 'minddp'}",
                           f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=25",
                           "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_samples=16",
                           "optim.lr=3e-3", "optim.warmup_steps=2", run_dir=tmp_path / "run")
    t.setup()
    t.fit()
    rows = metrics(tmp_path / "run")
    assert len(rows) == 25 and "val_loss" in rows[-1]
    # it learns: ln 256 = 5.55 at initialisation, well below after 25 steps on a fixed seed
    assert rows[0]["loss"] > 5.0 and rows[-1]["loss"] < rows[0]["loss"] - 1.5, (rows[0], rows[-1])
    assert list((tmp_path / "cache").glob("corpus-*.bin"))  # the text became a token file


def test_overlap_timeline_of_one_step(tmp_path):
    run_train(tmp_path / "run", *SMALL, "train.max_steps=3", "train.trace_step=2",
              "ddp.bucket_cap_mb=0.01", nproc=2)
    trace = json.loads((tmp_path / "run" / "trace_step2.json").read_text())["traceEvents"]
    assert_png_draws_the_trace(tmp_path / "run" / "trace_step2.png", trace, tmp_path / "redrawn.png")
    for rank in (0, 1):
        mine = [e for e in trace if e["pid"] == f"rank {rank}"]
        names = {e["name"] for e in mine}
        assert {"forward 0", "backward 0", "forward 1", "backward 1", "exposed wait"} <= names
        buckets = [e for e in mine if e["name"].startswith("bucket")]
        assert len(buckets) > 1 and all(e["dur"] >= 0 for e in buckets)
        # the buckets of the synchronised (last) micro-batch start inside its backward
        bwd = next(e for e in mine if e["name"] == "backward 1")
        assert bwd["ts"] <= min(e["ts"] for e in buckets) <= bwd["ts"] + bwd["dur"]


def assert_png_draws_the_trace(png, trace, redrawn):
    """The PNG is the drawing of the JSON beside it: redraw the JSON's spans, compare pixels."""
    import matplotlib.image

    from minddp.train.metrics.steptrace import render

    ranks = 1 + max(int(e["pid"].removeprefix("rank ")) for e in trace)
    per_rank, labels = [{"compute": [], "comm": []} for _ in range(ranks)], set()
    for e in trace:
        label, lane = e["tid"].rsplit(": ", 1)
        labels.add(label)
        per_rank[int(e["pid"].removeprefix("rank "))][lane].append(
            (e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    (label,) = labels
    render({label: per_rank}, str(redrawn))
    got, want = matplotlib.image.imread(png), matplotlib.image.imread(redrawn)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (abs(got - want) > 0.1).mean() < 2e-4  # the same picture (one bucket moved: ~1e-3)


def test_bf16_autocast_trains(tmp_path):
    run_train(tmp_path / "bf16", *SMALL, "train.max_steps=8", "train.bf16=true", nproc=2)
    run_train(tmp_path / "fp32", *SMALL, "train.max_steps=8", nproc=2)
    bf16, fp32 = ([r["loss"] for r in metrics(tmp_path / d)] for d in ("bf16", "fp32"))
    assert bf16[0] == pytest.approx(math.log(256), abs=0.1)  # untrained: uniform over 256 tokens
    assert bf16[-1] < bf16[0] - 0.4, bf16  # it learns (5.56 -> 5.01 in 8 steps), not just stays finite
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, abs=0.02)  # bf16 was used, and tracks fp32


def test_multirun_jobs_share_one_sweep_dir_by_default(tmp_path):
    run_train(None, "-m", *SMALL, "train.max_steps=1", "optim.lr=0.001,0.002,0.003", cwd=tmp_path)
    root = tmp_path / "multirun"
    found = sorted(p.relative_to(root) for p in root.rglob("metrics.jsonl"))
    assert len(found) == 3 and len({p.parent.parent for p in found}) == 1, found


def test_torch_profiler_trace_of_chosen_steps_names_the_bucket_collectives(tmp_path):
    run_train(tmp_path / "run", *SMALL, "train.max_steps=4", "train.profile_steps=[2,3]",
              "ddp.bucket_cap_mb=0.01", nproc=2)
    traces = sorted((tmp_path / "run" / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]  # every rank
    for t in traces:
        events = json.loads(t.read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(n.startswith("minddp: bucket 0 all_reduce") for n in names)
        assert "minddp: wait for buckets" in names
        steps = {n for n in names if n.startswith("minddp: step ")}
        assert steps == {"minddp: step 2", "minddp: step 3"}, steps  # exactly the chosen steps
        assert any("autograd" in n.lower() or "Backward" in n for n in names)  # beside autograd


def test_startup_is_short_and_the_end_says_where_things_are_and_what_next(tmp_path):
    """The exact overrides the overlap refusal names make a run; its start-up says the engine
    is on in two short lines, and its end (after W&B's own lines) points at the outputs."""
    run = tmp_path / "run"
    p = run_train(run, *SMALL, "train.max_steps=2", "wandb.mode=offline", "ddp.optimizer_overlap=true",
                  "optim.grad_clip=0", "train.on_nonfinite=stop", env={"WANDB_SILENT": "false"})
    out = p.stdout + p.stderr
    head = out[out.index("parameters, world"):].splitlines()[:2]
    assert "ZeRO-1 off, optimizer overlap on" in head[0] and "run dir" in head[1], head
    assert all(len(line) < 200 for line in head), head
    end = out[out.index("saved "):]
    assert "You can sync this run" not in out  # W&B's closing hints are quiet; ours say it once
    assert f"checkpoints (the model) in {run / 'checkpoints'}" in end
    assert f"minddp sample {run}" in end and f"minddp report {run}" in end and "wandb sync" in end


def test_optimizer_overlap_on_the_defaults_is_one_line_naming_the_overrides(tmp_path):
    p = run_train(tmp_path / "x", *SMALL, "ddp.optimizer_overlap=true", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = [x for x in p.stderr.splitlines() if "minddp:" in x]
    assert len(lines) == 1 and "needs optim.grad_clip=0 train.on_nonfinite=stop" in lines[0], p.stderr


def test_a_ranks_error_line_is_one_write(monkeypatch):
    """Two ranks share one stderr: a line written in two pieces (print's text, then its newline)
    runs into the other rank's line when output is unbuffered."""
    import io
    import sys

    import train

    writes = []
    recorder = type("W", (io.StringIO,), {"write": lambda self, s: writes.append(s)})
    monkeypatch.setattr(sys, "stderr", recorder())
    train.say(1, "minddp: configuration error: bad")
    assert writes == ["[rank 1] minddp: configuration error: bad\n"]

"""The analysis that moved from the tools into minddp/perf: pure functions, given inputs, checked
outputs (the tools' end-to-end tests render them: tests/test_tools_cli.py, unit/test_scaling.py,
test_bench_memory.py, test_wandb_study.py)."""

import json

import pytest
import torch

from minddp.engine.buckets import TensorSpec, assign_buckets
from minddp.perf import costmodel as cm
from minddp.perf import engine_bench, jobs, memory, runs, study
from minddp.perf.clock import Clock, timed_methods

CPU = torch.device("cpu")


def test_study_buckets_are_the_engines_plan_else_equal_shares():
    specs = [TensorSpec(n, torch.float32, CPU) for n in (300_000, 10, 600_000, 50, 300_000)]
    order = list(reversed(range(len(specs))))  # the engine's first plan: reversed registration
    plan = assign_buckets(specs, order, 1.0)
    want = [sum(specs[i].numel * 4 for i in b) for b in plan]
    assert len(plan) > 1
    assert study.study_buckets(1.0, len(plan), 123.0, specs) == want
    # the run had another number of buckets (e.g. rebuilt from the observed order): its bytes, shared
    assert study.study_buckets(1.0, 4, 400.0, specs) == [100.0] * 4
    assert study.study_buckets(1.0, 0, 0.0, specs) == []


def test_predicted_comm_takes_the_synchronised_micro_steps_backward_and_zero1_as_reduce_scatter():
    cal = cm.Calibration(cm.PRESETS["this-machine-gloo"])
    buckets = [4e6, 4e6, 1e6]
    got = study.predicted_comm(buckets, 2, cal, step_s=0.9, exposed_s=0.1, accum=4)
    backward = (0.9 - 0.1) / 4 * cal.backward_share
    assert got["busy_s"] == cm.predict_ddp_comm(buckets, 2, cal, backward)["busy_s"]
    zero = study.predicted_comm(buckets, 2, cal, 0.9, 0.1, 4, variant="zero1")
    assert zero["busy_s"] == cm.predict_ddp_comm(buckets, 2, cal, backward, op="reduce_scatter")["busy_s"]
    assert zero["busy_s"] != got["busy_s"]
    # alone: no contention, floor or slowdown under backward: each bucket its ring time + the engine's
    alone = sum(cm.ring_all_reduce_time(b, 2, cal.fabric.alpha, cal.fabric.beta) + cal.overhead_per_bucket_s
                for b in buckets)
    assert got["alone_s"] == pytest.approx(alone)


def _result(world, cap, busy, predicted, step=0.5, variant="ddp"):
    return {"world": world, "cap": cap, "variant": variant, "busy_s": busy, "predicted_busy_s": predicted,
            "step_s": step, "exposed_s": 0.0, "collectives": 3, "bytes": 40e6}


def test_within_and_the_advised_cap_read_world_2_only():
    results = [_result(1, 5, 0.01, 0.5), _result(2, 5, 0.10, 0.119), _result(2, 25, 0.10, 0.121, step=0.4),
               _result(2, 25, 0.10, 0.1, variant="zero1")]
    assert study.within(results, "ddp") == [5]  # 19% off is within 20%, 21% is not; world 1 never
    assert study.within(results, "zero1") == [25]
    cal = cm.Calibration(cm.PRESETS["this-machine-gloo"])
    cap, fastest = study.advised_cap(results, cal)
    assert cap in (5, 25) and fastest["step_s"] == 0.4
    assert study.advised_cap(results[:2], cal) is None  # one world-2 DDP row: nothing to choose between


def _run(world, tokens, step, scaling="strong", **keys):
    return {"keys": {"world_size": world, **keys}, "set": set(), "scaling": scaling, "tokens_per_s": tokens,
            "step_s": step}


def test_swept_keys_and_efficiency_against_the_smallest_world_of_the_same_other_keys():
    rs = [_run(1, 100.0, 1.0, **{"ddp.bucket_cap_mb": 25, "wandb.group": "a"}),
          _run(2, 150.0, 1.2, **{"ddp.bucket_cap_mb": 25, "wandb.group": "b"}),
          _run(2, 180.0, 1.0, **{"ddp.bucket_cap_mb": 5}),
          _run(4, 400.0, 2.0, scaling="weak", **{"ddp.bucket_cap_mb": 5}),
          _run(8, 400.0, 2.5, scaling="weak", **{"ddp.bucket_cap_mb": 5})]
    swept = runs.swept_keys(rs)
    assert swept == ["world_size", "ddp.bucket_cap_mb"]  # wandb.* never; world first
    runs.add_efficiency(rs, swept)
    # strong: tokens/s per rank against the base's; weak: T1 / Tn
    assert [r["efficiency"] for r in rs] == [1.0, 0.75, 1.0, 1.0, 0.8]
    rs[0]["set"] = {"world_size"}  # a command line set only the world size: the cap is not swept
    assert runs.swept_keys(rs) == ["world_size"]


def test_series_group_by_the_other_swept_keys_each_by_world_size():
    rs = [_run(4, 1.0, 1.0, cap=5), _run(1, 1.0, 1.0, cap=25), _run(2, 1.0, 1.0, cap=5)]
    s = runs.series(rs, ["world_size", "cap"])
    assert list(s) == ["cap=5", "cap=25"]  # first seen first
    assert [r["keys"]["world_size"] for r in s["cap=5"]] == [2, 4]
    assert list(runs.series(rs, ["world_size"])) == ["runs"]


def test_predicted_busy_of_a_run_read_back_is_the_studys_model_on_equal_shares():
    cal = cm.Calibration(cm.PRESETS["this-machine-gloo"])
    r = {"step_s": 0.6, "keys": {"world_size": 2}, "identity": {"accumulation": 2, "variant": "zero1"},
         "summary": {"comm/exposed_wait_s": 0.1}, "last": {"comm/collectives": 4, "comm/bytes": 8e6}}
    want = study.predicted_comm([2e6] * 4, 2, cal, 0.6, 0.1, 2, "zero1")["busy_s"]
    assert runs.predicted_busy(r, cal) == want
    assert runs.predicted_busy({**r, "step_s": None}, cal) is None


def test_read_rows_keeps_rows_with_an_integer_step_and_says_what_it_skipped(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n{torn\n" + json.dumps({"step": True}) + "\n\n"
                 + json.dumps({"step": 2}) + "\n")
    assert [r["step"] for r in runs.read_rows(p)] == [1, 2]
    assert "skipped 2 malformed row(s) (line 2, 3)" in capsys.readouterr().err


def test_first_error_is_the_workers_exception_not_torchruns_banner():
    stderr = ("[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: out of memory\n"
              "======================\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert jobs.first_error(stderr) == "[rank0]: RuntimeError: out of memory"
    assert jobs.first_error("just this\n=====\n") == "just this"
    assert jobs.first_error("") == "no output"
    assert jobs.launch(3, "-m", "minddp")[1:] == ["--standalone", "--nproc_per_node=3", "-m", "minddp"]
    assert jobs.launch(1, "train.py", torchrun=False)[1:] == ["train.py"]


def _measured(config, peaks, states=10.0, dp=2):
    ranks = [{"peak": p, "states": states, "absolute": p + 5, "param_bytes": 100e6,
              "marks": {"init": 0, "model": 1, "wrap": 1 + p / 10, "step1": p}} for p in peaks]
    return {"config": config, "dp": dp, "ranks": ranks}


def test_figures_and_the_ddp_criterion_read_the_largest_rank():
    f = memory.figures(_measured("minddp-ddp", [30.0, 50.0]))
    assert (f["peak"], f["absolute"], f["states"]) == (50.0, 55.0, 10.0)
    assert f["marks"] == [0, 1, 6.0, 50.0] and f["wrap"] == 5.0  # wrap: the largest rise, any rank
    assert f["modeled"] == memory.modeled_bytes("minddp-ddp", 100e6, 2)["total"]
    rows = [_measured("torch-ddp", [60.0]), _measured("minddp-ddp", [50.0])]
    assert memory.ddp_criterion(rows) == {"torch": 60.0, "torch_view": None, "minddp": 50.0, "pass": True}
    worse = memory.ddp_criterion([_measured("torch-ddp", [40.0]), _measured("minddp-ddp", [50.0]),
                                  _measured("torch-ddp-view", [45.0])])
    assert worse["pass"] is False and worse["torch_view"] == 45.0
    assert memory.ddp_criterion([{"config": "torch-ddp", "error": "exit 1"}, rows[1]]) is None


def test_exposed_gather_is_zero1s_forward_minus_ddps_per_repeat():
    rows = [{"label": "minddp DDP + AdamW", "phases": [[1.0, 0.2, 0.5, 0.3], [1.0, 0.3, 0.4, 0.3]]},
            {"label": "minddp shard_optimizer (ZeRO-1)",
             "phases": [[1.0, 0.25, 0.5, 0.25], [1.0, 0.5, 0.4, 0.1]]}]
    assert engine_bench.exposed_gather(rows) == pytest.approx([0.05, 0.2])
    assert engine_bench.exposed_gather(rows[:1]) == []


def test_timed_methods_time_each_call_on_the_instance_only():
    class Box:
        def work(self, n):
            return sum(range(n))

    box, other = Box(), Box()
    clock = Clock(CPU)
    spent = timed_methods({"work": (box, "work")}, clock)
    assert box.work(10_000) == sum(range(10_000)) and box.work(3) == 3
    assert len(spent["work"]) == 2 and all(clock.seconds(a, z) >= 0 for a, z in spent["work"])
    other.work(5)  # another instance, and the class, are untouched
    assert len(spent["work"]) == 2 and "work" not in vars(other)

"""Peak memory per rank, as a user measures it: one training setup (same GPT, batch and
AdamW) under each data-parallel configuration, each in its own `torchrun` job.

    minddp bench-memory [--models gpt-10.8M,gpt-50M] [--dp 2,3] [--out docs/bench_memory]

Configurations (CONFIGS): `local` (no wrapper: each rank trains alone, the reference),
torch DDP with default arguments, torch DDP with `gradient_as_bucket_view=True`, minddp DDP,
minddp `shard_optimizer` (ZeRO-1 via `minddp.ShardedOptimizer`), torch DDP with
`torch.distributed.optim.ZeroRedundancyOptimizer`, and minddp with `optimizer_overlap` when
the engine has that option (detected from its signature; absent, the row says so).

What is measured, one code path, the device decides:
- CPU: the peak resident set (VmHWM) minus the resident set right after the imports (torch,
  minddp): at that point the worker resets the kernel's high-water mark (`/proc/self/clear_refs`,
  5), so the peak is this run's own; where the kernel refuses, `ru_maxrss` (lifetime peak).
- CUDA: `torch.cuda.max_memory_allocated` (the caching allocator's live tensors, from 0).
Peaks are read after the model is built, after wrap + optimizer, and after every step; the
largest rank's figure is reported. Beside each, what the configuration holds by construction
(parameters P, gradients, buckets, optimizer states), computed from the parameter sizes by
minddp.perf.memory (the one memory model; the meter is its `PeakMeter`).
Writes <out>.md and <out>.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ..perf import memory as mem
from ..perf.jobs import engine_version, first_error, launch, run_job
from . import render
from .arguments import choice_list, int_list, positive_int, readable, tool_parser, writable_out
from .workload import GPT_PRESETS

MODELS = {name: GPT_PRESETS[name] for name in ("gpt-10.8M", "gpt-50M", "gpt-tiny")}
BATCH, STEPS = 2, 3
MB = 1e6


def worker(config: str, model_name: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.optim  # noqa: F401  every module any configuration uses, before

    from ..model.gpt import GPT, GPTConfig
    from ..optim.zero import ShardedOptimizer  # noqa: F401
    from ..parallel.dist import exit_worker
    from .cli import start  # all imported before the baseline: code, not the configuration's

    mem.warm_up_optimizer()
    meter = mem.PeakMeter()  # the baseline: the resident set right after the imports
    info = start("auto")
    torch.manual_seed(0)
    cfg = GPTConfig(**MODELS[model_name])
    mine = {"rank": info.rank, **mem.peak_run(config, lambda: GPT(cfg).to(info.device), meter,
                                              info.device, steps, BATCH, cfg.block_size, seed=info.rank)}
    ranks = [None] * info.world_size
    dist.all_gather_object(ranks, mine)
    if info.rank == 0:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()
    exit_worker()


def run_config(config: str, model_name: str, dp: int, steps: int) -> dict:
    """One torchrun job of `dp` ranks; the per-rank figures, or the error it ended with."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        result = Path(tmp) / "ranks.json"
        p = run_job(launch(dp, "-m", "minddp", "bench-memory", "--worker", config, "--model", model_name,
                           "--steps", str(steps), "--result", str(result)))
        row = {"config": config, "model": model_name, "dp": dp}
        if p.returncode or not result.exists():
            return {**row, "error": f"exit {p.returncode}: {first_error(p.stderr)}"}
        return {**row, "ranks": json.loads(result.read_text())}


def config_table(rows: list[dict]) -> dict:
    header = ["dp", "configuration", "holds (modeled)", "modeled (MB)", "states measured (MB)",
              "wrap + optimizer raised the peak by (MB)", "peak (MB)", "peak - modeled (MB)",
              "peak absolute (MB)", "high-water after init / model / wrap / each step (MB)"]
    return render.table(header, [config_row(r) for r in rows])


def config_row(r: dict) -> list:
    what = mem.HOLDS[r["config"]][4]
    if "error" in r or "skipped" in r:
        return [r["dp"], r["config"], what, "-", "-", "-", r.get("error") or r.get("skipped"), "-", "-", "-"]
    f = mem.figures(r)
    mbs = [render.megabytes(f[k]) for k in ("modeled", "states", "wrap", "peak")]
    return [r["dp"], r["config"], what, *mbs, render.megabytes(f["peak"] - f["modeled"], signed=True),
            render.megabytes(f["absolute"]), " / ".join(render.megabytes(v) for v in f["marks"])]


def verdict(passed: bool | None) -> str:
    """pass, FAIL, or no verdict where the difference tested is below the meter's resolution."""
    return f"n/a (under {mem.RESOLUTION / MB:.0f} MB)" if passed is None else "pass" if passed else "FAIL"


def criteria_tables(results: list[dict]) -> list:
    keys = sorted({(r["model"], r["dp"]) for r in results}, key=lambda k: (list(MODELS).index(k[0]), k[1]))
    pairs = (("minddp ZeRO-1 vs minddp DDP", "minddp-ddp", "minddp-zero1"),
             ("torch ZeroRedundancyOptimizer vs torch DDP", "torch-ddp", "torch-zero"))
    zero, ddp = [], []
    for m, dp in keys:
        rows = [r for r in results if (r["model"], r["dp"]) == (m, dp)]
        for label, plain, sharded in pairs:
            if c := mem.zero_criterion(rows, plain, sharded):
                mbs = [render.megabytes(c[k]) for k in ("saved", "peak_plain", "peak_sharded", "lowered")]
                fraction = f"{c['fraction']:.2f}" if c["pass"] is not None else "-"
                zero.append([m, dp, label, *mbs, fraction, verdict(c["pass"])])
        if c := mem.ddp_criterion(rows):
            mbs = ["-" if c[k] is None else render.megabytes(c[k]) for k in ("torch", "torch_view", "minddp")]
            ddp.append([m, dp, *mbs, verdict(c["pass"])])
    return ["ZeRO-1 lowers the peak (target: by at least 80% of the optimizer state it saves):",
            render.table(["model", "dp", "sharding", "states saved (MB)", "unsharded peak (MB)",
                          "sharded peak (MB)", "lowered by (MB)", "lowered / saved", ">= 0.8"], zero),
            "minddp DDP at or below torch DDP's default:",
            render.table(["model", "dp", "torch DDP default (MB)", "torch DDP bucket view (MB)",
                          "minddp DDP (MB)", "minddp <= torch default"], ddp)]


def report(results: list[dict], steps: int, version: str = "") -> str:
    ok = next((r for r in results if "ranks" in r), None)
    method = ok["ranks"][0]["method"] if ok else "-"
    device = ok["ranks"][0]["device"] if ok else "-"
    blocks = ["# Peak memory per rank (`make bench-memory`)",
              f"Command: `minddp bench-memory`. Each row is its own `torchrun` job of dp ranks "
             f"({device}, 1 thread per rank): the same GPT, batch {BATCH} x block tokens per rank, "
             f"fused AdamW (weight decay 0.1), {steps} steps; minddp at {version or 'unknown'}. "
             f"Peak = {method}, the largest rank's. "
             "`holds (modeled)` is what the configuration keeps by construction, P = the fp32 "
             "parameter bytes; `peak - modeled` is what it holds beyond that: activations, "
             "temporaries, allocator slack and copies (compare with the `local` row, which has no "
             "wrapper). `wrap + optimizer raised the peak by` is how far the high-water mark rose "
             "while the wrapper and the optimizer were built (a second copy of the parameters shows "
             "there). Peak memory does not depend on the machine's load: one run per row."]
    for m in MODELS:
        rows = [r for r in results if r["model"] == m]
        if not rows:
            continue
        p = next((r["ranks"][0]["param_bytes"] for r in rows if "ranks" in r), 0)
        blocks += [f"## {m}: {render.count(p / 4)} parameters, P = {render.megabytes(p)} MB, AdamW states "
                   f"2P = {render.megabytes(2 * p)} MB", config_table(rows)]
    return render.markdown(blocks + criteria_tables(results)) + "\n"


def main(argv=None) -> None:
    ap = tool_parser("bench-memory", __doc__)
    ap.add_argument("--models", type=choice_list(MODELS), default="gpt-10.8M,gpt-50M",
                    help=f"of {', '.join(MODELS)}")
    ap.add_argument("--dp", type=int_list(), default="2,3", help="data-parallel sizes (ranks per job)")
    ap.add_argument("--configs", type=choice_list(mem.CONFIGS), default=",".join(mem.CONFIGS),
                    help=f"of {', '.join(mem.CONFIGS)}")
    ap.add_argument("--steps", type=positive_int, default=STEPS)
    ap.add_argument("--out", type=writable_out, default="docs/bench_memory",
                    help="writes OUT.md and OUT.json")
    ap.add_argument("--reuse", metavar="JSON", type=readable(_rows, "an OUT.json of bench-memory"),
                    help="re-render the report of an earlier OUT.json")
    ap.add_argument("--worker", choices=list(mem.CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt-10.8M", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.result)
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        return write(old["rows"], args, old.get("version", ""))
    results = []
    for m in args.models:
        for dp in args.dp:
            for c in args.configs:
                print(f"bench-memory: {m}, dp {dp}, {c} ...", flush=True)
                results.append(run_config(c, m, dp, args.steps))
    write(results, args, engine_version())


def _rows(path: str) -> list:
    rows = json.loads(Path(path).read_text())["rows"]
    if not isinstance(rows, list):
        raise ValueError("its 'rows' is not a list")
    return rows


def write(results: list[dict], args, version: str) -> None:
    text = report(results, args.steps, version)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"version": version, "rows": results}, indent=1) + "\n")
    failed = [r for r in results if "error" in r]
    if failed:
        which = "; ".join(f"{r['model']} dp {r['dp']} {r['config']}: {r['error']}" for r in failed)
        raise SystemExit(f"minddp bench-memory: {len(failed)} configuration(s) failed: {which}")


if __name__ == "__main__":
    main()

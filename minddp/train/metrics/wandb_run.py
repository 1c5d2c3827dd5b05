"""The run's W&B side, which never takes the run down: training and checkpoints do not depend on it.

- `resolve_mode("auto")`: WANDB_MODE if set, else online when W&B's own login state has
  credentials (WANDB_API_KEY, its settings, ~/.netrc: `wandb.login(verify=False, prompt=False)`)
  and its server answers within seconds, else offline (an air-gapped cluster that exports a key
  everywhere gets one line, not a 95 s stall and a CommError). `online` is checked the same way:
  without credentials or a server that answers it logs offline, saying so in one line; and a run
  that does not start online within `wandb.init_timeout` seconds (W&B's own wait is 90 s) is
  started offline instead. Nothing is lost either way: `wandb sync` uploads an offline run.
- `open_run`: wandb.init for this run (group, job type, tags, flat identity), or None with one
  warning naming the folder where W&B cannot start (a read-only `wandb/`, a file in its place,
  a server that refuses).
- A resumed run rewinds its W&B run (`resume_from`) to the last step W&B's files surely hold and
  re-logs the rows after it from metrics.jsonl: a killed job's W&B service loses what it had not
  written yet, and a rewind past it would branch from records that never existed. Which step is
  sure is kept in `<run dir>/wandb_written.json`: set at a clean close, lowered at each rewind.
  Where the server cannot rewind, a new run of the same group, linked by `resumed_from`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from ...io.atomic import atomic_write
from . import summary as steady

log = logging.getLogger("minddp")
REACH_TIMEOUT_S = 3.0
INIT_TIMEOUT_S = 30.0  # wandb.init_timeout's default (minddp.train.config.WandbConfig)
WRITTEN = "wandb_written.json"


def resolve_mode(mode: str) -> str:
    """auto: WANDB_MODE if set, else as online. online: online when logged in to W&B and its
    server answers, else offline (one line, except for auto without credentials: the default)."""
    mode = str(mode)
    if mode == "auto" and os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if mode not in ("auto", "online"):
        return mode
    import wandb

    if not wandb.login(verify=False, prompt=False):  # W&B's own login state; no prompt, no network
        if mode == "online":
            log.warning("W&B: wandb.mode=online, but no W&B credentials (WANDB_API_KEY or `wandb login`); "
                        "logging offline instead; upload later with wandb sync")
        return "offline"
    base_url = wandb.setup().settings.base_url
    if (why := unreachable(base_url)) is not None:
        log.warning(f"W&B: {base_url} did not answer within {REACH_TIMEOUT_S:g} s ({why}); logging offline "
                    f"instead (wandb.mode={mode}); upload later with wandb sync")
        return "offline"
    return "online"


def unreachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the server at `url` cannot be reached (through the environment's proxies), or None:
    any HTTP answer, an error status included, means it is there."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e)) or type(e).__name__
    return None


def open_run(run_dir: Path, wandb_cfg, name: str, mode: str, config: dict, resume_step: int | None,
             rows: list[dict]):
    """The W&B run, or None (one warning) where it cannot start. resume_step: an earlier part
    logged `rows` (metrics.jsonl up to the checkpoint); those W&B may lack are logged again."""
    sure = None if resume_step is None else min(resume_step, written(run_dir))
    try:
        run = _start(run_dir, wandb_cfg, name, mode, config, sure)
        if sure is not None:
            relog(run, [r for r in rows if sure < r["step"] <= resume_step], run_dir)
            mark_written(run_dir, sure)
    except Exception as e:  # noqa: BLE001 - wandb raises its own errors, OSError, ValueError, ...
        log.warning(f"W&B: cannot log to {run_dir / 'wandb'} ({type(e).__name__}: {str(e)[:200]}); "
                    "training goes on without W&B (metrics.jsonl and checkpoints as usual)")
        return None
    return run


def _start(run_dir: Path, wandb_cfg, name: str, mode: str, config: dict, rewind_to: int | None):
    """_init; an online run that cannot start within wandb.init_timeout (a server that answers
    but not in time) starts offline instead, in one line."""
    started = time.monotonic()
    try:
        return _init(run_dir, wandb_cfg, name, mode, config, rewind_to)
    except Exception as e:  # noqa: BLE001 - wandb's CommError on a timeout, and its other errors
        if mode != "online":
            raise
        limit = f"wandb.init_timeout={init_timeout(wandb_cfg):g} s"
        log.warning(f"W&B: {no_online_run(e, time.monotonic() - started, init_timeout(wandb_cfg), limit)}; "
                    "logging offline instead; upload later with wandb sync")
        import wandb

        wandb.teardown()  # W&B's service still holds the run's id for the online attempt: "in use"
        return _init(run_dir, wandb_cfg, name, "offline", config, rewind_to)


def no_online_run(e: Exception, waited_s: float, timeout_s: float, limit: str) -> str:
    """Why the online run did not start: the wait ran out, or the server refused it at once (a
    404 for an unknown entity), which is not "within 30 s"."""
    lines = str(e).strip().splitlines()
    why = f"{type(e).__name__}: {lines[0][:160] if lines else 'no message'}"
    if waited_s >= 0.9 * timeout_s:
        return f"no online run within {limit} ({why})"
    return f"the server refused the online run after {waited_s:.1f} s ({why})"


def init_timeout(wandb_cfg) -> float:
    return float(getattr(wandb_cfg, "init_timeout", None) or INIT_TIMEOUT_S)


def relog(run, rows: list[dict], run_dir: Path) -> None:
    for row in rows:
        run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])
    if rows:
        log.info(f"W&B: logged steps {rows[0]['step']}..{rows[-1]['step']} again from metrics.jsonl (the "
                 "last part of the run ended before W&B had written them)")


def written(run_dir: Path) -> int:
    """The last step W&B's files surely hold (0: none known, e.g. after a kill -9 of the first part)."""
    try:
        step = json.loads((Path(run_dir) / WRITTEN).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return 0
    return step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else 0


def mark_written(run_dir: Path, step: int) -> None:
    atomic_write(Path(run_dir) / WRITTEN, json.dumps({"step": step}) + "\n")


def _init(run_dir: Path, wandb_cfg, name: str, mode: str, config: dict, rewind_to: int | None):
    """wandb.init: a fresh run, or rewound to `rewind_to` (W&B drops its history after that
    step), or where the installed wandb or the server cannot, a new run linked by `resumed_from`."""
    import wandb

    run_id = wandb_id(run_dir)
    tags = [t for t in (config.get("variant"), config.get("scaling") and f"{config['scaling']}-scaling",
                        *wandb_cfg.tags) if t]
    common = dict(project=wandb_cfg.project, group=wandb_cfg.group, name=name, mode=mode, dir=str(run_dir),
                  job_type=str(wandb_cfg.job_type), tags=tags,
                  # no history/summary tables and sync hints at the end: next_steps() says where things are
                  settings=wandb.Settings(quiet=True, init_timeout=init_timeout(wandb_cfg)))
    if rewind_to is None:
        run = wandb.init(id=run_id, resume="allow", config=config, **common)
    else:
        run = None
        if "resume_from" in inspect.signature(wandb.init).parameters:
            try:
                run = wandb.init(resume_from=f"{run_id}?_step={rewind_to}", config=config, **common)
            except Exception as e:  # noqa: BLE001 - a server without rewind: a new run instead
                log.warning(f"W&B could not rewind run {run_id} to step {rewind_to} ({e}); "
                            "continuing in a new run of the same group")
        if run is None:
            link = {"resumed_from": {"run_id": run_id, "step": rewind_to}}
            run = wandb.init(id=f"{run_id}-{int(time.time())}", config={**config, **link}, **common)
    for key in steady.KEYS:  # the summary is the steady state set at close, not the last row
        run.define_metric(key, summary="none")
    return run


def wandb_id(run_dir: Path) -> str:
    """A stable run id per run directory, so a resumed job continues the same W&B run."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]

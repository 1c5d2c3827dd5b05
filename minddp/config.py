"""The config schema: typed dataclasses registered with Hydra's ConfigStore.

The YAML files in conf/ only set values; these classes say which keys exist and
their types, so `train.max_stepz=5` or `train.max_steps=five` fails while Hydra
composes the config, before any process group starts. Checks that need the
world size (batch divisibility, mesh layout) are in `validate()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from .errors import ConfigError
from .model import GPTConfig, MLPConfig

_PROCESS_START = datetime.now()


# The model schemas are the models' own config dataclasses plus the group's name.
@dataclass
class GPTModel(GPTConfig):
    name: str = "gpt"


@dataclass
class MLPModel(MLPConfig):
    name: str = "mlp"


@dataclass
class TextData:
    name: str = "text"
    # a file or folder of text; null = the Python standard library's own .py sources
    path: Optional[str] = None
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    cache_dir: str = "${oc.env:MINDDP_CACHE,${oc.env:HOME,/tmp}/.cache/minddp}"


@dataclass
class SyntheticData:
    name: str = "synthetic"
    num_samples: int = 4096
    num_val: int = 256
    modulus: int = 32  # tokens live in [0, modulus)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    grad_clip: float = 1.0  # global-norm clipping; 0 disables


@dataclass
class TrainConfig:
    max_steps: int = 200
    global_batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # sequences per rank per forward/backward
    eval_every: int = 50
    eval_samples: int = 256  # validation windows per evaluation, split over ranks (0 = whole split)
    ckpt_every: int = 100  # 0 = only at the end
    resume: str = "none"  # none | auto | <path to a checkpoint>
    log_every: int = 10  # plain-text progress lines when stderr is not a terminal
    stop_at_step: Optional[int] = None  # exit cleanly after this step (as if interrupted)
    trace_step: Optional[int] = None  # write an overlap timeline (trace json + png) of this step
    bf16: bool = False
    device: str = "auto"  # auto | cpu | cuda
    init_timeout_s: float = 600.0  # process-group start-up (slow nodes, first imports)
    timeout_s: float = 300.0  # any collective once training runs: a hang becomes an error
    flight_recorder: int = 2000  # last N collectives per rank, dumped on error/timeout/signal (0: off)
    on_nonfinite: str = "skip"  # skip | stop: a NaN/inf loss or gradient on any rank, decided globally
    check_every: int = 0  # every N steps compare a parameter hash across dp ranks (0: off)
    # fault injection, to rehearse the non-finite path: this rank's loss becomes NaN at this step
    fault_nan_step: Optional[int] = None
    fault_nan_rank: int = 0


@dataclass
class DDPConfig:
    # torch DDP's meaning: a bucket closes once it reaches the cap; null = torch's default
    # (25 MiB after a 1 MiB first bucket)
    bucket_cap_mb: Optional[float] = None
    strict_bucket_cap: bool = False  # minddp's alternative: a bucket never exceeds the cap
    overlap: bool = True
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    reduce_op: str = "avg"
    compress: Optional[str] = None  # null | fp16 | bf16
    algorithm: str = "native"  # native | ring | rs_ag | hierarchical (minddp.collectives)
    debug: bool = False  # collective fingerprints: mismatches raise on every rank (or MINDDP_DEBUG=1)


@dataclass
class MeshConfig:
    tp: int = 1


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto (online with an API key, else offline) | online | offline | disabled
    project: str = "minddp"
    group: Optional[str] = None
    name: Optional[str] = None  # default: encodes model, world size and layout


@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    optim: OptimConfig = MISSING
    seed: int = 1337
    train: TrainConfig = field(default_factory=TrainConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="minddp_schema", node=Config)
    cs.store(group="model", name="gpt_schema", node=GPTModel)
    cs.store(group="model", name="mlp_schema", node=MLPModel)
    cs.store(group="data", name="text_schema", node=TextData)
    cs.store(group="data", name="synthetic_schema", node=SyntheticData)
    cs.store(group="optim", name="adamw_schema", node=OptimConfig)
    register_resolvers()


def register_resolvers() -> None:
    """Resolvers that make every rank of one job agree on one run directory."""
    if not OmegaConf.has_resolver("minddp.run_dir"):
        OmegaConf.register_new_resolver("minddp.run_dir", default_run_dir)
    if not OmegaConf.has_resolver("minddp.rank0_only"):
        # only rank 0 writes .hydra/ (the resolved config); other ranks get null
        OmegaConf.register_new_resolver(
            "minddp.rank0_only", lambda v: v if os.environ.get("RANK", "0") == "0" else None)


def default_run_dir(prefix: str = "outputs") -> str:
    """One directory per job, the same on every rank.

    Each rank resolves `${now:}` itself, so timestamps can differ by a second
    between ranks; instead: MINDDP_RUN_DIR if set, else torchrun's run id (equal
    on all ranks; it is --rdzv_id, e.g. the Slurm job id, on multi-node), else a
    timestamp (one process, nothing to agree with).
    """
    if os.environ.get("MINDDP_RUN_DIR"):
        return os.environ["MINDDP_RUN_DIR"]
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"{prefix}/run-{os.environ['TORCHELASTIC_RUN_ID']}"
    # the process start time, not "now": Hydra resolves the sweep dir again for every job
    # of a -m sweep, and all of them belong in one folder
    return f"{prefix}/{_PROCESS_START:%Y-%m-%d/%H-%M-%S}"


def validate(cfg, world_size: int) -> dict:
    """Checks that need the world size; returns derived values. Raises ConfigError naming the fix."""
    from .mesh import ParallelDims

    try:
        dims = ParallelDims(world_size, cfg.mesh.tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if dims.tp_enabled:
        if cfg.model.name != "gpt":
            raise ConfigError(f"mesh.tp={dims.tp} needs model=gpt (the tensor-parallel model); "
                              f"model={cfg.model.name} runs with mesh.tp=1")
        try:
            dims.check_divides(**{"model.n_head": cfg.model.n_head, "MLP width 4*model.n_embd":
                                  4 * cfg.model.n_embd})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    t = cfg.train
    per_step = t.micro_batch_size * dims.dp
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("train.global_batch_size and train.micro_batch_size must be >= 1")
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dims.dp} = {per_step}; "
            "gradient accumulation must be a whole number of micro-batches. "
            f"Choose a global batch that is a multiple of {per_step}."
        )
    if cfg.wandb.mode not in ("auto", "online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode must be auto, online, offline or disabled, got {cfg.wandb.mode!r}")
    if t.resume not in ("none", "auto") and not os.path.exists(t.resume):
        raise ConfigError(f"train.resume={t.resume!r}: no such checkpoint (use none, auto or a path)")
    if t.on_nonfinite not in ("skip", "stop"):
        raise ConfigError(f"train.on_nonfinite must be skip or stop, got {t.on_nonfinite!r}")
    if cfg.data.name == "text" and cfg.data.path is not None:
        if not os.path.exists(cfg.data.path):
            raise ConfigError(f"data.path={cfg.data.path!r} does not exist: give a text file or a folder")
    if t.max_steps < 1:
        raise ConfigError(f"train.max_steps must be >= 1, got {t.max_steps}")
    return {"dims": dims, "accum": t.global_batch_size // per_step}

"""The config schema: typed dataclasses registered with Hydra's ConfigStore.

The YAML files in conf/ only set values; these classes say which keys exist and
their types, so `train.max_stepz=5` or `train.max_steps=five` fails while Hydra
composes the config, before any process group starts. Checks that need the
world size (batch divisibility, mesh layout) are in `validate()`, which the Trainer runs
once, also before any process group; what depends on a rank's files (the data, a checkpoint)
is checked after, agreed across ranks (load_data_agreed, checkpoint.resolve_agreed).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ..errors import ConfigError
from ..model.gpt import GPTConfig, MLPConfig

_PROCESS_START = datetime.now()


class Choice(str, Enum):
    """A string setting with a fixed set of values: OmegaConf refuses any other while Hydra
    composes the config (`train.scaling=linear`: "expected one of [strong, weak]"). A member
    equals, prints and serialises as its value ("weak"), so code reads it as the string."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


WandbMode = Choice("WandbMode", {v: v for v in ("auto", "online", "offline", "disabled")},
                   module=__name__)
JobType = Choice("JobType", {v: v for v in ("train", "report", "bench")}, module=__name__)
OnNonfinite = Choice("OnNonfinite", {v: v for v in ("skip", "stop")}, module=__name__)
Scaling = Choice("Scaling", {v: v for v in ("strong", "weak")}, module=__name__)
Device = Choice("Device", {v: v for v in ("auto", "cpu", "cuda")}, module=__name__)
CkptFormat = Choice("CkptFormat", {v: v for v in ("file", "dcp")}, module=__name__)
FaultPlace = Choice("FaultPlace", {v: v for v in ("step", "checkpoint_write", "checkpoint_delete")},
                    module=__name__)
Compile = Choice("Compile", {v: v for v in ("none", "whole", "blocks")}, module=__name__)
TokenDtype = Choice("TokenDtype", {v: v for v in ("auto", "uint8", "uint16", "uint32")}, module=__name__)
Activation = Choice("Activation", {v: v for v in ("gelu", "gelu_tanh")}, module=__name__)
FLIGHT_RECORDER_MAX = 1_000_000  # torch keeps every entry in memory; past 2**31 its set-up hangs


# The model schemas are the models' own config dataclasses plus the group's name.
# vocab_size null: from the data (meta.pkl, llm.c's header), else 256 (bytes); set it and it
# must agree with meta.pkl. The trainer writes the effective value back before saving.
@dataclass
class GPTModel(GPTConfig):
    name: str = "gpt"
    vocab_size: Optional[int] = None
    # gelu: torch's exact GELU | gelu_tanh: its tanh approximation (GPT-2's, HF's gelu_new)
    activation: Activation = Activation.gelu
    # a Hugging Face save_pretrained folder of a GPT-2: a fresh run starts from its weights, and
    # conf/model/gpt.yaml's sizes default to its config.json's (minddp/train/init_from.py)
    init_from: Optional[str] = None


@dataclass
class MLPModel(MLPConfig):
    name: str = "mlp"
    vocab_size: Optional[int] = None


@dataclass
class TextData:
    name: str = "text"
    # a file or folder of text; null = the Python standard library's own .py sources
    path: Optional[str] = None
    max_bytes: int = 8_000_000
    val_fraction: float = 0.05
    cache_dir: str = "${oc.env:MINDDP_CACHE,${oc.env:HOME,/tmp}/.cache/minddp}"


@dataclass
class TokensData:
    """A folder of token files: nanoGPT's train.bin/val.bin (+ meta.pkl) or llm.c's shards."""

    name: str = "tokens"
    dir: Optional[str] = None
    # headerless files: auto (uint16 if the vocabulary fits, else uint32) | uint8/16/32
    dtype: TokenDtype = TokenDtype.auto


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
    ckpt_final: bool = True  # save at max_steps (false: only ckpt_every's saves; a stop signal still saves)
    # dcp: a folder ckpt_<step>/, each rank writes its part | file: one ckpt_<step>.pt written by rank 0
    ckpt_format: CkptFormat = CkptFormat.dcp
    # auto | true | false: the write runs beside the next step, committed after it (dcp only);
    # auto: on for CUDA (a device-to-host copy, then host cores write), off on the CPU
    ckpt_async: Any = "auto"
    ckpt_keep: Optional[int] = 3  # keep the newest N checkpoints; 0 or null: keep all
    ckpt_keep_every: Optional[int] = None  # and, forever, those at steps divisible by N; 0 or null: none
    resume: str = "none"  # none | auto | <run dir> (continues it there) | <path to a checkpoint>
    resume_force: bool = False  # resume even if seed, model, global batch or data changed
    log_every: int = 1  # a metrics row every N steps (means over them); progress lines at most every 10
    peak_tflops: Optional[float] = None  # per device, for MFU; null: known GPUs' table (none on CPU)
    stop_at_step: Optional[int] = None  # exit cleanly after this step (as if interrupted)
    trace_step: Optional[int] = None  # write an overlap timeline (trace json + png) of this step
    profile_steps: Optional[List[int]] = None  # [first, last]: a torch.profiler trace of these steps
    bf16: Optional[bool] = None  # true | false | null: bf16 autocast on CUDA devices that support it
    tf32: bool = True  # on CUDA, fp32 matmuls and convolutions on TF32 tensor cores (no effect on CPU)
    device: Device = Device.auto  # auto | cpu | cuda
    # torch.compile: none | whole (the model; split at the DDP buckets) | blocks (each block)
    compile: Compile = Compile.none
    init_timeout_s: float = 600.0  # process-group start-up (slow nodes, first imports)
    timeout_s: float = 300.0  # any collective once training runs: a hang becomes an error
    flight_recorder: int = 2000  # torch flight recorder: last N collectives per rank, dumped on error
    # skip | stop: a NaN/inf loss or gradient on any rank, decided globally
    on_nonfinite: OnNonfinite = OnNonfinite.skip
    max_skipped_steps: int = 10  # this many skipped steps in a row stop the run (exit 3); 0: no limit
    check_every: int = 0  # every N steps compare a parameter hash across dp ranks (0: off)
    # fault injection, to rehearse the non-finite path: this rank's loss becomes NaN at this step
    fault_nan_step: Optional[int] = None
    fault_nan_rank: int = 0
    # ... and this rank sleeps fault_sleep_s seconds inside this step (a stuck rank)
    fault_sleep_step: Optional[int] = None
    fault_sleep_rank: int = 0
    fault_sleep_s: float = 0.0
    # where it sleeps: step | checkpoint_write (the write of that step's checkpoint, in the
    # background too) | checkpoint_delete (retention, between moving a checkpoint aside and removing it)
    fault_sleep_in: FaultPlace = FaultPlace.step
    # strong: train.global_batch_size is the global batch, fixed whatever the world size (the
    # accumulation shrinks as dp grows); weak: it is one data-parallel rank's batch (micro batch
    # x accumulation), fixed, so the global batch is it x dp and grows with the world
    scaling: Scaling = Scaling.strong


@dataclass
class DDPConfig:
    # torch DDP's meaning: a bucket closes once it reaches the cap; null = torch's default
    # (25 MiB after a 1 MiB first bucket)
    bucket_cap_mb: Optional[float] = None
    strict_bucket_cap: bool = False  # minddp's alternative: a bucket never exceeds the cap
    shard_optimizer: bool = False  # ZeRO-1: optimizer states sharded over dp (reduce-scatter + all-gather)
    # each bucket's parameters stepped as soon as it is reduced (minddp.OverlappedOptimizer);
    # needs optim.grad_clip=0 and train.on_nonfinite=stop (no global norm before the step)
    optimizer_overlap: bool = False
    overlap: bool = True
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    reduce_op: str = "avg"
    compress: Optional[str] = None  # null | fp16 | bf16
    algorithm: str = "native"  # native | ring | rs_ag | tree | hierarchical (minddp.comm.collectives)
    debug: bool = False  # TORCH_DISTRIBUTED_DEBUG=DETAIL: collective fingerprints (or MINDDP_DEBUG=1)


@dataclass
class MeshConfig:
    tp: int = 1


@dataclass
class WandbConfig:
    # auto (online when logged in to W&B, else offline) | online | offline | disabled
    mode: WandbMode = WandbMode.auto
    project: str = "minddp"
    group: Optional[str] = None
    name: Optional[str] = None  # default: model, world size, layout, cap, variant and repeat
    repeat: int = 0  # which repeat of a configuration this run is (minddp scaling sets it)
    job_type: JobType = JobType.train  # train | report | bench: W&B's job type
    tags: List[str] = field(default_factory=list)  # W&B tags, besides the variant and the scaling mode
    # seconds an online run may take to start (W&B's own default: 90); past it the run logs offline
    init_timeout: float = 30.0


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
    cs.store(group="data", name="tokens_schema", node=TokensData)
    cs.store(group="optim", name="adamw_schema", node=OptimConfig)
    register_resolvers()


def register_resolvers() -> None:
    """Resolvers: one run directory that every rank of a job agrees on; model sizes from
    model.init_from's folder."""
    if not OmegaConf.has_resolver("minddp.run_dir"):
        OmegaConf.register_new_resolver("minddp.run_dir", default_run_dir)
    if not OmegaConf.has_resolver("minddp.init_from"):  # model.* sizes from model.init_from's folder
        from ..model.hf_gpt2 import folder_default

        OmegaConf.register_new_resolver("minddp.init_from", folder_default)


def default_run_dir(prefix: str = "outputs", resume: str | None = None) -> str:
    """One directory per job, the same on every rank.

    Each rank resolves `${now:}` itself, so timestamps can differ by a second
    between ranks; instead: MINDDP_RUN_DIR if set, else the run dir that
    `train.resume=<folder>` names (the run continues there), else torchrun's run id
    (equal on all ranks; it is --rdzv_id, e.g. the Slurm job id, on multi-node), else a
    timestamp (one process, nothing to agree with).
    """
    from .checkpoint.choice import resume_run_dir

    if os.environ.get("MINDDP_RUN_DIR"):
        return os.environ["MINDDP_RUN_DIR"]
    if resume and (folder := resume_run_dir(str(resume))) is not None:
        return str(folder)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"{prefix}/run-{os.environ['TORCHELASTIC_RUN_ID']}"
    # the process start time, not "now": Hydra resolves the sweep dir again for every job
    # of a -m sweep, and all of them belong in one folder
    return f"{prefix}/{_PROCESS_START:%Y-%m-%d/%H-%M-%S}"


def validate(cfg, world_size: int) -> dict:
    """Checks that need the world size; returns derived values. Raises ConfigError naming the fix."""
    from ..parallel.mesh import ParallelDims

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
    accum, global_batch = _batch_layout(t, dims.dp)
    if t.max_steps < 1:
        raise ConfigError(f"train.max_steps must be >= 1, got {t.max_steps}")
    if cfg.wandb.repeat < 0:
        raise ConfigError(f"wandb.repeat must be >= 0, got {cfg.wandb.repeat}")
    for problem in [*_unknown_keys(cfg), *_non_finite(cfg), *_setting_problems(cfg), *_data_problems(cfg)]:
        raise ConfigError(problem)
    return {"dims": dims, "accum": accum, "global_batch": global_batch}


def _batch_layout(t, dp: int) -> tuple[int, int]:
    """(accumulation, global batch). Strong scaling: train.global_batch_size is the global
    batch. Weak: it is one data-parallel rank's batch, so the global batch is it x dp."""
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("train.global_batch_size and train.micro_batch_size must be >= 1")
    if t.scaling == "weak":
        if t.global_batch_size % t.micro_batch_size:
            raise ConfigError(
                f"train.scaling=weak: train.global_batch_size={t.global_batch_size} (the batch of one "
                f"data-parallel rank) must be a multiple of train.micro_batch_size={t.micro_batch_size}")
        return t.global_batch_size // t.micro_batch_size, t.global_batch_size * dp
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp} = {per_step}; "
            "gradient accumulation must be a whole number of micro-batches. "
            f"Choose a global batch that is a multiple of {per_step} (or train.scaling=weak: "
            "the batch of one rank, the global batch growing with the world)."
        )
    return t.global_batch_size // per_step, t.global_batch_size


def _non_finite(cfg) -> list[str]:
    """Every float setting, wherever it is: NaN or inf is never a valid value (`x <= 0` and
    `x < lo` checks let NaN through, and inf passes them)."""
    def walk(node, key):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, f"{key}[{i}]")
        elif isinstance(node, float) and not math.isfinite(node):
            yield f"{key}={node} is not a finite number: give a finite value"
    return list(walk(OmegaConf.to_container(cfg, resolve=True), ""))


_SCHEMAS = {"train": TrainConfig, "ddp": DDPConfig, "mesh": MeshConfig, "wandb": WandbConfig,
            "optim": OptimConfig, "model": {"gpt": GPTModel, "mlp": MLPModel},
            "data": {"text": TextData, "tokens": TokensData, "synthetic": SyntheticData}}


def unknown_key_hint(full_key: str) -> str:
    """The fix for a key Hydra refused to override: the group option that has it ("add data=tokens"
    for data.dir), else the closest key ("did you mean train.max_steps?")."""
    section, _, key = full_key.partition(".")
    schema = _SCHEMAS.get(section) if key else None
    if schema is None:  # a misspelled section (trian.max_steps) or a top-level key
        top = [f.name for f in dataclasses.fields(Config)]
        close = difflib.get_close_matches(section, top, n=1)
        return f"did you mean {close[0]}{'.' + key if key else ''}?" if close \
            else f"there is {', '.join(top)}"
    options = schema if isinstance(schema, dict) else {"": schema}
    fields = {name: [f.name for f in dataclasses.fields(s)] for name, s in options.items()}
    owners = [name for name, names in fields.items() if name and key in names]
    if owners:
        where = " and ".join(f"{section}={o}" for o in owners)
        return f"it is a setting of {where}: add {section}={owners[0]}"
    close = difflib.get_close_matches(key, sorted({k for names in fields.values() for k in names}), n=1)
    return f"did you mean {section}.{close[0]}?" if close else "`python train.py --cfg job` lists them"


def value_hint(full_key: str) -> str:
    """The values a yes/no setting takes, where Optional adds null (its automatic choice:
    train.bf16=null was train.bf16=auto before 0.5)."""
    section, _, key = full_key.partition(".")
    schema = _SCHEMAS.get(section)
    if not isinstance(schema, type) or key not in {f.name for f in dataclasses.fields(schema)}:
        return ""
    field = next(f for f in dataclasses.fields(schema) if f.name == key)
    if field.type == "Optional[bool]":
        return f" (give {full_key}=true, false or null: null is the automatic choice, once spelled auto)"
    return " (give true or false)" if field.type == "bool" else ""


def _unknown_keys(cfg):
    """A key no schema has: Hydra's `+train.foo=1` adds one even to a typed config, and a key
    that nothing reads is a typo, not a setting."""
    known_top = {f.name for f in dataclasses.fields(Config)}
    for key in cfg:
        if key not in known_top:
            yield f"unknown key {key!r}: no such setting (top-level keys: {', '.join(sorted(known_top))})"
    for section, schema in _SCHEMAS.items():
        node = cfg.get(section)
        if isinstance(schema, dict):
            schema = schema.get(node.get("name")) if node is not None else None
        if node is None or schema is None:
            continue
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = (f"did you mean {section}.{close[0]}?" if close else
                        "`python train.py --cfg job` lists them")
                yield f"unknown key {section}.{key}: {section} has no such setting ({hint}); drop it"


def _data_problems(cfg):
    """Data settings that would fail later (a NumPy traceback) or train on nothing (a NaN
    validation loss with exit code 0)."""
    data, vocab = cfg.data, cfg.model.vocab_size
    if data.name == "synthetic":
        if not 1 <= data.modulus <= (vocab or 256):
            yield (f"data.modulus must be between 1 and the vocabulary ({vocab or 256}), got {data.modulus}: "
                   "tokens are in [0, modulus)")
        if data.num_samples < 1 or data.num_val < 1:
            yield (f"data.num_samples and data.num_val must be >= 1 (validation needs samples), got "
                   f"{data.num_samples} and {data.num_val}")
    if data.name == "text" and not (0 < data.val_fraction < 1 and data.max_bytes > 0):
        yield (f"data.val_fraction must be in (0, 1) and data.max_bytes > 0, got {data.val_fraction} and "
               f"{data.max_bytes}")


def _setting_problems(cfg):
    """Every check that needs no process: each yields one line that names the fix."""
    from ..engine.checks import option_problems
    from ..model.build import size_problem
    from ..model.hf_gpt2 import init_from_problems

    t, d, o, m, data = cfg.train, cfg.ddp, cfg.optim, cfg.model, cfg.data
    yield from option_problems(d.reduce_op, d.compress, d.bucket_cap_mb, d.shard_optimizer, d.algorithm,
                               d.find_unused_parameters, d.optimizer_overlap, config=True)  # the engine's
    if not cfg.wandb.init_timeout > 0:  # after _non_finite, which names nan and inf
        yield f"wandb.init_timeout must be > 0 seconds, got {cfg.wandb.init_timeout}"
    if d.optimizer_overlap and (o.grad_clip > 0 or t.on_nonfinite == "skip"):
        yield (f"ddp.optimizer_overlap=true needs optim.grad_clip=0 train.on_nonfinite=stop (add both; got "
               f"{o.grad_clip} and {t.on_nonfinite}): it steps each bucket before the global gradient norm "
               "is known, so it can neither clip by it nor skip a step already taken")
    if m.name == "gpt" and (m.n_head < 1 or m.n_embd % m.n_head):
        yield f"model.n_head={m.n_head} must divide model.n_embd={m.n_embd}"
    sizes = {"n_embd": m.n_embd, "block_size": m.block_size, "vocab_size": m.vocab_size, "n_layer": m.n_layer,
             **({"hidden": m.hidden} if m.name == "mlp" else {})}
    small = [f"model.{k}={v}" for k, v in sizes.items() if v is not None and v < 1]
    if small:
        yield (f"model.n_embd, model.block_size, model.vocab_size and model.n_layer must be >= 1 "
               f"(model.hidden too for model=mlp), got {', '.join(small)}")
    elif (too_big := size_problem(m, m.vocab_size or 256)) is not None:
        yield too_big
    if m.name == "gpt" and not 0 <= m.dropout < 1:
        yield f"model.dropout must be in [0, 1), got {m.dropout}"
    yield from init_from_problems(m)
    if not (o.lr > 0 and 0 <= o.min_lr <= o.lr):
        yield f"optim.lr must be > 0 and 0 <= optim.min_lr <= optim.lr, got lr={o.lr}, min_lr={o.min_lr}"
    if not (o.warmup_steps >= 0 and o.grad_clip >= 0 and o.weight_decay >= 0):
        yield "optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0"
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        yield f"optim.beta1 and optim.beta2 must be in [0, 1), got {o.beta1}, {o.beta2}"
    if t.log_every < 1:
        yield f"train.log_every must be >= 1, got {t.log_every}"
    if min(t.eval_every, t.ckpt_every, t.check_every, t.flight_recorder, t.max_skipped_steps) < 0:
        yield ("train.eval_every, train.ckpt_every, train.check_every, train.flight_recorder and "
               "train.max_skipped_steps must be >= 0")
    if t.ckpt_async not in (True, False, "auto"):
        yield f"train.ckpt_async must be auto, true or false, got {t.ckpt_async!r}"
    elif t.ckpt_async is True and t.ckpt_format != "dcp":
        yield ("train.ckpt_async=true writes in the background through torch.distributed.checkpoint: "
               "set train.ckpt_format=dcp too (or train.ckpt_async=false)")
    for key in ("ckpt_keep", "ckpt_keep_every"):
        if t[key] is not None and not t[key] >= 0:
            yield (f"train.{key}={t[key]} must be >= 0 (train.ckpt_keep: the newest N checkpoints kept, "
                   "train.ckpt_keep_every: steps whose checkpoint is kept forever; 0 or null: keep all / "
                   "none)")
    if t.flight_recorder > FLIGHT_RECORDER_MAX:
        yield (f"train.flight_recorder={t.flight_recorder} is more than {FLIGHT_RECORDER_MAX:,} collectives: "
               "torch keeps each one in memory (and hangs setting up more than 2**31); the last 2000 (the "
               "default) cover a hang")
    if not (t.timeout_s > 0 and t.init_timeout_s > 0):
        yield "train.timeout_s and train.init_timeout_s must be > 0"
    if not t.fault_sleep_s >= 0:
        yield f"train.fault_sleep_s must be >= 0, got {t.fault_sleep_s}"
    if t.profile_steps is not None and (len(t.profile_steps) != 2 or not 1 <= t.profile_steps[0]
                                        <= t.profile_steps[1]):
        yield f"train.profile_steps must be [first, last] with 1 <= first <= last, got {t.profile_steps}"
    if t.peak_tflops is not None and not t.peak_tflops > 0:
        yield f"train.peak_tflops must be > 0 (or null), got {t.peak_tflops}"
    if data.name == "tokens":
        if not data.dir:  # whether it is a folder: load_data_agreed, the same answer on every rank
            yield f"data.dir={data.dir!r} is not a folder: data=tokens needs data.dir=<folder of token files>"

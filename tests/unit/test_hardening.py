"""Long runs and faults through the real CLI: flat memory, a stuck rank, bad settings, soak."""


import pytest

from minddp.errors import ConfigError
from minddp.train.config import register, validate
from tests.conftest import compose_config

register()


@pytest.mark.parametrize("override,message", [
    ("ddp.bucket_cap_mb=0", "ddp.bucket_cap_mb must be positive"),
    ("ddp.compress=int8", "ddp.compress must be null, fp16 or bf16"),
    ("ddp.algorithm=tree3", "ddp.algorithm must be one of"),
    ("model.n_head=3", "model.n_head=3 must divide model.n_embd=128"),
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("optim.min_lr=1", "0 <= optim.min_lr <= optim.lr"),
    ("optim.beta2=1.5", "optim.beta1 and optim.beta2 must be in [0, 1)"),
    ("train.log_every=0", "train.log_every must be >= 1"),
    ("train.timeout_s=0", "train.timeout_s and train.init_timeout_s must be > 0"),
    ("train.peak_tflops=-3", "train.peak_tflops must be > 0"),
    ("model.dropout=1.0", "model.dropout must be in [0, 1)"),
    ("data=tokens", "data=tokens needs data.dir"),
])
def test_every_setting_checkable_without_processes_is_checked_in_validate(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        validate(compose_config(override), 1)


@pytest.mark.parametrize("override,choices", [
    ("train.device=tpu", "[auto, cpu, cuda]"), ("train.scaling=linear", "[strong, weak]"),
    ("train.on_nonfinite=ignore", "[skip, stop]"), ("wandb.mode=cloud", "[auto, online, offline, disabled]"),
    ("wandb.job_type=eval", "[train, report, bench]"),
    ("data=tokens data.dtype=int8", "[auto, uint8, uint16, uint32]"),
    ("train.bf16=maybe", "not a valid bool"), ("train.tf32=sometimes", "not a valid bool"),
])
def test_a_setting_with_fixed_choices_is_refused_while_hydra_composes(override, choices):
    """OmegaConf checks the schema's Enum and bool fields: no hand-written check in validate()."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose_config(*override.split())
    assert choices in str(e.value.__cause__)


def test_choices_read_as_their_strings_and_save_as_them():
    cfg = compose_config("train.scaling=weak", "train.bf16=true")
    assert cfg.train.scaling == "weak" and f"{cfg.train.scaling}-scaling" == "weak-scaling"
    default = compose_config().train
    assert cfg.train.bf16 is True and default.bf16 is None and default.tf32 is True
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # what checkpoints and W&B hold
    assert type(plain["train"]["scaling"]) is str and type(plain["wandb"]["mode"]) is str


def test_the_defaults_validate_and_keep_the_global_batch_fixed():
    one, two = validate(compose_config(), 1), validate(compose_config(), 2)  # global batch 32, micro-batch 8
    assert (one["dims"].dp, one["accum"]) == (1, 4)
    assert (two["dims"].dp, two["accum"]) == (2, 2)  # accumulation divided by the world size
    assert validate(compose_config("mesh.tp=2"), 2)["dims"].tp == 2

"""Issue 28's configuration edges: a key no schema has, settings that would fail later or
train on nothing, a refused run that leaves the run dir as it was, a read-only run dir."""


import pytest

from minddp.errors import ConfigError
from minddp.train.config import register, validate
from tests.conftest import compose_config

register()


@pytest.mark.parametrize("overrides,message", [
    (["+train.foo=1"], "unknown key train.foo: train has no such setting"),
    (["+train.max_stepz=3"], "did you mean train.max_steps?"),
    (["+foo=1"], "unknown key 'foo': no such setting"),
    (["model=mlp", "+model.n_head=4"], "unknown key model.n_head: model has no such setting"),
    (["data=synthetic", "data.modulus=0"], "data.modulus must be between 1 and the vocabulary (256), got 0"),
    (["data=synthetic", "data.num_val=0"], "data.num_samples and data.num_val must be >= 1"),
    (["model.vocab_size=0"], "model.vocab_size and model.n_layer must be >= 1"),
    (["data.val_fraction=0"], "data.val_fraction must be in (0, 1)"),
    (["wandb.init_timeout=0"], "wandb.init_timeout must be > 0 seconds, got 0.0"),
    (["wandb.init_timeout=nan"], "wandb.init_timeout=nan is not a finite number"),
    (["wandb.init_timeout=inf"], "wandb.init_timeout=inf is not a finite number"),
])
def test_settings_that_would_fail_later_or_train_on_nothing_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_synthetic_modulus_within_a_larger_vocabulary_is_accepted():
    validate(compose_config("data=synthetic", "model.vocab_size=1000", "data.modulus=500"), 1)


@pytest.mark.parametrize("overrides,message", [
    (["model=mlp", "model.hidden=-1"], "got model.hidden=-1"),
    (["model=mlp", "model.hidden=0"], "got model.hidden=0"),  # trained a zero-width model, exit 0
    (["model.n_layer=" + str(10**30)], "1.98e+35 parameters"),
    (["model.vocab_size=100000000000"], "a vocabulary of 100000000000 has 1.28e+13 parameters"),
    (["model=mlp", "model.n_embd=" + str(10**12)], "more than this machine's"),
    (["train.flight_recorder=" + str(10**30)], "is more than 1,000,000 collectives"),
])
def test_sizes_that_cannot_be_built_are_refused_with_the_number(overrides, message):
    """Issue 45.10: each was a traceback, a zero-width model trained to exit 0, or a build or
    flight-recorder set-up that never ends."""
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_size_check_counts_the_parameters_the_model_has_and_guards_the_data_vocabulary():
    import torch

    from minddp.model.build import build_model, parameter_count

    shapes = [(), ("model.bias=false", "model.n_layer=3"), ("model=mlp",), ("model=mlp", "model.n_layer=1")]
    for overrides in shapes:
        m = compose_config(*overrides).model
        with torch.device("meta"):
            built = sum(p.numel() for p in build_model(m, 300).parameters())
        assert parameter_count(m, 300) == built, overrides
    with pytest.raises(ConfigError, match="a vocabulary of 100000000000"):  # from the data, after validate
        build_model(compose_config().model, 10**11)

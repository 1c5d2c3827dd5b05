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
])
def test_settings_that_would_fail_later_or_train_on_nothing_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(*overrides), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_synthetic_modulus_within_a_larger_vocabulary_is_accepted():
    validate(compose_config("data=synthetic", "model.vocab_size=1000", "data.modulus=500"), 1)

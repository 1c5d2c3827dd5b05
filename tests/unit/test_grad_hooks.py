"""minddp.engine.hooks.GradHooks: exactly the parameters it is given carry a hook, and once the
wrapper let its module go (close) nothing is hooked again, whatever the reducer chooses later."""

import torch

from minddp.engine.hooks import GradHooks


def _calls_after_backward(hooks: GradHooks, params) -> list[int]:
    (params[0] * params[1]).sum().backward()
    return hooks.calls


def test_set_replaces_the_hooked_parameters_and_close_is_for_good():
    params = [torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)]
    hooks = GradHooks(params)
    hooks.calls = []
    fn = lambda i: (lambda p: hooks.calls.append(i))  # noqa: E731
    hooks.set({0: fn(0), 1: fn(1)})
    assert hooks.hooked == 2 and sorted(_calls_after_backward(hooks, params)) == [0, 1]
    hooks.calls = []
    hooks.set({1: fn(1)})  # one per bucket: the others go
    assert hooks.hooked == 1 and _calls_after_backward(hooks, params) == [1]
    hooks.close()
    hooks.calls = []
    hooks.set({0: fn(0), 1: fn(1)})  # a later choice after the wrapper was dropped
    assert hooks.hooked == 0 and _calls_after_backward(hooks, params) == []

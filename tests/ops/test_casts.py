"""fitdqn.ops.casts: a parameter cast once per scope while it is unchanged; everything else cast as ``Tensor.to``."""

from __future__ import annotations

import threading

import torch
from torch import nn

from fitdqn.ops.casts import cast, casts_once, derived_once


def test_outside_a_scope_every_cast_is_new():
    weight = nn.Parameter(torch.randn(4, 3))
    assert cast(weight, torch.bfloat16) is not cast(weight, torch.bfloat16)
    assert cast(weight, torch.float32) is weight  # no cast needed: the tensor itself, as Tensor.to gives


def test_a_parameter_is_cast_once_until_it_changes():
    weight = nn.Parameter(torch.randn(4, 3))
    with casts_once(), torch.no_grad():
        first = cast(weight, torch.bfloat16)
        assert cast(weight, torch.bfloat16) is first
        assert torch.equal(first, weight.to(torch.bfloat16)) and first.dtype == torch.bfloat16
        assert cast(weight, torch.float16) is not first  # another dtype, another copy
        weight.mul_(2.0)  # in place (an optimizer step): its version moves, so a fresh copy
        second = cast(weight, torch.bfloat16)
        assert second is not first and torch.equal(second, weight.to(torch.bfloat16))
    with torch.no_grad():
        assert cast(weight, torch.bfloat16) is not second  # the scope is closed


def test_activations_and_tracked_casts_are_not_kept():
    weight = nn.Parameter(torch.randn(4, 3))
    activation = torch.randn(4, 3)  # not a parameter
    with casts_once():
        assert cast(activation, torch.bfloat16) is not cast(activation, torch.bfloat16)
        tracked = cast(weight, torch.bfloat16)  # grad mode on, weight requires grad: autograd must see it
        assert tracked.grad_fn is not None and cast(weight, torch.bfloat16) is not tracked


def test_nested_scopes_share_the_outer_one_and_threads_their_own():
    weight = nn.Parameter(torch.randn(4, 3))
    seen = []
    with casts_once(), torch.no_grad():
        first = cast(weight, torch.bfloat16)
        with casts_once():
            assert cast(weight, torch.bfloat16) is first
        assert cast(weight, torch.bfloat16) is first  # the inner exit left the outer scope open

        def other_thread():
            with torch.no_grad():
                seen.append(cast(weight, torch.bfloat16))

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen[0] is not first


def test_parameters_cast_up_front_are_handed_out_until_they_change():
    weights = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    counter = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)  # not floating: skipped
    with casts_once([*weights, counter], torch.bfloat16), torch.no_grad():
        first = [cast(w, torch.bfloat16) for w in weights]
        for w, copy in zip(weights, first, strict=True):
            assert copy.dtype == torch.bfloat16 and torch.equal(copy, w.to(torch.bfloat16))  # bit for bit
            assert cast(w, torch.bfloat16) is copy
        weights[0].mul_(2.0)  # changed after the up-front cast: cast afresh
        assert torch.equal(cast(weights[0], torch.bfloat16), weights[0].to(torch.bfloat16))
        assert cast(weights[0], torch.bfloat16) is not first[0]
        assert cast(counter, torch.float32).dtype == torch.float32


def test_a_derived_tensor_is_built_once_and_carries_gradients_to_the_pass_that_needs_them():
    layer = nn.Linear(3, 4)
    builds = []

    def build():
        builds.append(1)
        return (layer.weight * 2.0,)

    with casts_once():
        with torch.no_grad():  # the first pass needs no gradients: built with them all the same, handed out detached
            (first,) = derived_once(layer, build)
            assert first.grad_fn is None and torch.equal(first, layer.weight * 2.0)
            assert cast(first, torch.bfloat16) is cast(first, torch.bfloat16)  # one kept copy
        (tracked,) = derived_once(layer, build)  # grad mode: the tracked one, not built again
        assert len(builds) == 1 and tracked.grad_fn is not None
        tracked.sum().backward()
        assert torch.equal(layer.weight.grad, torch.full_like(layer.weight, 2.0))
        with torch.no_grad():
            layer.weight.add_(1.0)  # changed: built afresh
            (second,) = derived_once(layer, build)
        assert len(builds) == 2 and torch.equal(second, layer.weight * 2.0)
    assert derived_once(layer, build)[0].grad_fn is not None and len(builds) == 3  # outside a scope: every call

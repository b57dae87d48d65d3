"""kiln.utils.host_copy: the snapshot an asynchronous checkpoint writes must hold the bytes of the
moment it was taken, keep shared storages shared, and keep the shape of the tree."""

from __future__ import annotations

import collections
import io
import threading

import pytest
import torch

from kiln.utils.host_copy import HostStaging, host_copy


def test_the_copy_does_not_change_when_the_originals_do():
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    copy_w, copy_s = host_copy(weight), host_copy(state)
    weight.add_(100)
    state["state"][0]["exp_avg"].mul_(7)
    state["state"][0]["step"] += 1
    state["param_groups"][0]["lr"] = 0.5  # an optimizer's state_dict() hands out its live dicts
    assert torch.equal(copy_w, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(copy_s["state"][0]["exp_avg"], torch.ones(4)) and copy_s["state"][0]["step"].item() == 3.0
    assert copy_s["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_shared_storages_stay_shared_at_the_same_offsets_shape_and_strides():
    base = torch.arange(12, dtype=torch.float32)
    tree = {
        "a": base,
        "b": base[2:8].view(2, 3),
        "c": base.view(3, 4).t(),
        "tied": base.view(-1),
    }  # state_dict() gives each tied name its own tensor
    copy = host_copy(tree)
    for key in tree:
        assert torch.equal(copy[key], tree[key]), key
        assert copy[key].stride() == tree[key].stride() and copy[key].storage_offset() == tree[key].storage_offset()
        assert copy[key].untyped_storage().data_ptr() == copy["a"].untyped_storage().data_ptr()
    assert copy["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    # torch.save lays out the same storages: one storage, written once, as in a synchronous save
    a, b = io.BytesIO(), io.BytesIO()
    torch.save(tree, a)
    torch.save(copy, b)
    assert a.getvalue() == b.getvalue()


def test_distinct_storages_stay_distinct_even_when_empty():
    tree = [torch.zeros(3), torch.zeros(3), torch.empty(0), torch.empty(0, 2, dtype=torch.float16)]
    copy = host_copy(tree)
    assert isinstance(copy, list) and len(copy) == 4
    assert copy[0].untyped_storage().data_ptr() != copy[1].untyped_storage().data_ptr()
    a, b = io.BytesIO(), io.BytesIO()
    torch.save(tree, a)
    torch.save(copy, b)
    assert a.getvalue() == b.getvalue()  # two empty storages are two in the file, as in a synchronous save
    copy[0].add_(1)
    assert torch.equal(copy[1], torch.zeros(3))
    assert copy[3].shape == (0, 2) and copy[3].dtype == torch.float16


def test_containers_keep_their_types_and_plain_values_pass_through():
    Point = collections.namedtuple("Point", "x y")
    ordered = collections.OrderedDict([("w", torch.ones(2)), ("n", 3)])
    tree = {"ordered": ordered, "tuple": (torch.ones(1), "s"), "named": Point(1, 2), "none": None}
    copy = host_copy(tree)
    tree["tuple"][0].add_(1)  # a tuple's tensors are copied too
    assert torch.equal(copy["tuple"][0], torch.ones(1))
    assert type(copy["ordered"]) is collections.OrderedDict and list(copy["ordered"]) == ["w", "n"]
    assert copy["ordered"] is not ordered and copy["ordered"]["n"] == 3
    assert type(copy["tuple"]) is tuple and copy["tuple"][1] == "s" and torch.equal(copy["tuple"][0], torch.ones(1))
    assert copy["named"] is tree["named"] and copy["none"] is None


def test_a_container_met_twice_is_copied_once():
    inner = {"x": torch.ones(2)}
    copy = host_copy({"a": inner, "b": inner})
    assert copy["a"] is copy["b"] and copy["a"] is not inner


def test_a_tensor_that_requires_grad_is_copied_detached():
    param = torch.nn.Parameter(torch.ones(3))
    copy = host_copy({"p": param})["p"]
    assert not copy.requires_grad and type(copy) is torch.Tensor and torch.equal(copy, torch.ones(3))


def test_staging_reuses_the_previous_copy_s_buffers_and_copies_the_new_values():
    weight, moment = torch.ones(4), torch.zeros(3)
    staging = HostStaging()
    first = staging.copy({"w": weight, "m": moment})
    weight.add_(1)
    second = staging.copy({"w": weight, "m": moment})
    assert torch.equal(second["w"], torch.full((4,), 2.0)) and torch.equal(second["m"], torch.zeros(3))
    assert second["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr()  # no new allocation
    assert second["m"].untyped_storage().data_ptr() == first["m"].untyped_storage().data_ptr()
    assert second["w"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()


def test_staging_allocates_for_a_new_or_resized_storage_and_drops_buffers_it_no_longer_uses():
    a, b = torch.ones(4), torch.ones(2)
    staging = HostStaging()
    first = staging.copy([a, b])
    c = torch.ones(8)  # a storage not seen before: a fresh buffer
    second = staging.copy([a, c])
    assert second[0].untyped_storage().data_ptr() == first[0].untyped_storage().data_ptr()
    assert second[1].untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in first}
    assert torch.equal(second[1], torch.ones(8))
    third = staging.copy([b])  # b's buffer was let go by the second copy, which did not use it
    assert third[0].untyped_storage().data_ptr() != first[1].untyped_storage().data_ptr()
    assert torch.equal(third[0], torch.ones(2))


@pytest.fixture
def held(monkeypatch):
    """The deferred copies wait for `release` (an event, not a delay) before they are made."""
    release = threading.Event()
    real = HostStaging._fill

    def fill(self, deferred):  # type: ignore[no-untyped-def]
        assert release.wait(30)
        real(self, deferred)

    monkeypatch.setattr(HostStaging, "_fill", fill)
    return release


def test_a_deferred_copy_makes_the_optimizer_step_wait_and_holds_the_values_from_before_it(held):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    staging = HostStaging()
    copy = staging.copy(model.state_dict(), later=lambda t: True)
    staging.guard(optimizer)
    staging.guard(optimizer)  # once per optimizer: a second guard adds no second hook
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    order: list[str] = []
    optimizer.register_step_post_hook(lambda *_: order.append("stepped"))
    releaser = threading.Thread(target=lambda: (order.append("released"), held.set()))
    releaser.start()
    optimizer.step()  # waits for the copy: without the guard it would step before the copy is made
    releaser.join()
    assert order == ["released", "stepped"] and staging.error is None
    for name, value in before.items():
        assert torch.equal(copy[name], value), name
    assert not torch.equal(model.weight, before["weight"])


def test_a_tensor_changed_while_its_copy_is_pending_fails_the_copy_and_others_are_copied_at_once(held):
    weight, running = torch.ones(4), torch.zeros(2)
    staging = HostStaging()
    copy = staging.copy({"w": weight, "r": running}, later=lambda t: t is not running and t.numel() == 4)
    running.add_(5)  # copied at once: the copy keeps the value it had
    weight.add_(1)  # pending: changed before it was copied
    held.set()
    staging.wait()
    assert torch.equal(copy["r"], torch.zeros(2))
    assert staging.error is not None and "shape (4,) was changed in place" in staging.error
    staging.copy({"w": weight})  # a later copy starts clean
    assert staging.error is None


def test_the_next_copy_waits_for_the_deferred_copy_in_flight(held):
    """One copy at a time: the next reuses the buffers the deferred thread is filling."""
    weight = torch.ones(4)
    staging = HostStaging()
    first = staging.copy({"w": weight}, later=lambda t: True)
    second: list = []
    nxt = threading.Thread(target=lambda: second.append(staging.copy({"w": weight})))
    nxt.start()
    nxt.join(0.5)
    assert nxt.is_alive()  # held behind the deferred copy (a copy that does not wait returns at once)
    held.set()
    nxt.join()
    assert torch.equal(first["w"], torch.ones(4))
    assert second[0]["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr()

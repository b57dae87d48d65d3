"""The stores and helpers the lease tests share (test_remote_lease.py, test_lease_lost.py): a server of
each store with conditional writes, one per module (tests/checkpoint/stores.py), a URL per test, and
another run's hold on the same lock."""

from __future__ import annotations

import json
import time

import pytest

from kiln.engine.checkpoint.in_use import LOCK
from kiln.engine.checkpoint.lease import Lease
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from tests.checkpoint.checkpoint_helpers import train
from tests.checkpoint.stores import STORES, store_endpoint


@pytest.fixture(scope="module", params=STORES)
def scheme(request) -> str:  # type: ignore[no-untyped-def]
    return str(request.param)


@pytest.fixture(scope="module")
def bucket(request) -> str:  # type: ignore[no-untyped-def]
    """A bucket per module: moto keeps its buckets in the process, past the server that made them."""
    return "kiln-" + request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")


@pytest.fixture(scope="module")
def options(scheme, bucket):  # type: ignore[no-untyped-def]
    """The storage options of a server of the store, one per module."""
    with store_endpoint(scheme, bucket) as found:
        yield found


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A local output_dir with complete checkpoints at steps 5 and 10."""
    out = str(tmp_path_factory.mktemp("local") / "out")
    train(out, {"max_steps": 10, "save_steps": 5})
    return out


@pytest.fixture
def url(request, scheme, bucket) -> str:  # type: ignore[no-untyped-def]
    return f"{scheme}://{bucket}/{request.node.name.replace('[', '-').rstrip(']')}"


def holder_of(store: RemoteCheckpoints) -> dict:  # type: ignore[type-arg]
    store.fs.invalidate_cache()
    return json.loads(store.fs.cat_file(f"{store.root}/{LOCK}"))


def plant(store: RemoteCheckpoints, renewed: float, lease: float = 300.0) -> None:
    """A lock of a run on another host, last renewed at `renewed`."""
    info = {"pid": 4242, "host": "node-7", "started": renewed - 50, "renewed": renewed, "lease": lease, "token": "x"}
    store.fs.pipe_file(f"{store.root}/{LOCK}", json.dumps(info).encode())


def rival(store: RemoteCheckpoints, ahead: float = 1000.0) -> Lease:
    """Another run's hold on the same lock, whose clock says `ahead` seconds later (so it sees the
    current holder's lease run out)."""
    return Lease(store.fs, f"{store.root}/{LOCK}", store.url, clock=lambda: time.time() + ahead)

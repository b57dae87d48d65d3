"""What the gloo workers that train against a store's test server share (remote_*_worker.py): the store's
options, and a world whose every rank fakes a node of its own. Imports nothing heavy: the workers call it
before torch."""

from __future__ import annotations

import os
from typing import Any


def store_options(endpoint: str, scheme: str = "s3") -> dict[str, Any]:
    """The client's options for the server of store `scheme` that the test started at `endpoint`: s3fs's
    for moto's S3 server, gcsfs's for tests/checkpoint/gcs_server.py's (whose buckets a worker's gcsfs is
    told are standard ones, as in the test: gcs_server.standard_bucket_layout)."""
    if scheme == "gs":
        from tests.checkpoint.gcs_server import gcs_options, standard_bucket_layout

        standard_bucket_layout()  # for the worker's life
        return gcs_options(endpoint)
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"},
    }


def endpoint_of(options: dict[str, Any]) -> str:
    """The endpoint a store's options (tests/checkpoint/stores.py's store_endpoint) reach: what a worker
    hands to store_options."""
    return str(options["endpoint_url"] if "endpoint_url" in options else options["client_kwargs"]["endpoint_url"])


def one_process_per_node() -> int:
    """Make this rank node RANK's only process (local rank 0, 2 nodes), as a 2-node job would see it; returns RANK."""
    rank = int(os.environ["RANK"])
    os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": "2"})
    return rank

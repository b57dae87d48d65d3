"""What the gloo workers that train against moto's S3 server share (remote_*_worker.py): the store's
options, and a world whose every rank fakes a node of its own. Imports nothing heavy: the workers call it
before torch."""

from __future__ import annotations

import os


def store_options(endpoint: str) -> dict[str, object]:
    """s3fs's options for the moto server the test started at `endpoint`."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"},
    }


def one_process_per_node() -> int:
    """Make this rank node RANK's only process (local rank 0, 2 nodes), as a 2-node job would see it; returns RANK."""
    rank = int(os.environ["RANK"])
    os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": "2"})
    return rank

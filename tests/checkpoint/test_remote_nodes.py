"""A sharded checkpoint (FSDP's DCP) saved to an S3 URL from two nodes that share no disk, and resumed
from the store on two fresh nodes (tests/checkpoint/remote_nodes_worker.py: a 2-process gloo world
faking two nodes, each with its own staging folder; moto's server through s3fs): each node uploads its
own shards, the COMPLETE marker goes up after every node's files and lists them all, and the resumed
run ends bit for bit where the same run without a store and uninterrupted does."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln.engine.checkpoint.integrity import MARKER
from tests.checkpoint.s3_server import s3_endpoint
from tests.checkpoint.test_cross_format_resume import saved_weights
from tests.installed import requires

pytestmark = [
    pytest.mark.distributed,
    requires("s3fs", "pip install kiln[s3]"),
    requires("moto", "pip install moto[server]"),
]

BUCKET = "kiln-nodes"


def test_two_nodes_save_a_sharded_checkpoint_to_s3_and_resume_it_bitwise(tmp_path):
    from kiln.engine.checkpoint.remote import RemoteCheckpoints
    from tests.world import run_world

    url = f"s3://{BUCKET}/run"
    with s3_endpoint(BUCKET) as s3:
        run_world(
            os.path.join(os.path.dirname(__file__), "remote_nodes_worker.py"),
            tmp_path,
            url,
            s3["client_kwargs"]["endpoint_url"],
            timeout=600,
        )
        got = {}
        for variant in ("sync", "async"):
            store = RemoteCheckpoints(f"{url}-{variant}", s3)
            assert [name for _, name in store.steps()] == ["checkpoint-4", "checkpoint-6"]  # total_limit=2
            marker = json.loads(store.fs.cat_file(f"{store.root}/checkpoint-4/{MARKER}"))
            shards = sorted(f for f in marker["files"] if f.endswith(".distcp"))
            assert len(shards) == 2, marker["files"]  # node 0's shard and node 1's
            assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(marker["files"])
            got[variant] = saved_weights(store.download("checkpoint-6", str(tmp_path / "check" / variant)))
    puts = [(dst, t) for rank in (0, 1) for dst, t in json.loads((tmp_path / f"puts_{rank}.json").read_text())]
    for variant in ("sync", "async"):
        for step in (4, 6):
            files = [t for dst, t in puts if f"-{variant}/checkpoint-{step}/" in dst and not dst.endswith(MARKER)]
            markers = [t for dst, t in puts if dst.endswith(f"-{variant}/checkpoint-{step}/{MARKER}")]
            assert markers and min(markers) >= max(files)  # a marker only after every node's files
    uploaded = {dst.rsplit("/", 1)[-1] for dst, _ in json.loads((tmp_path / "puts_1.json").read_text())}
    assert any(name.startswith("__1_") for name in uploaded), uploaded  # node 1 uploaded its own shard
    want = saved_weights(str(tmp_path / "straight" / "checkpoint-6"))
    for variant, weights in got.items():
        assert want.keys() == weights.keys()
        for key, value in want.items():
            assert torch.equal(value, weights[key]), (variant, key)

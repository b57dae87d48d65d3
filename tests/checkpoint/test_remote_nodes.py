"""A sharded checkpoint (FSDP's DCP) saved to an S3 URL from two nodes that share no disk, and resumed
from the store on two fresh nodes (tests/checkpoint/remote_nodes_worker.py: a 2-process gloo world
faking two nodes, each with its own staging folder; moto's server through s3fs): each node uploads its
own shards, the COMPLETE marker goes up after every node's files and lists them all, and the resumed
run ends bit for bit where the same run without a store and uninterrupted does."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
import torch

from kiln.engine.checkpoint.atomic import publish_folder
from kiln.engine.checkpoint.integrity import MARKER
from kiln.engine.checkpoint.lease import Lease, LeaseLost
from kiln.engine.checkpoint.remote import RemoteCheckpoints
from kiln.engine.checkpoint.remote_run import publish_from_nodes
from kiln.engine.checkpoint.resume import ResumeError
from tests.checkpoint.s3_server import s3_endpoint
from tests.checkpoint.test_cross_format_resume import saved_weights
from tests.installed import requires

pytestmark = [requires("s3fs", "pip install kiln[s3]"), requires("moto", "pip install moto[server]")]

BUCKET = "kiln-nodes"


@pytest.mark.distributed
def test_two_nodes_save_a_sharded_checkpoint_to_s3_and_resume_it_bitwise(s3, tmp_path):
    from kiln.engine.checkpoint.remote import RemoteCheckpoints
    from tests.world import run_world

    url = f"s3://{BUCKET}/run"
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


@pytest.mark.distributed
def test_an_async_checkpoint_of_two_nodes_goes_up_once_written_not_at_the_next_save(s3, tmp_path):
    """save.async_save: the nodes' upload needs the ranks' collectives, so it runs on the training thread,
    at the first step boundary where every rank's background write has finished; the end of fit and a
    SIGTERM (save.on_preemption) wait for the write in flight and upload it before fit returns
    (tests/checkpoint/remote_nodes_async_worker.py: 2 gloo processes faking two nodes)."""
    from tests.world import run_world

    url = f"s3://{BUCKET}/async-nodes"
    worker = os.path.join(os.path.dirname(__file__), "remote_nodes_async_worker.py")
    run_world(worker, tmp_path, url, s3["client_kwargs"]["endpoint_url"], timeout=300)
    assert json.loads((tmp_path / "seen_at_4.json").read_text()) == ["checkpoint-2"]  # before step 4's save
    assert [name for _, name in RemoteCheckpoints(url, s3).steps()] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [name for _, name in RemoteCheckpoints(f"{url}-sigterm", s3).steps()] == ["checkpoint-3"]
    for rank in (0, 1):
        uploads = [tuple(u) for u in json.loads((tmp_path / f"uploads_{rank}.json").read_text())]
        assert uploads[-2:] == [("checkpoint-6", "_finish"), ("checkpoint-3", "_save_and_stop")], uploads
        assert json.loads((tmp_path / f"preempted_{rank}.json").read_text()) == 3


@pytest.mark.distributed
def test_a_run_killed_before_the_nodes_upload_resumes_from_the_checkpoint_they_hold(s3, tmp_path):
    """save.async_save on two nodes: a kill after every node's write of checkpoint-4 but before the step
    boundary that uploads it leaves checkpoint-4 in the staging folders only; the resume on those nodes
    uploads it first, resumes from it, and ends bit for bit where the uninterrupted run ends
    (tests/checkpoint/remote_nodes_stranded_worker.py: 2 gloo processes faking two nodes)."""
    from tests.world import run_world

    url = f"s3://{BUCKET}/stranded-kill"
    worker = os.path.join(os.path.dirname(__file__), "remote_nodes_stranded_worker.py")
    endpoint = s3["client_kwargs"]["endpoint_url"]
    killed = run_world(worker, tmp_path, url, endpoint, "kill", timeout=300, check=False)
    assert killed.returncode != 0 and json.loads((tmp_path / "store_at_kill.json").read_text()) == ["checkpoint-2"]
    for node in (0, 1):  # each node's part of checkpoint-4, sealed
        assert os.path.isfile(tmp_path / f"node{node}" / "checkpoint-4" / MARKER), killed.stderr[-3000:]
    run_world(worker, tmp_path, url, endpoint, "resume", timeout=600)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"loaded_{rank}.json").read_text()) == ["checkpoint-4"]
    store = RemoteCheckpoints(url, s3)
    assert [name for _, name in store.steps()] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    marker = json.loads(store.fs.cat_file(f"{store.root}/checkpoint-4/{MARKER}"))
    assert len([f for f in marker["files"] if f.endswith(".distcp")]) == 2  # node 0's shard and node 1's
    want = saved_weights(str(tmp_path / "straight" / "checkpoint-6"))
    got = saved_weights(store.download("checkpoint-6", str(tmp_path / "check")))
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(value, got[key]), key


# -- the nodes' protocol (remote_run.publish_from_nodes) in one process: a thread per node ----------------
NODE_FILES = {  # what each node's staging folder holds of checkpoint-4: its shards, and files every node writes
    0: {"fsdp_dcp/.metadata": b"meta", "fsdp_dcp/__0_0.distcp": b"shard zero", "trainer_state.json": b'{"node": 0}'},
    1: {"fsdp_dcp/__1_0.distcp": b"shard one", "trainer_state.json": b'{"node": 1}'},
}


@pytest.fixture(scope="module")
def s3():  # type: ignore[no-untyped-def]
    with s3_endpoint(BUCKET) as options:
        yield options


def node_folders(root, step: int = 4) -> list[str]:  # type: ignore[no-untyped-def]
    """Each node's sealed part of checkpoint-<step> (NODE_FILES), as its writer leaves it in its own staging
    folder."""
    folders = []
    for node, files in NODE_FILES.items():
        tmp, final = root / f"node{node}" / f".checkpoint-{step}.tmp", root / f"node{node}" / f"checkpoint-{step}"
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        publish_folder(str(tmp), str(final), {"version": 2, "step": step, "format": "fsdp-sharded"}, None)
        folders.append(str(final))
    return folders


def two_nodes(url: str, s3, folders: list[str], stores: list[RemoteCheckpoints] | None = None) -> list[object]:  # type: ignore[no-untyped-def]
    """publish_from_nodes on two ranks at once (threads, an all-gather built on a barrier); what each
    rank returned ("ok") or raised."""
    stores = stores or [RemoteCheckpoints(url, s3) for _ in folders]
    slots: list[object] = [None, None]
    barrier = threading.Barrier(2)

    def gather_for(rank: int):  # type: ignore[no-untyped-def]
        def gather(obj):  # type: ignore[no-untyped-def]
            barrier.wait(30)
            slots[rank] = obj
            barrier.wait(30)
            out = list(slots)
            barrier.wait(30)
            return out

        return gather

    outcomes: list[object] = [None, None]

    def node(rank: int) -> None:
        try:
            publish_from_nodes(stores[rank], folders[rank], rank, None, None, gather_for(rank), None)
            outcomes[rank] = "ok"
        except Exception as err:
            outcomes[rank] = err

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def test_each_file_goes_up_once_from_its_first_holder_and_the_marker_lists_every_node(s3, tmp_path):
    url = f"s3://{BUCKET}/one-marker"
    stores = [RemoteCheckpoints(url, s3) for _ in (0, 1)]

    def only_rank_0(*args: object) -> None:
        raise AssertionError("only global rank 0 withdraws and writes the marker")

    stores[1].withdraw = stores[1].seal = only_rank_0  # type: ignore[method-assign]
    assert two_nodes(url, s3, node_folders(tmp_path), stores) == ["ok", "ok"]
    assert stores[0].steps() == [(4, "checkpoint-4")]
    marker = json.loads(stores[0].fs.cat_file(f"{stores[0].root}/checkpoint-4/{MARKER}"))
    assert sorted(marker["files"]) == sorted({**NODE_FILES[0], **NODE_FILES[1]})
    got = stores[0].download("checkpoint-4", str(tmp_path / "resumed"))  # digests checked
    assert open(os.path.join(got, "trainer_state.json"), "rb").read() == b'{"node": 0}'  # rank 0's copy, the one listed
    assert open(os.path.join(got, "fsdp_dcp", "__1_0.distcp"), "rb").read() == b"shard one"


def test_a_node_whose_upload_fails_leaves_no_marker_and_a_warning(s3, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/one-node-fails"
    stores = [RemoteCheckpoints(url, s3, sleep=lambda s: None) for _ in (0, 1)]
    folders = node_folders(tmp_path)
    assert two_nodes(url, s3, folders, stores) == ["ok", "ok"]  # checkpoint-4 on the store, then saved again
    put = stores[0].fs.put_file

    def node_one_cut_off(src: str, dst: str, **kw: object) -> None:
        if "node1" in src:
            raise ConnectionError("connection reset by peer")
        put(src, dst, **kw)

    monkeypatch.setattr(stores[0].fs, "put_file", node_one_cut_off)  # one cached file system for both
    with pytest.warns(
        UserWarning,
        match=r"checkpoint-4 was saved in the nodes' staging folders but not uploaded to .*: Uploading "
        r"fsdp_dcp/__1_0.distcp of checkpoint-4 .* failed after 5 tries \(ConnectionError",
    ):
        assert two_nodes(url, s3, folders, stores) == ["ok", "ok"]
    assert stores[0].steps() == []  # the earlier marker was withdrawn first: never over half-replaced files


def test_a_lost_lease_stops_every_node_with_one_sentence(s3, tmp_path):
    url = f"s3://{BUCKET}/lost-lease"
    stores = [RemoteCheckpoints(url, s3) for _ in (0, 1)]
    stores[0].acquire_lock()  # rank 0 holds the run lock (the process holds it: both threads see it)
    successor = Lease(stores[0].fs, f"{stores[0].root}/.kiln-run.lock", url, clock=lambda: time.time() + 1000)
    successor.take()
    try:
        outcomes = two_nodes(url, s3, node_folders(tmp_path), stores)
        assert all(isinstance(o, LeaseLost) for o in outcomes) and str(outcomes[0]) == str(outcomes[1])
        assert str(outcomes[0]).startswith(f"The run lock of {url} was taken over by another run")
        assert not stores[0].fs.exists(f"{stores[0].root}/checkpoint-4")  # nothing written
    finally:
        stores[0].release_lock()
        successor.release()


# -- which answer each rank of a resumed job takes (resume.choose_resume), on a 2 x 2 job of threads --------
def stored_checkpoints(url: str, s3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """checkpoint-2 and checkpoint-4 of a short local run, uploaded to `url`."""
    from tests.checkpoint.checkpoint_helpers import train

    local = tmp_path / "trained"
    train(str(local), {"max_steps": 4, "save_steps": 2, "save_total_limit": None})
    store = RemoteCheckpoints(url, s3)
    for name in ("checkpoint-2", "checkpoint-4"):
        store.upload(str(local / name))


def resume_on_threads(url: str, s3, tmp_path, on_each_node: bool, resolved: list[int] | None = None) -> list[object]:  # type: ignore[no-untyped-def]
    """choose_resume(True) on every rank of 2 nodes x 2 processes (tests/topology/fake_world.py), each
    node with its own staging folder (one shared folder without save.on_each_node); what each rank got
    (a path) or raised. `resolved` collects the ranks that downloaded."""
    from kiln.config import load_config
    from kiln.engine.checkpoint import resume as resume_module
    from tests.topology.fake_world import ThreadWorld

    world = ThreadWorld()

    def config(rank: int):  # type: ignore[no-untyped-def]
        staging = tmp_path / (f"node{rank // 2}" if on_each_node else "shared")
        save = {"on_each_node": on_each_node, "storage_options": s3, "staging_dir": str(staging)}
        return load_config({"output_dir": url, "save": save, "strategy": {"device": "cpu"}})

    strategies = [world.strategy(rank)(config(rank), None) for rank in range(4)]
    real = resume_module.resolve_resume

    def resolve(*args: object, **kw: object) -> object:
        if resolved is not None:
            resolved.append(world.current_rank)  # type: ignore[arg-type]
        return real(*args, **kw)

    def outcome(rank: int) -> object:
        try:
            return resume_module.choose_resume(True, strategies[rank].config, strategies[rank])
        except resume_module.ResumeError as err:
            return err

    resume_module.resolve_resume = resolve  # type: ignore[assignment]
    try:
        return world.run(outcome)
    finally:
        resume_module.resolve_resume = real


def test_each_rank_resumes_from_its_nodes_download_and_a_node_without_a_writer_takes_rank_0s(s3, tmp_path):
    url = f"s3://{BUCKET}/resumed-nodes"
    stored_checkpoints(url, s3, tmp_path)
    resolved: list[int] = []
    chosen = resume_on_threads(url, s3, tmp_path, on_each_node=True, resolved=resolved)
    assert sorted(resolved) == [0, 2]  # each node's writer downloads its node's copy
    assert chosen == [str(tmp_path / "node0" / "checkpoint-4")] * 2 + [str(tmp_path / "node1" / "checkpoint-4")] * 2
    assert all(os.path.isfile(os.path.join(str(path), MARKER)) for path in chosen)
    resolved.clear()
    chosen = resume_on_threads(url, s3, tmp_path, on_each_node=False, resolved=resolved)
    assert resolved == [0]  # no writer on node 1: a folder every node shares, rank 0's download
    assert chosen == [str(tmp_path / "shared" / "checkpoint-4")] * 4


def test_a_node_whose_download_refuses_stops_every_rank_naming_that_node(s3, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/refused-nodes"
    stored_checkpoints(url, s3, tmp_path)
    fs = RemoteCheckpoints(url, s3).fs  # one cached file system for every rank's store
    get = fs.get
    damaged_on: set[str] = set()

    def damaged_download(src: str, dst: str, **kw: object) -> None:
        get(src, dst, **kw)
        if any(f"{os.sep}{node}{os.sep}" in dst for node in damaged_on):  # this node's copy arrives damaged
            with open(os.path.join(dst, "trainer_state.json"), "ab") as fh:
                fh.write(b" ")

    monkeypatch.setattr(fs, "get", damaged_download)
    refusal = (
        rf"^Node {{node}} cannot resume: No valid checkpoint found in output directory \({url}\): "
        r"resume_from_checkpoint=true needs a complete checkpoint-<step> folder there; .*$"
    )
    damaged_on.add("node1")
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint"):  # node 1 tried checkpoint-4, then -2
        outcomes = resume_on_threads(url, s3, tmp_path, on_each_node=True)
    assert all(isinstance(o, ResumeError) for o in outcomes), outcomes  # node 0's download was fine: it stops too
    assert len({str(o) for o in outcomes}) == 1 and re.match(refusal.format(node=1), str(outcomes[0]))
    damaged_on.add("node0")  # both refuse: the first node's sentence, on every rank
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint"):
        outcomes = resume_on_threads(url, s3, tmp_path / "again", on_each_node=True)
    assert len({str(o) for o in outcomes}) == 1 and re.match(refusal.format(node=0), str(outcomes[0]))
    damaged_on.clear()
    damaged_on.add("shared")  # one downloader (no save.on_each_node): its sentence as it is, no node named
    with pytest.warns(UserWarning, match="Ignoring damaged checkpoint"):
        outcomes = resume_on_threads(url, s3, tmp_path, on_each_node=False)
    assert len({str(o) for o in outcomes}) == 1 and str(outcomes[0]).startswith("No valid checkpoint found")


def test_a_single_node_of_several_processes_uploads_from_rank_0_alone(monkeypatch):
    """save.on_each_node on one node: one writer, so global rank 0 uploads its folder (publish) as without
    it; from two nodes' writers, the nodes upload together (publish_from_nodes) and rank 0 alone does not."""
    from types import SimpleNamespace

    from kiln.engine.checkpoint import remote_run

    published: list[str] = []
    monkeypatch.setattr(remote_run, "publish", lambda store, final, limit, best: published.append(final))
    save = SimpleNamespace(remote_dir="s3://bucket/run", on_each_node=True, total_limit=None)
    for writers, together in (([True, False], False), ([True, True], True)):
        strategy = SimpleNamespace(world_size=2, is_global_zero=True, all_gather_object=lambda writer, w=writers: w)
        uploads = remote_run.RunUploads(SimpleNamespace(save=save), strategy, None)  # type: ignore[arg-type]
        uploads._store = RemoteCheckpoints("memory://run")
        assert uploads.from_nodes(True) is together
        uploads.published("out/checkpoint-2", None)
        assert published == ([] if together else ["out/checkpoint-2"]), writers
        published.clear()


def test_a_checkpoint_every_node_holds_but_the_store_lacks_goes_up_before_the_resume(s3, tmp_path):
    """A run killed after every node's write of checkpoint-6 but before the step boundary that uploads it
    (save.async_save): the resume's writers upload it from their staging folders, one marker listing every
    node's files, and every rank resumes from it."""
    url = f"s3://{BUCKET}/stranded-whole"
    stored_checkpoints(url, s3, tmp_path)
    node_folders(tmp_path, step=5)  # older than checkpoint-6: stays local
    node_folders(tmp_path, step=6)
    paths = resume_on_threads(url, s3, tmp_path, on_each_node=True)
    assert [os.path.basename(str(p)) for p in paths] == ["checkpoint-6"] * 4, paths
    store = RemoteCheckpoints(url, s3)
    assert [name for _, name in store.steps()] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    marker = json.loads(store.fs.cat_file(f"{store.root}/checkpoint-6/{MARKER}"))
    assert sorted(marker["files"]) == sorted({**NODE_FILES[0], **NODE_FILES[1]})


def test_staged_checkpoints_no_newer_than_the_stores_newest_stay_local(s3, tmp_path, recwarn):
    url = f"s3://{BUCKET}/stranded-older"
    stored_checkpoints(url, s3, tmp_path)
    store = RemoteCheckpoints(url, s3)
    marker = store.fs.cat_file(f"{store.root}/checkpoint-4/{MARKER}")
    node_folders(tmp_path, step=3)
    node_folders(tmp_path, step=4)  # the nodes' own parts of the store's newest
    paths = resume_on_threads(url, s3, tmp_path, on_each_node=True)
    assert [os.path.basename(str(p)) for p in paths] == ["checkpoint-4"] * 4, paths
    assert [name for _, name in store.steps()] == ["checkpoint-2", "checkpoint-4"]
    assert store.fs.cat_file(f"{store.root}/checkpoint-4/{MARKER}") == marker  # not uploaded again
    assert not [w for w in recwarn if "not published" in str(w.message)]


@pytest.mark.parametrize("node, harm", [(1, "missing"), (0, "damaged")])
def test_a_checkpoint_a_node_lacks_or_holds_damaged_stays_local_with_one_sentence(s3, tmp_path, node, harm):
    url = f"s3://{BUCKET}/stranded-{harm}"
    stored_checkpoints(url, s3, tmp_path)
    node_folders(tmp_path, step=6)
    part = tmp_path / f"node{node}" / "checkpoint-6"
    if harm == "missing":  # that node was killed before it sealed its part
        os.rename(part, tmp_path / f"node{node}" / ".checkpoint-6.tmp")
        why = "node 1's staging folder holds no complete part of it"
    else:
        (part / "fsdp_dcp" / "__0_0.distcp").write_bytes(b"shard 0ero")  # same size, other bytes
        why = r"node 0's staging folder holds it damaged \(.*fsdp_dcp/__0_0.distcp.*\)"
    with pytest.warns(UserWarning) as caught:
        paths = resume_on_threads(url, s3, tmp_path, on_each_node=True)
    said = [str(w.message) for w in caught if "not published" in str(w.message)]
    assert len(said) == 1 and re.match(
        rf"checkpoint-6 is newer than the newest checkpoint on {url} but is not published there, as {why}, so the "
        r"run resumes from the store's newest intact checkpoint\.$",
        said[0],
    ), said
    assert [os.path.basename(str(p)) for p in paths] == ["checkpoint-4"] * 4, paths
    assert [name for _, name in RemoteCheckpoints(url, s3).steps()] == ["checkpoint-2", "checkpoint-4"]

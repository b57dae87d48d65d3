"""What a run does with its object store (`save.remote_dir`, set from an output_dir URL at load:
kiln.config.remote_dir): the plug-in between the local checkpoints and kiln.engine.checkpoint.remote.

- **Publish**: once a checkpoint is complete in the local output_dir (its COMPLETE marker written, the
  folder renamed into place, local rotation done), the writer uploads it, marker last, then rotates the
  store by the local rule. An upload that fails past its retries is a warning: training goes on, the
  checkpoint stays in the local folder, and the store's newest intact checkpoint is the previous one. With
  `save.async_save` this runs on the background writer, so the step loop does not wait for the upload.
- **Resume**: `resume_from_checkpoint: true` downloads the store's newest intact checkpoint (digests
  checked) into the local folder; a checkpoint URL downloads that one. A checkpoint whole in the staging
  folders but newer than the store's newest (a run killed between its write and its upload) is published
  first (RunUploads.publish_stranded), when every writer holds its part of it intact.
- **Final outputs**: `save_model()` and `save_state()` into the run's own output_dir upload the files at
  its top (the exported model, trainer_state.json, the *_results.json), from global rank 0, and a lost
  run lock stops every rank; the logs (output_dir/runs) stay local.

`RunUploads` is the checkpoint manager's side of it: which ranks upload each checkpoint (global rank 0,
or every node's writer with `save.on_each_node` on several nodes) and when.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.engine.checkpoint.files import PREFIX, list_checkpoints, why_damaged, why_incomplete
from kiln.engine.checkpoint.integrity import ALGORITHM, MARKER
from kiln.engine.checkpoint.remote import LeaseLost, RemoteCheckpoints, UploadFailed
from kiln.engine.checkpoint.signing import SIGNATURE, SigningKey, sign
from kiln.utils.storage_urls import default_staging

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.strategies.base import Strategy

log = logging.getLogger(__name__)


def store_of(config: DictConfig) -> RemoteCheckpoints | None:
    """The run's store, or None for a run without `save.remote_dir`."""
    url = config.save.remote_dir
    return RemoteCheckpoints(str(url), options(config)) if url else None


class RunUploads:
    """The uploads of one run's checkpoints to its object store (save.remote_dir), for the checkpoint
    manager: nothing for a run without one."""

    def __init__(self, config: DictConfig, strategy: Strategy, key: SigningKey | None) -> None:
        self.config, self.strategy, self.key = config, strategy, key
        self._store: RemoteCheckpoints | None = None  # save.remote_dir's, built at the first upload
        self._writers: int | None = None  # how many ranks write a checkpoint folder (nodes, with save.on_each_node)
        self.pending: tuple[str, str | None] | None = None  # an async save's folder the nodes upload once written

    @property
    def store(self) -> RemoteCheckpoints | None:
        """The run's object store (save.remote_dir), or None."""
        if self._store is None and self.config.save.remote_dir:
            self._store = store_of(self.config)
        return self._store

    def from_nodes(self, writer: bool) -> bool:
        """Whether the run's store gets its checkpoints from several nodes' staging folders (save.remote_dir
        with save.on_each_node on more than one node), each node uploading its own files
        (publish_from_nodes), rather than from global rank 0's folder alone. Every rank calls this at each
        save (`writer`: whether it writes a checkpoint folder)."""
        if not self.config.save.remote_dir or not self.config.save.on_each_node or self.strategy.world_size == 1:
            return False
        if self._writers is None:  # every rank saves: one collective, at the first save
            self._writers = sum(self.strategy.all_gather_object(writer))
        return self._writers > 1

    def _nodes_upload(self) -> bool:
        """Whether several nodes' writers upload each checkpoint together (from_nodes), not rank 0 alone."""
        return self._writers is not None and self._writers > 1

    def published(self, final: str, best: str | None) -> None:
        """On a writer, once the checkpoint `final` is complete in the local folder (and rotated there):
        its upload and the store's rotation (publish), from global rank 0, unless the nodes upload it."""
        if self.store is not None and self.strategy.is_global_zero and not self._nodes_upload():
            publish(self.store, final, self.config.save.total_limit, best)

    def done(self, lost: LeaseLost | None) -> None:
        """Every rank, at the end of a synchronous save (and of upload_outputs): the ranks' last barrier.
        Global rank 0 uploads alone (published, upload_outputs), so with a store on several ranks that
        barrier is an all-gather of its verdict (`lost`: the LeaseLost it met, on that rank), and a run lock
        lost to another run stops every rank with the one sentence, rather than rank 0 alone while the
        others go on or wait for it."""
        if not self.config.save.remote_dir or self.strategy.world_size == 1:
            if lost is not None:
                raise lost
            self.strategy.barrier("checkpoint-done")
            return
        verdicts = [v for v in self.strategy.all_gather_object(None if lost is None else str(lost)) if v]
        if verdicts:
            raise LeaseLost(verdicts[0])

    def upload_from_nodes(self, final: str, best: str | None, writer: bool) -> None:
        """Every rank: each node's writer uploads its node's files of the complete checkpoint `final`, then
        global rank 0 its marker (publish_from_nodes)."""
        store = self.store
        assert store is not None
        publish_from_nodes(
            store,
            final if writer else None,
            self.strategy.global_rank,
            self.config.save.total_limit,
            best,
            self.strategy.all_gather_object,
            self.key,
        )

    def publish_stranded(self, writer: bool) -> None:
        """Every rank, before a run resumes from its store's newest checkpoint (resume_from_checkpoint true
        or if_exists; `writer`: whether this rank writes a checkpoint folder). A checkpoint complete in the
        staging folders but newer than the store's newest was saved by a run killed before its upload (an
        asynchronous save of several nodes goes up at the first step boundary after every node's write, a
        single writer's upload follows its write): it is published now, marker last and without rotation,
        so that the resume picks it. Only when every writer (each node's, with save.on_each_node) holds its
        part of it complete and intact (marker, digests, signature); otherwise the store keeps what it has,
        and global rank 0 says so in one sentence."""
        store, strategy = self.store, self.strategy
        assert store is not None
        out = str(self.config.output_dir)
        gathered = strategy.all_gather_object(stranded(store, out, self.key) if writer else None)
        holders = [held for held in gathered if held is not None]  # each writer's {step: why not, None: intact}
        steps = sorted({step for held in holders for step in held}, reverse=True)
        whole = [step for step in steps if all(step in held and held[step] is None for held in holders)]
        newer = [step for step in steps if not whole or step > whole[0]]
        if newer and strategy.is_global_zero:
            warnings.warn(
                f"{PREFIX}{newer[0]} is newer than the newest checkpoint on {store.url} but is not published there, "
                f"as {_why_not_whole(newer[0], holders)}, so the run resumes from the store's newest intact "
                "checkpoint.",
                stacklevel=2,
            )
        if not whole:
            return
        local = os.path.join(out, f"{PREFIX}{whole[0]}")
        if len(holders) > 1:  # the nodes' parts, one marker listing them all (no rotation: the next save's)
            publish_from_nodes(
                store, local if writer else None, strategy.global_rank, None, None, strategy.all_gather_object, self.key
            )
            return
        lost = None
        if writer:
            try:
                publish(store, local, None, None)
            except LeaseLost as err:  # raised on every rank where they meet, below
                lost = err
        self.done(lost)

    def upload_outputs(self) -> None:
        """Every rank (save_model, save_state): upload the files at the top of output_dir (the exported
        model, trainer_state.json) to the run's store, from global rank 0, and a run lock lost there stops
        every rank with its sentence (done); nothing, and no collective, for a run without a store."""
        if not self.config.save.remote_dir:
            return
        lost = None
        if self.strategy.is_global_zero:
            assert self.store is not None
            try:
                upload_outputs(self.store, str(self.config.output_dir))
            except LeaseLost as err:  # raised on every rank where they meet, below
                lost = err
        self.done(lost)


def options(config: DictConfig) -> dict[str, Any]:
    """`save.storage_options` as plain containers, for fsspec."""
    from omegaconf import OmegaConf

    raw = config.save.storage_options
    return dict(OmegaConf.to_container(raw, resolve=True) if raw is not None else {})  # type: ignore[arg-type]


def publish(store: RemoteCheckpoints, local: str, limit: int | None, best: str | None) -> None:
    """Upload the complete local checkpoint `local`, then rotate the store (`limit` newest kept, and the
    checkpoint named by the path `best`). A failure of either is a warning: the run goes on, and what
    the store held is untouched (an upload) or kept (a rotation)."""
    name = os.path.basename(os.path.normpath(local))
    try:
        store.upload(local)
    except UploadFailed as err:
        newest = f"is {store.uploaded}" if store.uploaded else "is the newest one it held before"
        warnings.warn(
            f"{name} was saved in {os.path.dirname(local)} but not uploaded to {store.url}: {err} The store's newest "
            f"intact checkpoint {newest}; training goes on.",
            stacklevel=2,
        )
        return
    log.info("Uploaded %s to %s.", name, store.url)
    _rotate(store, limit, best)


def _rotate(store: RemoteCheckpoints, limit: int | None, best: str | None) -> None:
    """Apply save.total_limit on the store (a failure is a warning: it keeps more until the next save)."""
    if limit:
        try:
            store.rotate(limit, os.path.basename(os.path.normpath(best)) if best else None)
        except Exception as err:  # the stores' clients raise their own types (botocore, aiohttp, OSError)
            warnings.warn(
                f"Rotating the checkpoints on {store.url} failed ({type(err).__name__}: {err}); it keeps more than "
                f"save.total_limit={limit} until the next save rotates them; training goes on.",
                stacklevel=2,
            )


def upload_outputs(store: RemoteCheckpoints, folder: str) -> None:
    """Upload the files at the top of the run's local folder (what save_model and save_state wrote); a
    failure is a warning naming the local folder, which keeps them."""
    try:
        store.upload_files(folder)
    except UploadFailed as err:
        warnings.warn(f"The run's final files stay in {folder}: {err}", stacklevel=2)


def fetch_checkpoint(
    url: str, storage_options: dict[str, Any] | None = None, key: Any = None, into: str | None = None
) -> str:
    """Download the checkpoint at `url` (`s3://bucket/run/checkpoint-500`), digests checked, into `into`
    (default: the local folder of its run's URL, kiln.utils.storage_urls.default_staging); returns the
    local path. A CheckpointError when it is not whole on the store or fails its digests."""
    parent, _, name = url.rstrip("/").rpartition("/")
    store = RemoteCheckpoints(parent, storage_options)
    return store.download(name, into or default_staging(parent), key)


def publish_from_nodes(
    store: RemoteCheckpoints,
    local: str | None,
    rank: int,
    limit: int | None,
    best: str | None,
    gather: Callable[[Any], list[Any]],
    key: SigningKey | None,
) -> None:
    """Upload a checkpoint whose files are spread over several nodes' staging folders (save.on_each_node:
    each node's writer sealed the files its node wrote, in `local`, under a marker of its own). Called on
    every rank (`rank`: its global rank); `local` is None on ranks that are not a node's writer, and
    `gather` is the strategy's all_gather_object.

    Global rank 0 first withdraws an earlier marker of the same step from the store; each file is then
    uploaded by the first node (in rank order) that holds it, so the files every node writes alike
    (trainer_state.json, config.yaml) go up once; after every node's upload, rank 0 uploads one marker
    that lists, digested, every node's files (signed again with `key`), then rotates the store. A node
    whose upload fails past its retries leaves no marker: a warning, as for one node (publish)."""
    name = os.path.basename(os.path.normpath(local)) if local is not None else None
    withdrawn = _attempt(store.withdraw, name) if rank == 0 and name is not None else None
    gathered = gather((_part(local) if local is not None else None, withdrawn))  # no node uploads before it
    parts = [part for part, _ in gathered]
    problems = [problem for _, problem in gathered if problem]
    owner: dict[str, int] = {}
    for holder, part in enumerate(parts):
        for rel in part["files"] if part else ():
            owner.setdefault(rel, holder)
    uploaded = None
    if local is not None and not problems:
        uploaded = _attempt(store.upload_some, local, sorted(rel for rel, holder in owner.items() if holder == rank))
    problems += [problem for problem in gather(uploaded) if problem]
    lost = [message for kind, message in problems if kind == "lost"]
    if lost:  # every rank stops with the same sentence
        raise LeaseLost(lost[0])
    if rank != 0 or local is None or name is None:
        return
    if problems:
        warnings.warn(
            f"{name} was saved in the nodes' staging folders but not uploaded to {store.url}: {problems[0][1]} The "
            "store's newest intact checkpoint is the newest one it held before; training goes on.",
            stacklevel=2,
        )
        return
    meta = dict(parts[0]["meta"])
    meta["files"] = {rel: parts[holder]["files"][rel] for rel, holder in sorted(owner.items())}
    meta[ALGORITHM] = {rel: parts[holder][ALGORITHM][rel] for rel, holder in sorted(owner.items())}
    meta.pop(SIGNATURE, None)
    if key is not None:
        meta[SIGNATURE] = sign(meta, key)
    try:
        store.seal(name, json.dumps(meta, indent=1).encode("utf-8"))
    except UploadFailed as err:
        warnings.warn(f"{name} was not uploaded to {store.url}: {err} Training goes on.", stacklevel=2)
        return
    log.info("Uploaded %s to %s from %d nodes.", name, store.url, sum(1 for p in parts if p))
    _rotate(store, limit, best)


def stranded(store: RemoteCheckpoints, local_root: str, key: SigningKey | None) -> dict[int, str | None]:
    """The checkpoints in the staging folder `local_root` newer than the store's newest: step -> why it
    must not be published (incomplete, damaged), or None where it is complete and intact."""
    on_store = store.steps()
    newest = on_store[-1][0] if on_store else -1
    return {
        step: why_incomplete(path) or why_damaged(path, key)
        for step, path in list_checkpoints(local_root)
        if step > newest
    }


def _why_not_whole(step: int, holders: list[dict[int, str | None]]) -> str:
    """Why checkpoint `step` cannot be published from the writers' staging folders (`holders`: each
    writer's stranded checkpoints, in rank order)."""
    reasons = []
    for node, held in enumerate(holders):
        where = f"node {node}'s staging folder" if len(holders) > 1 else "the staging folder"
        if step not in held:
            reasons.append(f"{where} holds no complete part of it")
        elif held[step] is not None:
            reasons.append(f"{where} holds it damaged ({held[step]})")
    return reasons[0]  # one at least: `step` is not whole


def _attempt(action: Callable[..., Any], *args: Any) -> tuple[str, str] | None:
    """Run one node's step of a shared upload; its failure as ("lost" or "failed", the sentence), for the
    other ranks to learn through the next gather rather than wait for a rank that raised."""
    try:
        action(*args)
    except LeaseLost as err:
        return "lost", str(err)
    except Exception as err:  # the stores' clients raise their own types (botocore, aiohttp, OSError)
        return "failed", str(err) if isinstance(err, UploadFailed) else f"{type(err).__name__}: {err}."
    return None


def _part(local: str) -> dict[str, Any]:
    """A node's part of a checkpoint: its sealed marker (files, digests, the rest)."""
    with open(os.path.join(local, MARKER), encoding="utf-8") as fh:
        meta = json.load(fh)
    return {"files": meta["files"], ALGORITHM: meta[ALGORITHM], "meta": meta}

"""A store's conditional writes, which make the run lock a lease (lease.py): write an object only if there
is none, replace or delete it only if it is still the version this run read or wrote. One small class per
store kiln knows how to ask; lease.py holds the logic, the same for every store.

- S3 and S3-compatible stores, through s3fs: `If-None-Match: *` creates, `If-Match` an ETag replaces and
  deletes; a version is the object's ETag.
- Google Cloud Storage, through gcsfs: `ifGenerationMatch=0` creates, `ifGenerationMatch` a generation
  replaces and deletes; a version is the object's generation. gcsfs asks for the first condition itself
  (`pipe_file(mode="create")`) but takes no generation to match on a write or a delete, so the two others
  are requests of the JSON API sent through gcsfs's own session (`call`), with its credentials and retries.

A store refuses a condition with FileExistsError (GCS's 412, through gcsfs), FileNotFoundError or another
OSError (s3fs's 412)."""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

__all__ = ["Conditions", "conditions_for"]


class Conditions(Protocol):
    """The conditional writes of one store; `fs` is its fsspec file system."""

    def create(self, path: str, data: bytes) -> str:
        """Write `data` at `path` only if nothing is there; the new version."""

    def replace(self, path: str, data: bytes, version: str) -> str:
        """Write `data` over `path` only if it is still `version`; the new version."""

    def delete(self, path: str, version: str) -> None:
        """Delete `path` only if it is still `version`."""

    def version(self, info: dict[str, Any]) -> str:
        """The version of the object that `fs.info` described."""


class S3Conditions:
    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def create(self, path: str, data: bytes) -> str:
        return str(self.fs.pipe_file(path, data, mode="create")["ETag"])

    def replace(self, path: str, data: bytes, version: str) -> str:
        return str(self.fs.pipe_file(path, data, IfMatch=version)["ETag"])

    def delete(self, path: str, version: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        finally:
            self.fs.invalidate_cache(path)

    def version(self, info: dict[str, Any]) -> str:
        return str(info.get("ETag", ""))


class GCSConditions:
    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def create(self, path: str, data: bytes) -> str:
        return self._upload(path, data, "0")

    def replace(self, path: str, data: bytes, version: str) -> str:
        return self._upload(path, data, version)

    def _upload(self, path: str, data: bytes, generation: str) -> str:
        """One media upload (the JSON API's `objects.insert`) on the condition `ifGenerationMatch`."""
        bucket, key, _ = self.fs.split_path(path)
        upload = self.fs.base.removesuffix("storage/v1/") + f"upload/storage/v1/b/{quote(bucket, safe='')}/o"
        try:
            out = self._call(
                "POST",
                upload,
                uploadType="media",
                name=key,
                ifGenerationMatch=generation,
                headers={"Content-Type": "application/octet-stream"},
                data=data,
                json_out=True,
            )
        finally:
            self.fs.invalidate_cache(path)
        return str(out["generation"])

    def delete(self, path: str, version: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self._call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
        finally:
            self.fs.invalidate_cache(path)

    def version(self, info: dict[str, Any]) -> str:
        return str(info.get("generation", ""))

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A request of the JSON API; a condition not met (412) is FileExistsError, as gcsfs raises it from
        2024.12 on (before, an HttpError of code 412)."""
        try:
            return self.fs.call(*args, **kwargs)
        except Exception as err:
            if getattr(err, "code", None) == 412:
                raise FileExistsError(str(err)) from err
            raise


def conditions_for(fs: Any) -> Conditions | None:
    """The conditional writes kiln knows how to ask `fs` for, or None: a store without them (to kiln)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "s3" in protocol and hasattr(fs, "call_s3"):
        return S3Conditions(fs)
    if "gs" in protocol and hasattr(fs, "call") and hasattr(fs, "base"):
        return GCSConditions(fs)
    return None

"""Output folders named by an fsspec URL (`s3://bucket/run`, `gs://...`, `memory://...`, `file://...`).

The ground floor of object-store checkpoints: which paths are URLs of a store, which kiln extra installs a
store's file system, and the local folder a run whose output_dir is such a URL writes into before it
uploads (kiln.engine.checkpoint.remote). `file://` is the local file system, read as a plain path."""

from __future__ import annotations

import hashlib
import os
import tempfile

from kiln.utils.errors import ConfigError

#: URL scheme -> the kiln extra that installs its fsspec file system
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_LOCAL = ("file", "local")


def is_remote(path: str) -> bool:
    """Whether `path` is a URL of a store other than the local file system."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme not in ("", *_LOCAL)


def local_path(path: str) -> str:
    """`file:///x` (or `local:///x`) as the plain path `/x`; anything else as it is."""
    scheme, sep, rest = str(path).partition("://")
    return rest if sep and scheme in _LOCAL else str(path)


def missing_file_system(url: str, what: str = "") -> ConfigError:
    """The one sentence for a URL whose store's fsspec file system is not installed, naming the kiln
    extra that installs it; `what` names the setting that holds the URL."""
    scheme = url.partition("://")[0]
    extra = EXTRAS.get(scheme)
    hint = f"pip install kiln[{extra}]" if extra else f"install the fsspec file system for {scheme}://"
    where = f"{what} {url}" if what else url
    return ConfigError(f"{where} is on a {scheme}:// store, whose file system is not installed; {hint}.")


def check_file_system(url: str, what: str) -> None:
    """Fail in one sentence, at config load, when `url`'s store has no fsspec file system installed
    (missing_file_system) or its scheme is unknown to fsspec."""
    import fsspec

    scheme = url.partition("://")[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise missing_file_system(url, what) from None
    except ValueError:
        raise ConfigError(
            f"{what} {url} names the store {scheme}://, which fsspec does not know; use s3://, gs://, "
            "memory:// or a local path."
        ) from None


def default_staging(url: str) -> str:
    """The local folder for the checkpoints of store URL `url` before they are uploaded (and after
    they are downloaded): the same folder for the same URL, so a job restarted on the same machine finds
    what it downloaded before; one tree per user, as the system's temporary folder is shared."""
    url = url.rstrip("/")
    user = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"kiln-staging{user}", digest, url.rsplit("/", 1)[-1] or "run")

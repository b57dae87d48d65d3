"""The object stores that the remote-checkpoint tests run on, each a real API over HTTP reached through
the client users run: S3 (moto's server, through s3fs) and Google Cloud Storage (gcs_server.py, through
gcsfs). A test parametrized over STORES skips a store whose packages are missing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.installed import requires

STORES = [
    pytest.param(
        "s3", marks=[requires("s3fs", "pip install kiln[s3]"), requires("moto", "pip install moto[server]")], id="s3"
    ),
    pytest.param("gs", marks=[requires("gcsfs", "pip install kiln[gcs]")], id="gs"),
]


@contextlib.contextmanager
def store_endpoint(scheme: str, bucket: str) -> Iterator[dict[str, Any]]:
    """A server of store `scheme` ("s3" or "gs") with `bucket` in it; yields the storage options."""
    if scheme == "s3":
        from tests.checkpoint.s3_server import s3_endpoint

        with s3_endpoint(bucket) as options:
            yield options
    else:
        from tests.checkpoint.gcs_server import gcs_endpoint

        with gcs_endpoint(bucket) as options:
            yield options

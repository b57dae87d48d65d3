"""A real S3 API for the object-store tests: moto's server over HTTP on a free port, reached through
s3fs, the client users run."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def s3_endpoint(bucket: str, key: str = "testing", secret: str = "testing") -> Iterator[dict[str, Any]]:
    """Start the server with `bucket` in it; yields the storage options that reach it. fsspec keeps file
    systems by their options, so none outlives the server."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {
            "key": key,
            "secret": secret,
            "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "eu-west-1"},
        }
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield options
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()

"""A small Google Cloud Storage JSON API for the object-store tests, over HTTP on a free port, reached
through gcsfs, the client users run. It serves what gcsfs asks for on kiln's paths: bucket creation,
object uploads (media, multipart, resumable), metadata, downloads (with a byte range), listings, deletes
(one, or a batch), each object with a generation that every write increments; and the preconditions
`ifGenerationMatch` / `ifGenerationNotMatch` on writes and deletes, answered 412 like GCS (the emulator on
PyPI, gcp-storage-emulator, ignores them). Every request holds one lock, so a condition and the write it
guards are one step, as on GCS."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_OBJECT = re.compile(r"^/(?:download/)?storage/v1/b/([^/]+)/o/(.+)$")
_OBJECTS = re.compile(r"^/(upload/)?storage/v1/b/([^/]+)/o$")


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buckets: dict[str, dict[str, tuple[bytes, dict[str, Any]]]] = {}
        self.generations = itertools.count(1_000_001)
        self.uploads: dict[str, dict[str, Any]] = {}  # resumable upload id -> bucket, name, query, data

    def precondition(self, bucket: str, name: str, query: dict[str, str]) -> bool:
        """Whether the object's current generation (0: none) meets the request's conditions; ValueError
        for a condition that is not a number."""
        current = int(self.buckets[bucket][name][1]["generation"]) if name in self.buckets[bucket] else 0
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != current:
            return False
        return not ("ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == current)

    def write(self, bucket: str, name: str, data: bytes, query: dict[str, str], meta: dict[str, Any]) -> dict[str, Any]:
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        info = {
            "kind": "storage#object",
            "bucket": bucket,
            "name": name,
            "id": f"{bucket}/{name}",
            "size": str(len(data)),
            "generation": str(next(self.generations)),
            "metageneration": "1",
            "contentType": meta.get("contentType", "application/octet-stream"),
            "timeCreated": now,
            "updated": now,
            **({"metadata": meta["metadata"]} if meta.get("metadata") else {}),
        }
        self.buckets[bucket][name] = (data, info)
        return info


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: _Store

    def log_message(self, format: str, *args: Any) -> None:  # a line per request otherwise
        pass

    def _send(self, code: int, body: Any = b"", headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.send_response(code)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        self._send(code, {"error": {"code": code, "message": message, "errors": [{"message": message}]}})

    def _parse(self) -> tuple[str, dict[str, str], bytes]:
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return url.path, {k: v[-1] for k, v in parse_qs(url.query).items()}, body

    def do_GET(self) -> None:
        path, query, _ = self._parse()
        with self.store.lock:
            if m := _OBJECT.match(path):
                bucket, name = m[1], unquote(m[2])
                found = self.store.buckets.get(bucket, {}).get(name)
                if found is None or query.get("generation", found[1]["generation"]) != found[1]["generation"]:
                    return self._error(404, f"No such object: {bucket}/{name}")
                if query.get("alt") != "media":
                    return self._send(200, found[1])
                data, headers = found[0], {"Content-Type": "application/octet-stream"}
                if r := re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
                    end = int(r[2]) + 1 if r[2] else len(data)
                    data = data[int(r[1]) : end]
                    return self._send(206, data, headers)
                return self._send(200, data, headers)
            if m := _OBJECTS.match(path):
                return self._list(m[2], query)
            if m := re.match(r"^/storage/v1/b/([^/]+)$", path):
                if m[1] not in self.store.buckets:
                    return self._error(404, f"No such bucket: {m[1]}")
                return self._send(200, {"kind": "storage#bucket", "name": m[1], "id": m[1]})
        self._error(404, f"Not served here: GET {path}")

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        if bucket not in self.store.buckets:
            return self._error(404, f"No such bucket: {bucket}")
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        items, prefixes = [], set()
        for name, (_, info) in sorted(self.store.buckets[bucket].items()):
            if not name.startswith(prefix) or name < query.get("startOffset", ""):
                continue
            rest = name[len(prefix) :]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
            else:
                items.append(info)
        self._send(200, {"kind": "storage#objects", "items": items, "prefixes": sorted(prefixes)})

    def do_POST(self) -> None:
        path, query, body = self._parse()
        with self.store.lock:
            if path == "/storage/v1/b":
                self.store.buckets.setdefault(json.loads(body)["name"], {})
                return self._send(200, {"kind": "storage#bucket", "name": json.loads(body)["name"]})
            if path == "/batch/storage/v1":
                return self._batch(body)
            m = _OBJECTS.match(path)
            if m is None or not m[1] or m[2] not in self.store.buckets:
                return self._error(404, f"Not served here: POST {path}")
            if "upload_id" in query:
                return self._resume(query["upload_id"], body)
            kind, meta, data = query.get("uploadType"), {}, body
            if kind == "multipart":
                meta, data = _multipart(body, self.headers["Content-Type"])
            elif kind == "resumable":
                upload = str(len(self.store.uploads))
                meta = json.loads(body) if body else {}
                name = query.get("name") or meta["name"]
                self.store.uploads[upload] = {"bucket": m[2], "name": name, "query": query, "meta": meta, "data": b""}
                location = f"http://{self.headers['Host']}{path}?uploadType=resumable&upload_id={upload}"
                return self._send(200, {}, {"Location": location})
            return self._insert(m[2], query.get("name") or meta["name"], data, query, meta)

    def _insert(self, bucket: str, name: str, data: bytes, query: dict[str, str], meta: dict[str, Any]) -> None:
        try:
            if not self.store.precondition(bucket, name, query):
                return self._error(412, "At least one of the pre-conditions you specified did not hold.")
        except ValueError:
            return self._error(400, "Invalid argument.")
        self._send(200, self.store.write(bucket, name, data, query, meta))

    def _resume(self, upload_id: str, body: bytes) -> None:
        upload = self.store.uploads[upload_id]
        upload["data"] += body
        total = self.headers.get("Content-Range", "").rsplit("/", 1)[-1]
        if total == "*" or len(upload["data"]) < int(total):
            return self._send(308, b"", {"Range": f"bytes=0-{len(upload['data']) - 1}"})
        del self.store.uploads[upload_id]
        self._insert(upload["bucket"], upload["name"], upload["data"], upload["query"], upload["meta"])

    def do_DELETE(self) -> None:
        path, query, _ = self._parse()
        with self.store.lock:
            m = _OBJECT.match(path)
            if m is not None:
                code, message = self._delete(m[1], unquote(m[2]), query)
                return self._send(code) if code == 204 else self._error(code, message)
            if _OBJECTS.match(path):  # an upload cancelled
                return self._send(204)
        self._error(404, f"Not served here: DELETE {path}")

    def _delete(self, bucket: str, name: str, query: dict[str, str]) -> tuple[int, str]:
        if name not in self.store.buckets.get(bucket, {}):
            return 404, f"No such object: {bucket}/{name}"
        try:
            if not self.store.precondition(bucket, name, query):
                return 412, "At least one of the pre-conditions you specified did not hold."
        except ValueError:
            return 400, "Invalid argument."
        del self.store.buckets[bucket][name]
        return 204, ""

    def _batch(self, body: bytes) -> None:
        parts = []
        for line in re.findall(r"^DELETE (\S+) HTTP", body.decode(), flags=re.M):
            url = urlsplit(line)
            m = _OBJECT.match(url.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            code, message = self._delete(m[1], unquote(m[2]), query) if m else (404, line)
            reason = {204: "No Content", 400: "Bad Request", 404: "Not Found", 412: "Precondition Failed"}[code]
            error = json.dumps({"error": {"code": code, "message": message}}) if code != 204 else ""
            parts.append(f"Content-Type: application/http\r\n\r\nHTTP/1.1 {code} {reason}\r\n\r\n{error}\r\n")
        text = "".join(f"--batch_kiln\r\n{part}" for part in parts) + "--batch_kiln--\r\n"
        self._send(200, text.encode(), {"Content-Type": "multipart/mixed; boundary=batch_kiln"})


def _multipart(body: bytes, content_type: str) -> tuple[dict[str, Any], bytes]:
    """The metadata and the content of a multipart/related upload (gcsfs's simple upload)."""
    boundary = b"--" + re.search(r'boundary="?([^";]+)"?', content_type)[1].encode()  # type: ignore[index]
    second = body.index(boundary, len(boundary))
    meta = json.loads(re.split(rb"\r?\n\r?\n", body[:second], maxsplit=1)[1])
    head = re.compile(rb"\r?\n\r?\n").search(body, second)
    end = body.rindex(boundary + b"--")  # the content runs to the closing boundary, less its line break
    end -= 2 if body[end - 2 : end] == b"\r\n" else 1
    return meta, body[head.end() : end]  # type: ignore[union-attr]


def gcs_options(endpoint: str) -> dict[str, Any]:
    """gcsfs's options that reach the server at `endpoint` (anonymous: it checks no credentials)."""
    return {"endpoint_url": endpoint, "token": "anon", "project": "kiln"}


@contextlib.contextmanager
def gcs_endpoint(bucket: str) -> Iterator[dict[str, Any]]:
    """Start the server with `bucket` in it; yields the storage options that reach it. fsspec keeps file
    systems by their options, so none outlives the server."""
    import gcsfs

    handler = type("Handler", (_Handler,), {"store": _Store()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="kiln-test-gcs", daemon=True)
    thread.start()
    undo = standard_bucket_layout()
    try:
        options = gcs_options(f"http://127.0.0.1:{server.server_port}")
        gcsfs.GCSFileSystem(**options).mkdir(bucket)
        yield options
    finally:
        undo()
        gcsfs.GCSFileSystem.clear_instance_cache()
        server.shutdown()
        server.server_close()


def standard_bucket_layout() -> Callable[[], None]:
    """gcsfs (its default ExtendedGcsFileSystem) asks GCS's storage control API, over gRPC, whether a bucket
    is zonal before it reads or writes; this server has no gRPC, and its buckets are standard ones: say so
    without asking, in this process (a worker of the tests' worlds too: store_world.py). Returns what
    undoes it."""
    try:
        from gcsfs.extended_gcsfs import BucketType, ExtendedGcsFileSystem
    except ImportError:  # an older gcsfs: it never asks
        return lambda: None

    async def standard(self: Any, bucket: str) -> Any:
        return BucketType.NON_HIERARCHICAL

    asked = ExtendedGcsFileSystem._get_bucket_type
    ExtendedGcsFileSystem._get_bucket_type = standard  # type: ignore[method-assign]

    def undo() -> None:
        ExtendedGcsFileSystem._get_bucket_type = asked  # type: ignore[method-assign]

    return undo

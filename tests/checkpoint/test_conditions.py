"""Which conditional writes kiln asks each store for (kiln/engine/checkpoint/conditions.py): S3's through
s3fs, GCS's through gcsfs, none elsewhere; and a gcsfs older than 2024.12, which raised GCS's 412 as an
HttpError, still refuses a condition with FileExistsError. The conditions themselves, on a real API over
HTTP: tests/checkpoint/test_remote_lease.py."""

from __future__ import annotations

import fsspec
import pytest

from kiln.engine.checkpoint.conditions import GCSConditions, S3Conditions, conditions_for
from tests.installed import requires


def test_a_store_without_conditional_writes_gets_none() -> None:
    assert conditions_for(fsspec.filesystem("memory")) is None
    assert conditions_for(fsspec.filesystem("file")) is None


def test_a_store_named_s3_or_gs_without_their_clients_calls_gets_none() -> None:
    """Another fsspec implementation registered for the scheme (not s3fs, not gcsfs) has no conditional
    writes kiln knows how to ask for; and s3fs's or gcsfs's calls alone do not make a store S3 or GCS."""

    class Named:
        def __init__(self, protocol: object, *calls: str) -> None:
            self.protocol = protocol
            for name in calls:
                setattr(self, name, lambda *a, **kw: None)

    assert conditions_for(Named(("s3", "s3a"))) is None
    assert conditions_for(Named("memory", "call_s3")) is None
    assert conditions_for(Named(("gs", "gcs"), "call")) is None
    assert conditions_for(Named("memory", "call", "base")) is None
    assert isinstance(conditions_for(Named(("s3", "s3a"), "call_s3")), S3Conditions)
    assert isinstance(conditions_for(Named(("gs", "gcs"), "call", "base")), GCSConditions)


@requires("s3fs", "pip install kiln[s3]")
def test_s3_gets_s3s_conditions() -> None:
    import s3fs

    assert isinstance(conditions_for(s3fs.S3FileSystem(anon=True)), S3Conditions)


@requires("gcsfs", "pip install kiln[gcs]")
def test_gcs_gets_gcss_conditions_and_a_412_is_a_refusal_with_any_gcsfs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gcsfs
    from gcsfs.retry import HttpError

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url="http://127.0.0.1:9", skip_instance_cache=True)
    conditions = conditions_for(fs)
    assert isinstance(conditions, GCSConditions)
    for code, raised in ((412, FileExistsError), (503, HttpError)):
        error = HttpError({"code": code, "message": "conditionNotMet"})
        monkeypatch.setattr(fs, "call", lambda *a, error=error, **kw: (_ for _ in ()).throw(error))
        with pytest.raises(raised):
            conditions.create("bucket/run/.kiln-run.lock", b"{}")
        with pytest.raises(raised):
            conditions.delete("bucket/run/.kiln-run.lock", "7")

"""An output_dir URL is translated once, at load: the URL moves to save.remote_dir and output_dir becomes
the local staging folder; bad combinations are one sentence each, and storage credentials are hidden in
everything kiln saves or logs of the config."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest

from kiln.config import load_config
from kiln.config.redact import HIDDEN, config_for_saving, hide_secrets
from kiln.utils.errors import ConfigError
from kiln.utils.storage_urls import default_staging, is_remote, local_path


def test_an_output_dir_url_is_staged_locally_and_uploaded_to():
    cfg = load_config({"output_dir": "memory://bucket/runs/exp1/"})
    assert cfg.save.remote_dir == "memory://bucket/runs/exp1"
    assert cfg.output_dir == default_staging("memory://bucket/runs/exp1")
    assert cfg.output_dir.startswith(tempfile.gettempdir()) and os.path.basename(cfg.output_dir) == "exp1"
    assert default_staging("memory://bucket/runs/exp1") == default_staging("memory://bucket/runs/exp1/")
    assert default_staging("memory://bucket/runs/exp1") != default_staging("memory://other/runs/exp1")
    staged = load_config({"output_dir": "memory://b/r", "save": {"staging_dir": "/scratch/r"}})
    assert staged.output_dir == "/scratch/r" and staged.save.remote_dir == "memory://b/r"
    again = load_config(config_for_saving(staged))  # a saved config loads to the same run
    assert again.output_dir == "/scratch/r" and again.save.remote_dir == "memory://b/r"


def test_file_urls_are_local_folders():
    cfg = load_config({"output_dir": "file:///data/run", "resume_from_checkpoint": "file:///data/run/checkpoint-4"})
    assert cfg.output_dir == "/data/run" and cfg.save.remote_dir is None
    assert cfg.resume_from_checkpoint == "/data/run/checkpoint-4"
    assert not is_remote("file:///x") and is_remote("s3://b") and local_path("s3://b/x") == "s3://b/x"


@pytest.mark.parametrize(
    ("config", "sentence"),
    [
        (
            {"output_dir": "memory://a/run", "save": {"remote_dir": "memory://b/run"}},
            r"^output_dir memory://a/run and save.remote_dir memory://b/run name two stores; give the URL once",
        ),
        ({"save": {"remote_dir": "/local/mirror"}}, r"^save.remote_dir '/local/mirror' is not the URL of a store"),
        ({"output_dir": "nosuch://b/run"}, r"^output_dir nosuch://b/run names the store nosuch://, which fsspec"),
        ({"resume_from_checkpoint": "nosuch://b/c"}, r"^resume_from_checkpoint nosuch://b/c names the store nosuch://"),
        (
            {"save": {"storage_options": "hunter2-secret"}},
            r"^Config key 'save.storage_options' expects Dict\[str, Any\] \(the value is not shown\)\.$",
        ),
    ],
)
def test_bad_store_settings_are_one_sentence(config, sentence):
    with pytest.raises(ConfigError, match=sentence):
        load_config(config)


def test_a_missing_store_package_names_its_extra(monkeypatch):
    import fsspec

    def missing(scheme: str) -> None:
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(
        ConfigError, match=r"^save.remote_dir s3://b/r is on a s3:// store, .*pip install kiln\[s3\]\.$"
    ):
        load_config({"save": {"remote_dir": "s3://b/r"}})


def test_storage_credentials_are_hidden_wherever_the_config_is_saved():
    options = {
        "key": "AKIA-not-shown",
        "secret": "s3cr3t-not-shown",
        "profile": "team",
        "client_kwargs": {"endpoint_url": "http://minio:9000", "aws_session_token": "tok-not-shown"},
        "token": None,
    }
    saved = config_for_saving(load_config({"output_dir": "memory://b/r", "save": {"storage_options": options}}))
    assert saved["save"]["storage_options"] == {
        "key": HIDDEN,
        "secret": HIDDEN,
        "profile": "team",
        "client_kwargs": {"endpoint_url": "http://minio:9000", "aws_session_token": HIDDEN},
        "token": None,
    }
    assert hide_secrets([{"password": "x"}, "plain"]) == [{"password": HIDDEN}, "plain"]


def test_each_trial_of_a_search_uploads_under_its_own_prefix():
    from kiln.engine.hp_trial import trial_config

    base = load_config({"output_dir": "memory://b/search"})
    trial = trial_config(base, SimpleNamespace(number=3), {}, None)
    assert trial.save.remote_dir == "memory://b/search/run-3"
    assert trial.output_dir == os.path.join(base.output_dir, "run-3")
    beside = load_config({"output_dir": "/tmp/search", "save": {"remote_dir": "memory://b/search/"}})
    assert trial_config(beside, SimpleNamespace(number=3), {}, None).save.remote_dir == "memory://b/search/run-3"

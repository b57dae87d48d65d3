"""`kiln fit CONFIG --profile`: shorthand for `profile.active=3` (wait and warmup keep their defaults),
unless the command line or the config file already sets `profile.active`, which then wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln import cli
from kiln.cli import dispatch
from kiln.config.load import load_config


@pytest.fixture
def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run `kiln fit` up to the point it loads the config; returns a function giving that config."""

    def fit(yaml: str, *args: str) -> Any:
        path = tmp_path / "config.yaml"
        path.write_text(yaml)
        seen: dict[str, Any] = {}

        def run(command: str, config: str, overrides: list[str], *rest: Any) -> int:
            seen["config"] = load_config(config, overrides)
            return 0

        monkeypatch.setattr(dispatch, "run_command", run)
        assert cli.main(["fit", str(path), *args]) == 0
        return seen["config"]

    return fit


def test_profile_records_three_steps_with_the_default_wait_and_warmup(loaded: Any) -> None:
    config = loaded("output_dir: out\n", "--profile")
    assert (config.profile.active, config.profile.wait, config.profile.warmup) == (3, 1, 1)


def test_without_the_flag_the_profiler_stays_off(loaded: Any) -> None:
    assert loaded("output_dir: out\n").profile.active == 0


def test_an_explicit_override_wins_over_the_flag(loaded: Any) -> None:
    assert loaded("output_dir: out\n", "--profile", "profile.active=5").profile.active == 5
    assert loaded("output_dir: out\n", "profile.active=5", "--profile").profile.active == 5


def test_the_config_file_wins_over_the_flag(loaded: Any) -> None:
    assert loaded("output_dir: out\nprofile:\n  active: 0\n", "--profile").profile.active == 0


def test_the_flag_is_in_fits_help_only(capsys: pytest.CaptureFixture[str]) -> None:
    option = "\n  --profile "  # the option's line (the config reference below mentions the flag too)
    assert cli.main(["fit", "--help"]) == 0
    assert option in capsys.readouterr().out
    assert cli.main(["evaluate", "--help"]) == 0
    assert option not in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert option in capsys.readouterr().out

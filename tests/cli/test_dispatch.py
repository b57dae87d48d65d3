"""kiln/cli/dispatch.py's routing, in process: which launcher a command line reaches, and the exit code and
one line of each command line it refuses (the launchers themselves are spies: their own tests start them)."""

from __future__ import annotations

from typing import Any

import pytest

from kiln import cli
from kiln.launch import local, ray


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    calls: dict[str, list[Any]] = {"ray": [], "local": []}

    def fake_ray(command, config, overrides, num_workers, other_launcher, max_restarts, *, train_loop):
        calls["ray"].append((command, num_workers, other_launcher, max_restarts))
        return 0 if num_workers else None  # None: this process trains itself (no Ray asked for)

    def fake_local(nproc, argv, extra_env=None, max_restarts=0):
        calls["local"].append((nproc, argv, max_restarts))
        return 0

    monkeypatch.setattr(ray, "fit_with_ray", fake_ray)
    monkeypatch.setattr(local, "launch_local", fake_local)
    return calls


def test_an_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["fitt", "cfg.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: unknown command 'fitt'.") and "kiln fit CONFIG.yaml" in err


@pytest.mark.parametrize(
    ("argv", "other_launcher"),
    [
        ([], False),
        (["--nproc", "2"], True),
        (["--accelerate-config", "acc.yaml"], True),
        (["--nproc", "2", "--accelerate-config", "acc.yaml"], True),
    ],
)
def test_ray_is_told_whether_another_launcher_was_asked_for(spies, argv: list[str], other_launcher: bool) -> None:
    assert cli.main(["fit", "cfg.yaml", "--ray", "2", *argv]) == 0
    assert spies["ray"] == [("fit", 2, other_launcher, 0)]
    assert spies["local"] == []  # Ray started the workers: no local launch as well


def test_nproc_goes_to_the_local_launcher_with_the_same_command_line(spies) -> None:
    assert cli.main(["fit", "cfg.yaml", "--nproc", "3", "--max-restarts", "1", "a=1"]) == 0
    assert spies["local"] == [(3, ["-m", "kiln.cli", "fit", "cfg.yaml", "a=1"], 1)]
    assert spies["ray"] == [("fit", None, True, 1)]  # asked first: the config's `launcher.name: ray` may want Ray


def test_ray_is_refused_for_a_command_that_does_not_train(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["evaluate", "cfg.yaml", "--ray", "2"]) == 2
    assert "kiln evaluate runs in this process (drop --ray)" in capsys.readouterr().err


def test_a_launch_setting_that_cannot_work_is_one_line_and_exit_2(capsys: pytest.CaptureFixture) -> None:
    # the real launcher: it refuses before it starts anything
    assert cli.main(["fit", "cfg.yaml", "--nproc", "0"]) == 2
    assert capsys.readouterr().err == "kiln: error: --nproc must be >= 1, got 0.\n"


def test_each_commands_help_lists_its_own_options(capsys: pytest.CaptureFixture) -> None:
    for command, own, other in (("fit", "--profile", "--weights"), ("evaluate", "--weights", "--profile")):
        assert cli.main([command, "--help"]) == 0
        out = capsys.readouterr().out.split("config keys")[0]  # the keys' own text may name any flag
        assert out.startswith(f"usage: kiln {command} CONFIG.yaml") and own in out and other not in out

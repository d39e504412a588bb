"""config/flags.py: every settings field has a flag, and every flag reaches the setting it names."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

import annotated_types
import pytest

from noloco_node.cli.main import build_parser, main
from noloco_node.config.flags import NODE_FLAGS, TRAIN_FLAGS, Flag, given_settings
from noloco_node.config.settings import Settings, leaf_fields, resolve

ALL_FLAGS = {**NODE_FLAGS, **TRAIN_FLAGS}
# Settings that are only valid together (the TLS files).
COMPANIONS = {
    "--tls-cert": ["--tls-key", "/tmp/key.pem"],
    "--tls-key": ["--tls-cert", "/tmp/cert.pem"],
    "--tls-ca": ["--tls-cert", "/tmp/cert.pem", "--tls-key", "/tmp/key.pem"],
}


def _bounds(info: Any) -> tuple[float | None, float | None]:
    low = high = None
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            low = item.ge
        elif isinstance(item, annotated_types.Gt):
            low = item.gt + (1 if isinstance(item.gt, int) else 1e-3)
        elif isinstance(item, annotated_types.Le):
            high = item.le
        elif isinstance(item, annotated_types.Lt):
            high = item.lt - (1 if isinstance(item.lt, int) else 1e-3)
    return low, high


def _sample(flag: Flag, info: Any, default: Any, tmp_path: Path) -> list[str]:
    """Command-line words that set this flag's setting to a valid value other than its default."""
    if flag.boolean:
        return [flag.name if not default else "--no-" + flag.name[2:]]
    if flag.choices:
        return [flag.name, str(next(c for c in flag.choices if c != default))]
    if flag.nargs:
        return [flag.name, "/ip4/127.0.0.1/tcp/4242/p2p/QmSample"]
    if flag.kind is Path:
        return [flag.name, str(tmp_path / flag.dest)]
    if flag.kind is str and flag.dest.endswith("_host"):
        return [flag.name, "203.0.113.7"]  # an announced host is an IP (noloco_node/addresses.py)
    if flag.kind is str:
        return [flag.name, f"sample-{flag.dest}"]
    low, high = _bounds(info)
    if flag.kind is int:
        base = default if default is not None else (low or 0)
        value = base + 1 if high is None or base + 1 <= high else base - 1
        return [flag.name, str(int(value))]
    if default:
        value = default * 0.9 if low is None or default * 0.9 >= low else default * 1.1
    else:
        value = low if low else (high if high is not None and high < 0.5 else 0.5)
    return [flag.name, repr(float(value))]


def _setting(settings: Settings, path: tuple[str, ...]) -> Any:
    value: Any = settings
    for part in path:
        value = getattr(value, part)
    return value


def test_every_setting_has_a_flag_with_help() -> None:
    sections = ("node", "train", "outer", "data")
    leaves = {path for path in leaf_fields() if path[0] in sections}
    assert leaves == {flag.path for flag in ALL_FLAGS.values()}
    assert all(flag.help and flag.help != flag.path[-1].replace("_", " ") for flag in ALL_FLAGS.values())


@pytest.mark.parametrize("name", sorted(ALL_FLAGS))
def test_every_flag_reaches_the_setting_it_names(name: str, tmp_path: Path) -> None:
    flag = ALL_FLAGS[name]
    info = leaf_fields()[flag.path]
    default = _setting(Settings(), flag.path)
    words = _sample(flag, info, default, tmp_path) + COMPANIONS.get(name, [])
    args = build_parser().parse_args(["config", "show", *words])
    settings, sources = resolve(None, {}, given_settings(args, ALL_FLAGS))
    value = _setting(settings, flag.path)
    assert value != default, f"{name} {words[1:]} left {'.'.join(flag.path)} at its default"
    parsed = getattr(args, flag.dest)
    expected = parsed if not isinstance(parsed, list) else [str(v) for v in parsed]
    if typing.get_origin(info.annotation) is list or isinstance(value, list):
        value = [str(v) for v in value]
    assert value == expected
    assert flag.path in sources


def test_quarantine_seconds_flag_is_shown_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    """The flag that once named a section that does not exist ("unknown setting security")."""
    assert main(["config", "show", "--quarantine-seconds", "30", "--no-check-reachability"]) == 0
    shown = capsys.readouterr().out
    assert "quarantine_seconds = 30.0  # flag --quarantine-seconds" in shown
    assert "check_reachability = false  # flag --check-reachability" in shown


def test_a_bad_flag_value_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--quarantine-seconds", "-5"]) == 2
    captured = capsys.readouterr()
    assert "node.security.quarantine_seconds" in captured.err + captured.out
    assert "flag --quarantine-seconds" in captured.err + captured.out


def test_swarm_passes_its_flags_on_unchanged() -> None:
    from noloco_node.cli.main import _SWARM_NODE_FLAGS
    from noloco_node.config.flags import as_arguments

    parser = build_parser()
    args = parser.parse_args(["swarm", "--mode", "overlap", "--steps", "40", "--secret-file", "/tmp/s"])
    flags = {**_SWARM_NODE_FLAGS, **TRAIN_FLAGS}
    again = parser.parse_args(["join", *as_arguments(args, flags)])
    assert given_settings(again, flags) == given_settings(args, flags)
    assert isinstance(args, argparse.Namespace)


def test_drills_are_no_setting_and_a_bad_one_is_named() -> None:
    """Fault injection (tests, drills, benchmarks) comes from NOLOCO_DRILL, never from a flag or a settings file."""
    from noloco_node.cli.main import build_parser
    from noloco_node.config.settings import env_layer
    from noloco_node.node.catch_up import NodeError
    from noloco_node.node.fault_injection import DRILL_ENV, Drill, fault_hooks

    join_help = build_parser()._subparsers._group_actions[0].choices["join"].format_help()  # type: ignore[union-attr]
    for drill_flag in ("--slow-factor", "--fail-at-inner-step", "--step-time-seconds", "--step-time-sigma"):
        assert drill_flag not in join_help
    env_layer({DRILL_ENV: '{"slow_factor": 3}'})  # a known variable, not a typo
    assert Drill.from_environment({}) == Drill() and fault_hooks(Drill(), "peer") == []
    drill = Drill.from_environment(Drill(slow_factor=3, fail_at_inner_step=7).environment())
    assert drill.slow_factor == 3 and drill.fail_at_inner_step == 7 and len(fault_hooks(drill, "peer")) == 2
    for bad, named in (
        ('{"slow_factor": 0.5}', "slow_factor"),
        ('{"slow_facter": 2}', "slow_facter"),
        ("{", ""),
        ('{"hold_after_inner_step": 3}', "release_file"),  # a hold without the file that ends it
    ):
        with pytest.raises(NodeError, match=DRILL_ENV) as refused:
            Drill.from_environment({DRILL_ENV: bad})
        assert named in str(refused.value)


def test_a_held_drill_waits_after_its_step_until_its_file_appears(tmp_path: Path) -> None:
    """A test holds a node inside its run (hold_after_inner_step, release_file): the trainer's hook returns at once
    at every other step, and at that one only once the file exists."""
    import threading
    from types import SimpleNamespace

    from noloco_node.node.fault_injection import Drill, fault_hooks

    release = tmp_path / "release"
    (hold,) = fault_hooks(Drill(hold_after_inner_step=3, release_file=str(release)), "peer")
    hold(SimpleNamespace(inner_step=2), None, 0.0)  # type: ignore[arg-type]  # not its step: no wait
    done = threading.Event()

    def at_its_step() -> None:
        hold(SimpleNamespace(inner_step=3), None, 0.0)  # type: ignore[arg-type]
        done.set()

    held = threading.Thread(target=at_its_step)
    held.start()
    assert not done.wait(0.3)  # held while the file is missing
    release.touch()
    assert done.wait(5)
    held.join()

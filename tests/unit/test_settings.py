"""Settings layers (settings.py): file < NOLOCO_* environment < flags, with sources, errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from noloco_node.cli.main import main
from noloco_node.config.settings import Settings, SettingsError, example, resolve, show

FILE = """
[train]
lr = 0.001
model_size = "small"

[node]
mode = "overlap"
bootstrap = ["/ip4/10.0.0.1/tcp/31337/p2p/QmA"]

[node.security]
norm_bound = 0.5
"""


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(FILE)
    return path


def test_a_flag_beats_the_environment_which_beats_the_file(toml_file: Path) -> None:
    env = {"NOLOCO_TRAIN__LR": "0.002", "NOLOCO_NODE__PAIR_TIMEOUT": "7"}
    flags = {"train": {"lr": 0.003}}
    settings, sources = resolve(toml_file, env, flags, flag_names={("train", "lr"): "flag --lr"})
    assert settings.train.lr == 0.003 and sources[("train", "lr")] == "flag --lr"
    settings, sources = resolve(toml_file, env, {})
    assert settings.train.lr == 0.002 and sources[("train", "lr")] == "$NOLOCO_TRAIN__LR"
    assert settings.node.pair_timeout == 7.0
    settings, sources = resolve(toml_file, {}, {})
    assert settings.train.lr == 0.001 and sources[("train", "lr")] == f"file {toml_file}"
    assert settings.train.model_size == "small" and settings.node.mode == "overlap"
    assert settings.node.security.norm_bound == 0.5 and settings.node.bootstrap == ["/ip4/10.0.0.1/tcp/31337/p2p/QmA"]
    assert ("train", "batch_size") not in sources  # a default has no source


def test_yaml_files_and_list_variables(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("train:\n  lr: 0.004\nnode:\n  security:\n    quarantine_seconds: 30\n")
    env = {"NOLOCO_NODE__BOOTSTRAP": "/ip4/1.2.3.4/tcp/1/p2p/A, /ip4/1.2.3.5/tcp/1/p2p/B"}
    settings, _ = resolve(path, env, {})
    assert settings.train.lr == 0.004 and settings.node.security.quarantine_seconds == 30
    assert settings.node.bootstrap == ["/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/1.2.3.5/tcp/1/p2p/B"]
    settings, _ = resolve(None, {"NOLOCO_NODE__DHT_HOST_MADDRS": '["/ip4/0.0.0.0/tcp/1"]'}, {})
    assert settings.node.dht_host_maddrs == ["/ip4/0.0.0.0/tcp/1"]


def test_unknown_keys_variables_and_bad_values_are_named_with_their_source(tmp_path: Path, toml_file: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nlr = -1\nlearning_rate = 3\n[node.security]\nswarm_secret = "hunter2-hunter2"\n[nodes]\n')
    with pytest.raises(SettingsError) as error:
        resolve(bad, {}, {})
    message = str(error.value)
    assert f"invalid setting train.lr: Input should be greater than 0 (got -1) from file {bad}" in message
    assert f"unknown setting train.learning_rate in file {bad}" in message
    assert "unknown setting node.security.swarm_secret" in message and "hunter2" not in message
    assert "unknown setting nodes" in message
    with pytest.raises(SettingsError, match="NOLOCO_TRAIN__LRR"):
        resolve(toml_file, {"NOLOCO_TRAIN__LRR": "1"}, {})
    with pytest.raises(SettingsError, match=r"node.mode.*from \$NOLOCO_NODE__MODE"):
        resolve(toml_file, {"NOLOCO_NODE__MODE": "async"}, {})
    with pytest.raises(SettingsError, match=r"wire_dtype int4 needs mode stream \(not overlap\)"):
        resolve(toml_file, {"NOLOCO_NODE__WIRE_DTYPE": "int4"}, {})
    assert resolve(toml_file, {"NOLOCO_NODE__WIRE_DTYPE": "int4", "NOLOCO_NODE__MODE": "stream"}, {})
    with pytest.raises(SettingsError, match=r"wire_dtype sparse needs mode stream \(not overlap\)"):
        resolve(toml_file, {"NOLOCO_NODE__WIRE_DTYPE": "sparse"}, {})
    sparse_stream = {"NOLOCO_NODE__WIRE_DTYPE": "sparse", "NOLOCO_NODE__MODE": "stream"}
    assert resolve(toml_file, {**sparse_stream, "NOLOCO_NODE__BLEND_MOMENTA": "true"}, {})
    assert resolve(toml_file, sparse_stream, {})
    with pytest.raises(SettingsError, match="does not parse"):
        (tmp_path / "broken.toml").write_text("[train\nlr=")
        resolve(tmp_path / "broken.toml", {}, {})
    (tmp_path / "settings.ini").write_text("[train]\n")
    with pytest.raises(SettingsError, match=r"use \.toml, \.yaml or \.yml"):
        resolve(tmp_path / "settings.ini", {}, {})


def test_the_example_changes_nothing_and_show_round_trips(tmp_path: Path, toml_file: Path) -> None:
    written = tmp_path / "example.toml"
    written.write_text(example())
    assert resolve(written, {}, {})[0] == Settings()
    assert "# lr = 0.003" in example() and "Peak learning rate" in example()
    settings, sources = resolve(toml_file, {"NOLOCO_TRAIN__LR": "0.002"}, {})
    shown = show(settings, sources, environ={"NOLOCO_SWARM_SECRET": "never-show-this-secret"})
    assert "never-show-this-secret" not in shown and "NOLOCO_SWARM_SECRET (value not shown)" in shown
    assert "lr = 0.002  # $NOLOCO_TRAIN__LR" in shown and f'mode = "overlap"  # file {toml_file}' in shown
    reloaded = tmp_path / "shown.toml"
    reloaded.write_text(shown)
    assert resolve(reloaded, {}, {})[0] == settings  # what show prints is a settings file of the same settings
    tomllib.loads(shown)


def test_config_commands(tmp_path: Path, toml_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("NOLOCO_NODE__PAIR_TIMEOUT", "3")
    assert main(["config", "show", "--config", str(toml_file), "--lr", "0.005", "--secret-file", "s.secret"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.005  # flag --lr" in out and "pair_timeout = 3.0  # $NOLOCO_NODE__PAIR_TIMEOUT" in out
    assert 'secret_file = "s.secret"  # flag --secret-file' in out and "swarm secret: from the file s.secret" in out
    assert main(["config", "show", "--lr", "-1"]) == 2
    assert "invalid setting train.lr" in capsys.readouterr().err
    target = tmp_path / "new.toml"
    assert main(["config", "init", str(target)]) == 0 and resolve(target, {}, {})[0] == Settings()
    with pytest.raises(SystemExit, match="exists"):
        main(["config", "init", str(target)])

"""The command line refuses a secret given in clear and unknown NOLOCO_* variables, before anything runs."""

from __future__ import annotations

import pytest

from noloco_node.cli.main import main


def test_a_secret_on_the_command_line_is_refused_without_echoing_it(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["join"], ["swarm"], ["peers"]):
        with pytest.raises(SystemExit) as refused:
            main([*command, "--secret", "s3cr3t-value-in-clear"])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert "never given on the command line" in err and "s3cr3t-value-in-clear" not in err


def test_an_unknown_noloco_variable_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NOLOCO_SWARM_SECRT", "typo")
    assert main(["sizes"]) == 2
    err = capsys.readouterr().err
    assert "NOLOCO_SWARM_SECRT" in err and "NOLOCO_SWARM_SECRET_FILE" in err and "typo" not in err
    monkeypatch.delenv("NOLOCO_SWARM_SECRT")
    assert main(["sizes"]) == 0

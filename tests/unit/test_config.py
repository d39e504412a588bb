"""Bad settings fail before anything runs, with a message that names the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from noloco_node.cli.main import main
from noloco_node.config.models import OuterConfig, SimulateConfig, TrainConfig, format_validation_error


def test_bad_value_is_named_by_its_dotted_path() -> None:
    with pytest.raises(ValidationError) as error:
        SimulateConfig(train={"lr": -1.0})
    assert "invalid setting train.lr" in format_validation_error(error.value)


def test_unknown_key_is_an_error_naming_it() -> None:
    with pytest.raises(ValidationError) as error:
        SimulateConfig(train={"learning_rate": 1e-3})
    assert "train.learning_rate" in format_validation_error(error.value)


def test_cross_field_checks() -> None:
    with pytest.raises(ValidationError, match="warmup_steps"):
        TrainConfig(warmup_steps=100, total_steps=50)
    with pytest.raises(ValidationError, match=r"alpha .* \[0, 1\)"):
        OuterConfig(alpha=1.5)
    assert OuterConfig(beta=0.6).effective_gamma == 0.6


def test_cli_reports_a_bad_flag_by_field_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--lr", "-0.5", "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "invalid setting train.lr" in err and "greater than 0" in err


def test_cli_reports_a_missing_data_path(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    assert main(["simulate", "--data", "/nonexistent/corpus", "--steps", "10", "--out", str(tmp_path)]) == 2
    assert "/nonexistent/corpus" in capsys.readouterr().err


def test_cli_sizes_lists_every_named_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizes"]) == 0
    out = capsys.readouterr().out
    for size in ("tiny", "small", "125m", "1.3b", "6.8b"):
        assert size in out

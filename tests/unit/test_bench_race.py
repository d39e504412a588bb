"""bench race's arithmetic: the deployment's scaling, a curve's time to a loss, and a swarm's curve."""

from __future__ import annotations

import pytest

from noloco_bench.race import Deployment, Emulation, MethodRun, RaceResult, swarm_curve


def test_the_emulation_keeps_the_deployments_exchange_to_phase_ratio() -> None:
    deployment = Deployment()
    # 6 * N * tokens / (peak * MFU): the datasheet arithmetic, not a measured figure
    assert deployment.step_seconds == pytest.approx(6 * deployment.params * deployment.tokens_per_step / (989e12 * 0.4))
    assert deployment.exchange_seconds() == pytest.approx(deployment.params * 2 * 8 / 100e6 + 0.05)
    emulation = Emulation(deployment, "tiny", step_seconds=0.3, inner_steps=25)
    target_ratio = deployment.exchange_seconds() / (25 * deployment.step_seconds)
    assert emulation.exchange_seconds / emulation.phase_seconds == pytest.approx(target_ratio)
    # the link carries tiny's bf16 payload in the scaled exchange time, less the scaled round trip
    transfer = emulation.payload_bytes * 8 / (emulation.rate_mbit * 1e6)
    assert transfer + emulation.rtt_ms / 1000 == pytest.approx(emulation.exchange_seconds)
    assert emulation.rtt_ms == pytest.approx(50 * 0.3 / deployment.step_seconds)


def test_time_to_a_loss_interpolates_between_evaluations() -> None:
    run = MethodRun("x", 10, [(10.0, 10, 3.0), (20.0, 20, 2.0), (30.0, 30, 1.5)], 30.0)
    assert run.time_to(3.5) == 10.0  # already there at the first evaluation
    assert run.time_to(2.5) == pytest.approx(15.0)
    assert run.time_to(1.5) == pytest.approx(30.0)
    assert run.time_to(1.0) is None


def test_a_swarms_curve_is_by_outer_step_from_the_first_trainer_start() -> None:
    # node b borrowed 3 steps while waiting (inner step 13 at its first outer step) and started 2 s later
    a = {"training_started_at": 100.0, "history": [
        {"outer_step": 1, "inner_step": 10, "time": 110.0, "val_loss": 3.0},
        {"outer_step": 2, "inner_step": 20, "time": 120.0, "val_loss": 2.0},
    ]}  # fmt: skip
    b = {"training_started_at": 102.0, "history": [
        {"outer_step": 1, "inner_step": 13, "time": 114.0, "val_loss": 3.2},
        {"outer_step": 2, "inner_step": 20, "time": 126.0, "val_loss": 2.2},
    ]}  # fmt: skip
    curve, finished = swarm_curve([a, b], inner_steps=10)
    assert curve == [(pytest.approx(12.0), 10, pytest.approx(3.1)), (pytest.approx(23.0), 20, pytest.approx(2.1))]
    assert finished == pytest.approx(26.0)


def test_a_method_that_ended_before_the_reference_quotes_its_final_loss_as_at_its_end() -> None:
    early = MethodRun("noloco-sync", 10, [(10.0, 10, 3.0), (20.0, 20, 2.5)], 20.0)
    late = MethodRun("noloco-stream", 10, [(10.0, 10, 3.0), (40.0, 20, 2.4), (60.0, 30, 2.3)], 60.0)
    diloco = MethodRun("diloco-10", 10, [(25.0, 10, 2.6), (50.0, 20, 2.0)], 50.0)
    result = RaceResult(nodes=2, steps=20, sigma=1.0, emulation=Emulation(Deployment(), "tiny", 0.3, 10))
    result.runs = {run.name: run for run in (early, late, diloco)}
    rows = {line.split(" | ")[0]: line for line in result.report().splitlines() if line.startswith("| ")}
    assert "not reached (2.5000 at its end, 20 s)" in rows["| noloco-sync"]
    assert "not reached (2.4000 at 50 s)" in rows["| noloco-stream"]
    assert "| 50 | 1.00x |" in rows["| diloco-10"]
    # at the first finish (noloco-sync's 20 s), each method's last evaluation by then
    assert "val loss at 20 s |" in result.report()
    assert rows["| noloco-sync"].endswith("| 2.5000 |") and rows["| noloco-stream"].endswith("| 3.0000 |")
    assert rows["| diloco-10"].endswith("| - |")


def test_a_run_stopped_at_the_time_cap_is_marked_and_says_how_far_it_got() -> None:
    diloco = MethodRun("diloco-10", 10, [(25.0, 10, 2.6), (50.0, 20, 2.0)], 50.0, megabytes_sent=1.25)
    capped = MethodRun("hivemind-10", 10, [(60.0, 10, 2.7)], 60.0, stopped=True, megabytes_sent=9.5)
    result = RaceResult(nodes=2, steps=20, sigma=1.0, emulation=Emulation(Deployment(), "tiny", 0.3, 10))
    result.runs = {run.name: run for run in (diloco, capped)}
    report = result.report()
    row = next(line for line in report.splitlines() if line.startswith("| hivemind-10 |"))
    assert "| 9.5 | 2.7000 | 60 (stopped) |" in row and "not reached (nothing by 50 s)" in row
    assert "hivemind-10: stopped at the time cap after 10 of 20 inner steps" in report


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--methods", "noloco-sync,ddp"], "--methods: unknown ddp; choose from noloco-sync"),
        (["--time-cap-factor", "0"], "--time-cap-factor must be above 0, not 0.0"),
    ],
)
def test_bad_race_flags_are_refused_by_name_before_any_namespace_exists(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from noloco_node.cli.main import main

    assert main(["bench", "race", "--nodes", "2", *flags]) == 2
    assert message in capsys.readouterr().err

"""node/supervisor.py: a background task that dies is restarted with backoff, visibly; one that keeps dying turns
/healthz unhealthy. The health verdict is the node's own (telemetry.py), served by the real HTTP server."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from noloco_node.node.supervisor import Supervisor
from noloco_node.observability.http_server import StatusServer
from noloco_node.observability.telemetry import HealthInputs, Telemetry


def _healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_task_killed_once_is_restarted_and_one_that_keeps_dying_makes_healthz_unhealthy() -> None:
    async def scenario() -> None:
        supervisor = Supervisor(initial_backoff=0.01, max_backoff=0.05, give_up_after=3)
        telemetry = Telemetry(tokens_per_step=1, degraded_after=600, stall_after=600)

        def health():
            return telemetry.health(
                HealthInputs(
                    trainer_started=True,
                    trainer_alive=True,
                    trainer_error=None,
                    stopping=False,
                    finished=False,
                    dht_alive=True,
                    task_problem=supervisor.problem(),
                )
            )

        server = StatusServer({}, healthz=health)
        port = await server.start("127.0.0.1", 0)
        runs = {"flaky": 0, "doomed": 0}
        recovered = asyncio.Event()

        async def flaky() -> None:  # killed on its first run, fine afterwards
            runs["flaky"] += 1
            if runs["flaky"] == 1:
                raise RuntimeError("killed on purpose")
            recovered.set()
            await asyncio.sleep(3600)

        async def doomed() -> None:  # dies every time
            runs["doomed"] += 1
            raise ConnectionError(f"death number {runs['doomed']}")

        try:
            supervisor.spawn("flaky", flaky)
            await asyncio.wait_for(recovered.wait(), 5)
            flaky_state = supervisor.tasks["flaky"]
            assert flaky_state.restarts == 1 and "killed on purpose" in flaky_state.last_error
            assert not flaky_state.gave_up and supervisor.problem() is None
            code, body = await asyncio.to_thread(_healthz, port)
            assert code == 200 and body.startswith("training"), body

            supervisor.spawn("doomed", doomed)
            for _ in range(200):
                if supervisor.tasks["doomed"].gave_up:
                    break
                await asyncio.sleep(0.01)
            assert supervisor.tasks["doomed"].gave_up and runs["doomed"] == 3
            code, body = await asyncio.to_thread(_healthz, port)
            assert code == 503 and "doomed" in body and "death number 3" in body, body
        finally:
            await supervisor.stop(timeout=5)
            await server.close()

    asyncio.run(scenario())

"""The deployment files stay valid and in step with the code: compose files through the compose-spec parser,
Kubernetes manifests against the API schemas, and every `noloco-node` command line and NOLOCO_* variable they
hold against the product's own CLI and settings (a renamed flag or setting fails here, not on someone's cluster)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose

from noloco_node.cli.main import build_parser
from noloco_node.config.node_config import KNOWN_ENVIRONMENT
from noloco_node.config.settings import env_layer, file_layer, resolve

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = sorted((ROOT / "deploy").glob("compose.*.yaml"))
K8S_FILES = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
KUBERNETES_VERSION = "1.33"


def _check_command(args: list[str]) -> None:
    """A command line the image's entrypoint (noloco-node) would run must parse."""
    build_parser().parse_args(args)


def _check_environment(env: dict[str, str]) -> None:
    noloco = {k: v for k, v in env.items() if k.startswith("NOLOCO_")}
    env_layer(noloco)  # raises on an unknown NOLOCO_* variable
    settings = {k: v for k, v in noloco.items() if k not in KNOWN_ENVIRONMENT and "$" not in v}
    resolve(None, settings, {})  # and on a value the settings refuse


def test_there_is_something_to_check() -> None:
    assert len(COMPOSE_FILES) >= 2 and len(K8S_FILES) >= 2 and len(DOCKERFILES) == 2


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_follow_the_compose_spec_and_the_cli(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = path.read_text()
    for name in set(re.findall(r"\$\{(\w+)", text)):
        monkeypatch.setenv(name, "203.0.113.7")  # what `docker compose` interpolates before parsing
    compose = PyCompose.from_yaml(text)
    assert compose.service_names()
    for service in yaml.safe_load(text)["services"].values():
        _check_command(service["command"])
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        env_layer(env)  # every variable name is known, including those compose fills in
        _check_environment({k: v for k, v in env.items() if "${" not in v})


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_kubernetes_manifests_validate_against_the_api_schemas(path: Path) -> None:
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        if document["kind"] in ("Deployment", "StatefulSet"):
            pod = document["spec"]["template"]["spec"]
            for container in pod["containers"]:
                _check_command(container["args"])
                env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
                _check_environment(env)
            assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_statefulset_has_a_volume_per_node_probes_and_scrape_annotations() -> None:
    nodes = next(
        d for d in yaml.safe_load_all((ROOT / "deploy/k8s/nodes.yaml").read_text()) if d["kind"] == "StatefulSet"
    )
    container = nodes["spec"]["template"]["spec"]["containers"][0]
    assert nodes["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    annotations = nodes["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_run_noloco_node_as_a_user_with_a_volume_and_a_healthcheck(path: Path) -> None:
    text = path.read_text()
    assert 'ENTRYPOINT ["noloco-node"]' in text and "STOPSIGNAL SIGTERM" in text
    assert re.search(r"^USER noloco$", text, re.M) and "VOLUME /data" in text
    assert "HEALTHCHECK" in text and "/healthz" in text
    env = dict(re.findall(r"(NOLOCO_\w+)=(\S+)", text))
    _check_environment(env)
    exposed = set(re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split())  # type: ignore[union-attr]
    assert exposed == {env["NOLOCO_NODE__GRPC_PORT"], env["NOLOCO_NODE__STATUS_PORT"], "31338"}
    assert env["NOLOCO_NODE__DHT_HOST_MADDRS"].endswith("/tcp/31338")


def test_the_systemd_unit_runs_a_graceful_unprivileged_node() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((ROOT / "deploy/systemd/noloco-node.service").read_text())
    service = unit["Service"]
    command = service["ExecStart"].split()
    assert command[0].endswith("/noloco-node")
    _check_command(command[1:])
    assert service["User"] == "noloco" and service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    assert "LoadCredential" in service and "secret" not in service["ExecStart"]
    unit_text = (ROOT / "deploy/systemd/noloco-node.service").read_text()
    assignments = [
        line.removeprefix("Environment=") for line in unit_text.splitlines() if line.startswith("Environment=")
    ]
    environment = dict(assignment.split("=", 1) for assignment in assignments)
    assert "NOLOCO_SWARM_SECRET_FILE" in environment
    env_layer(environment)


def test_the_example_settings_file_loads() -> None:
    path = ROOT / "deploy/node.example.toml"
    assert file_layer(path)
    settings, _ = resolve(path, {}, {})
    assert settings.node.grpc_port == 7000 and settings.train.model_size == "125m"

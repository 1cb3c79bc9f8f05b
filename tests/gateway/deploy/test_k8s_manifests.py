"""deploy/k8s: every manifest validates (strictly, unknown fields refused) against the Kubernetes
schemas bundled with kubernetes-validate (offline), and the manifests agree with tiergate: the
ConfigMap's config.yaml loads, the probes hit routes the app serves, the commands exist, every
secret is referenced by name and documented, and the selectors find their pods."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from gateway.app import create_app, route_templates
from gateway.settings import settings_from_dict

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
VERSION = "1.37.0"
SECRET = "tiergate-secrets"


def _docs() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _docs() if d["kind"] == kind]


def _pod_specs() -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in _docs() if d["kind"] in ("Deployment", "Job")]


@pytest.mark.parametrize("doc", _docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_strictly(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    (deployment, *_) = _by_kind("Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_the_kinds_the_issue_asks_for_are_there() -> None:
    kinds = {d["kind"] for d in _docs()}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job",
            "PersistentVolumeClaim", "ConfigMap"} <= kinds
    assert len(_by_kind("Deployment")) == 2  # the gateway and the workers


def test_config_loads_and_probes_hit_served_routes() -> None:
    (cm,) = _by_kind("ConfigMap")
    settings = settings_from_dict(yaml.safe_load(cm["data"]["config.yaml"]), base_dir="/etc/tiergate")
    assert settings.jobs.backend == "celery" and settings.ledger.journal_dir.startswith("/var/lib/tiergate/")
    served = set(route_templates(create_app(settings).router.routes).values())
    (gateway,) = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == "tiergate-gateway"]
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"/readyz", "/healthz", "/metrics"} <= served
    # every environment variable the config names is set in the pods that load it, from the Secret
    named = {settings.database.url_env, settings.redis.url_env, settings.jobs.broker_url_env,
             settings.server.admin_key_env} | {m.api_key_env for m in settings.models.values() if m.api_key_env}
    env = {e["name"] for e in container["env"]}
    assert named <= env


def test_commands_exist() -> None:
    import typer

    from gateway.cli import db_cmd, serve, worker

    cli = typer.Typer()  # the commands these pods run, registered as `tiergate` registers them
    cli.add_typer(db_cmd.app, name="db")
    serve.register(cli)
    worker.register(cli)
    runner = CliRunner()
    for spec in _pod_specs():
        for container in spec["containers"]:
            command = container["command"]
            assert command[0] == "tiergate"
            words = [w for w in command[1:] if not w.startswith("-")][:2]
            sub = words[:2] if words[0] == "db" else words[:1]
            result = runner.invoke(cli, [*sub, "--help"])
            assert result.exit_code == 0, (sub, result.output)


def test_secrets_by_name_and_documented() -> None:
    readme = (K8S / "README.md").read_text()
    keys = set()
    for spec in _pod_specs():
        for container in spec["containers"]:
            for e in container.get("env", []):
                if "valueFrom" in e:
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == SECRET
                    keys.add(ref["key"])
                else:
                    assert "key" not in e["name"].lower() and "url" not in e["name"].lower()  # no inline secrets
    assert keys and all(f"--from-literal={k}=" in readme for k in keys)


def test_selectors_find_their_pods() -> None:
    deployments = {d["metadata"]["name"]: d for d in _by_kind("Deployment")}
    for d in deployments.values():
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for hpa in _by_kind("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments.values()]
    for doc in _by_kind("PodDisruptionBudget") + _by_kind("Service"):
        selector = doc["spec"]["selector"].get("matchLabels", doc["spec"]["selector"])
        assert sum(selector.items() <= labels.items() for labels in pod_labels) == 1
    claims = {d["metadata"]["name"] for d in _by_kind("PersistentVolumeClaim")}
    for spec in _pod_specs():
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims

"""deploy/: the compose stack puts the gateway replicas behind the nginx reverse proxy (the
replicas listen on loopback only; host networking), gives each ledger writer its own journal
volume and runs migrations once, and the proxy's configuration carries the edge limits: header and body
read timeouts, body size limits, connections per client, upstream timeouts and SSE without
response buffering. Where Debian's nginx is installed, ``nginx -t`` checks the file too."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import load_settings

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
CONF = DEPLOY / "proxy" / "nginx.conf"


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        stmt = raw.split("#", 1)[0].strip()
        m = re.fullmatch(r"([a-z_]+)\s+(.*?);", stmt)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _gateways(services: dict[str, Any]) -> dict[str, Any]:
    return {name: svc for name, svc in services.items() if svc.get("command", [None, None])[:2] == ["tiergate", "serve"]}


def _port(svc: dict[str, Any]) -> int:
    cmd = svc["command"]
    return int(cmd[cmd.index("--port") + 1])


def test_compose_puts_the_gateways_behind_the_proxy() -> None:
    services = _compose()["services"]
    gateways = _gateways(services)
    assert len(gateways) >= 2, "at least two gateway replicas"
    ports = {_port(g) for g in gateways.values()}
    assert len(ports) == len(gateways), "each replica on its own port (host networking)"
    # nginx's upstream names exactly those ports, on loopback, where the replicas listen.
    upstream = re.search(r"upstream tiergate \{(.*?)\}", CONF.read_text(), re.S)
    assert upstream is not None
    assert {int(p) for p in re.findall(r"server 127\.0\.0\.1:(\d+) max_fails=0;", upstream.group(1))} == ports
    for g in gateways.values():
        cmd = g["command"]
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1", "replicas are reachable only through the proxy"
        assert "ports" not in g
    proxy = services["proxy"]
    assert proxy["build"]["dockerfile"] == "deploy/proxy/Dockerfile"
    assert set(gateways) <= set(proxy["depends_on"])
    assert _directives(CONF.read_text())["listen"] == ["28080"]
    dockerfile = (DEPLOY / "proxy" / "Dockerfile").read_text()
    assert "apt-get install" in dockerfile and " nginx" in dockerfile and "deploy/proxy/nginx.conf" in dockerfile


def test_compose_stack_has_its_services_a_journal_per_replica_and_one_migration() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"postgres", "redis", "rabbitmq", "migrate", "worker", "proxy"} <= set(services)
    assert all(svc["network_mode"] == "host" for svc in services.values())
    # Ports away from the machine's own PostgreSQL / Redis / RabbitMQ (5432 / 6379 / 5672).
    env = services["gateway-1"]["environment"]
    assert ":25432/" in env["TIERGATE_DATABASE_URL"] and ":26379/" in env["TIERGATE_REDIS_URL"]
    assert ":26672/" in env["TIERGATE_BROKER_URL"] and services["rabbitmq"]["environment"]["RABBITMQ_NODE_PORT"] == "26672"
    # One journal volume per ledger writer (each replica and the worker), each a named volume.
    writers = [*_gateways(services), "worker"]
    mounts = {name: services[name]["volumes"] for name in writers}
    volumes = [m[0].split(":")[0] for m in mounts.values()]
    assert all(len(m) == 1 and m[0].endswith(":/var/lib/tiergate") for m in mounts.values())
    assert len(set(volumes)) == len(writers) and set(volumes) <= set(compose["volumes"])
    # Migrations run once, by their own service; every writer starts after it completed.
    assert services["migrate"]["command"] == ["tiergate", "db", "upgrade"]
    for name in writers:
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert "db upgrade" not in (DEPLOY / "Dockerfile").read_text().split("CMD", 1)[1]


def test_image_config_matches_the_compose_stack() -> None:
    """The config baked into the image: journal on the replica's volume, Celery batches, the
    proxy trusted for X-Forwarded-For, and every file it names present."""
    settings = load_settings(DEPLOY / "config.yaml")
    assert settings.ledger.journal_dir.startswith("/var/lib/tiergate/")
    assert settings.jobs.backend == "celery" and settings.server.forwarded_allow_ips == "127.0.0.1"
    assert settings.startup_problems() == []
    assert "COPY deploy/config.yaml /etc/tiergate/config.yaml" in (DEPLOY / "Dockerfile").read_text()


def test_proxy_config_carries_the_edge_limits() -> None:
    d = _directives(CONF.read_text())
    for name in ("client_header_timeout", "client_body_timeout", "send_timeout", "keepalive_timeout",
                 "proxy_connect_timeout", "proxy_send_timeout", "proxy_read_timeout"):
        assert name in d, name
    assert d["client_header_timeout"] == ["10s"] and d["client_body_timeout"] == ["30s"]
    assert d["client_max_body_size"] == ["5m", "101m"]  # everything / the file upload location
    assert d["limit_conn"] == ["per_client 64"] and d["limit_conn_status"] == ["429"]
    assert d["proxy_buffering"] == ["off"]  # server-sent events are not held back
    assert d["proxy_set_header"].count("X-Forwarded-For $remote_addr") == 1  # replaced, never appended
    assert d["proxy_pass"] == ["http://tiergate", "http://tiergate"]


@pytest.mark.process
@pytest.mark.skipif(shutil.which("nginx") is None, reason="Debian's nginx is not installed here")
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(CONF.read_text().replace("/run/nginx.pid", str(tmp_path / "nginx.pid")))
    result = subprocess.run(["nginx", "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_smoke_override_only_slows_the_commits_of_the_replica_it_kills() -> None:
    """deploy/docker-compose.smoke.yml (make deploy-smoke) changes one replica's config file and
    nothing else, and deploy/smoke.py kills that replica and reads that replica's journal volume."""
    services = _compose()["services"]
    override = yaml.safe_load((DEPLOY / "docker-compose.smoke.yml").read_text())["services"]
    assert list(override) == ["gateway-1"] and "gateway-1" in _gateways(services)
    assert set(override["gateway-1"]) == {"environment", "volumes", "restart"}
    assert override["gateway-1"]["environment"] == {"TIERGATE_CONFIG": "/etc/tiergate/smoke.yaml"}
    smoke = (DEPLOY / "smoke.py").read_text()
    journal = services["gateway-1"]["volumes"][0].split(":")[0]
    assert '"--kill-service", default="gateway-1"' in smoke and f'"--kill-volume", default="{journal}"' in smoke
    assert "flush_interval_ms\"] = 2000" in (DEPLOY / "smoke.sh").read_text()

"""deploy/: the compose stack puts the gateway replicas behind the nginx reverse proxy (only the
proxy publishes a port), and the proxy's configuration carries the edge limits: header and body
read timeouts, body size limits, connections per client, upstream timeouts and SSE without
response buffering. Where Debian's nginx is installed, ``nginx -t`` checks the file too."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

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


def test_compose_puts_the_gateways_behind_the_proxy() -> None:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    proxy, gateway = services["proxy"], services["gateway"]
    assert proxy["build"]["dockerfile"] == "deploy/proxy/Dockerfile" and proxy["ports"] == ["8080:8080"]
    assert "gateway" in proxy["depends_on"]
    assert "ports" not in gateway, "the gateways must be reachable only through the proxy"
    assert gateway["environment"]["FORWARDED_ALLOW_IPS"] == "*"
    dockerfile = (DEPLOY / "proxy" / "Dockerfile").read_text()
    assert "apt-get install" in dockerfile and " nginx" in dockerfile and "deploy/proxy/nginx.conf" in dockerfile


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
    assert "gateway:8080 max_fails=0" in d["server"]


@pytest.mark.process
@pytest.mark.skipif(shutil.which("nginx") is None, reason="Debian's nginx is not installed here")
def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"  # the compose service name does not resolve here: point it at localhost
    conf.write_text(CONF.read_text().replace("gateway:8080", "127.0.0.1:8080").replace("/run/nginx.pid",
                                                                                   str(tmp_path / "nginx.pid")))
    result = subprocess.run(["nginx", "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

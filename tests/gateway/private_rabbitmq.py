"""A RabbitMQ node of a test's own (not a test module): Debian's ``rabbitmq-server`` started on free
ports with its node name, Erlang cookie, mnesia and log directories in the test's temporary
directory, so the test can stop and start it while the machine's shared broker (5672) is never
touched. Its data survives a stop: durable queues and persistent messages are there again after
``start`` (a broker restart, not a fresh broker).

Started through ``/usr/lib/rabbitmq/bin/rabbitmq-server`` (``/usr/sbin/rabbitmq-server`` switches
to the ``rabbitmq`` user, which cannot write the test's directories). Starting takes ~10 s on an
idle machine. The node registers with the machine's ``epmd`` (port 4369) under its own name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


def available() -> bool:
    return SERVER.exists() and shutil.which("erl") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRabbitMQ:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port, self.dist_port = _free_port(), _free_port()
        self.node = f"tgtest{uuid.uuid4().hex[:8]}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        home = directory / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex)
        cookie.chmod(0o400)
        (directory / "rabbitmq.conf").write_text("loopback_users = none\n")
        (directory / "enabled_plugins").write_text("[].\n")
        self.log = directory / "rabbitmq.out"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _env(self) -> dict[str, str]:
        d = self.directory
        return {**os.environ, "HOME": str(d / "home"), "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port), "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"), "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid")}

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the node; returns once it answers the AMQP handshake."""
        self.proc = subprocess.Popen([str(SERVER)], env=self._env(), stdout=self.log.open("ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"private rabbitmq-server exited: {self.log.read_text()[-2000:]}")
            if self._answers():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"private rabbitmq-server did not start: {self.log.read_text()[-2000:]}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                c.sendall(b"AMQP\x00\x00\x09\x01")
                return c.recv(8).startswith(b"\x01")  # connection.start: the broker is serving
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the node (SIGTERM: a clean broker shutdown, connections closed) and wait for it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

"""Real processes for an application's tests: ``tollgate all`` on a free
port (embedded, or on Redis), a private ``redis-server``, and ``tollgate
mock-provider``. Nothing is mocked: a test talks HTTP to the real binary.

The binary is ``$TOLLGATE_BIN`` or ``tollgate`` on ``PATH``; a test that
cannot find it (or ``redis-server``) fails and says so."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence


def binary() -> str:
    """The tollgate binary: ``$TOLLGATE_BIN``, else ``tollgate`` on ``PATH``."""
    path = os.environ.get("TOLLGATE_BIN") or shutil.which("tollgate")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(
            "the tollgate binary was not found: set TOLLGATE_BIN (e.g. target/debug/tollgate "
            "after `cargo build --bins`) or put tollgate on PATH"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Spawned:
    """A child whose stdout is read line by line until a test has what it needs."""

    def __init__(self, args: Sequence[str], until: str, timeout: float = 30.0) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        self.lines: List[str] = []
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while not any(until in line for line in self.lines):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.args} printed only {self.lines}")
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"{self.args} exited after printing {self.lines}")
            self.lines.append(line.rstrip("\n"))
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # type: ignore[union-attr]

    def value_after(self, needle: str) -> str:
        """The word after ``needle`` in the first line holding it."""
        for line in self.lines:
            if needle in line:
                rest = line[line.index(needle) + len(needle):]
                return rest.replace("'", " ").split(" ")[0]
        raise RuntimeError(f"no {needle!r} in {self.lines}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class Tollgate(_Spawned):
    """``tollgate all`` on a free port with ``config`` (TOML text; ``None``:
    none, the built-in config with its SDK mock); on Redis when ``redis_url``
    is given. ``base`` is its URL, ``key`` the development user's API key,
    ``admin_token`` the admin token."""

    def __init__(
        self, config: Optional[str], redis_url: Optional[str] = None, dev_user: str = "dev", flags: Sequence[str] = ()
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tollgate-py-"))
        args = [binary(), "all", "--listen", "127.0.0.1:0", "--dev-user", dev_user, *flags]
        if config is not None:
            path = self.dir / "tollgate.toml"
            path.write_text(config)
            args += ["--config", str(path)]
        if redis_url:
            args += ["--redis-url", redis_url, "--key-prefix", f"py{os.urandom(6).hex()}"]
        super().__init__(args, until="/v1/usage")
        self.base = self.value_after("listening on ")
        self.key = self.value_after("Bearer ")
        self.admin_token = self.value_after("admin token: ")

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)

    def __enter__(self) -> "Tollgate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MockProvider(_Spawned):
    """``tollgate mock-provider`` on a free port; ``url`` is its address."""

    def __init__(self, *flags: str) -> None:
        super().__init__([binary(), "mock-provider", "--listen", "127.0.0.1:0", *flags], until="listening on ")
        self.url = "http://" + self.value_after("listening on ")

    def __enter__(self) -> "MockProvider":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Redis:
    """A private ``redis-server`` on a free port, its data in a temporary
    directory (``--appendonly yes --appendfsync always``: what it acknowledged
    survives :meth:`stop` and :meth:`start`)."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is required (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tollgate-py-redis-")
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", self.dir,
             "--daemonize", "no", "--loglevel", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(7) == b"+PONG\r\n":
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within 10 s")

    def stop(self) -> None:
        """SIGKILL; the data directory stays for :meth:`start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

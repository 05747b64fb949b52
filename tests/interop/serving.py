"""``rlinf-vla serve`` in a subprocess for the interop tests (main env)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    """``python -m rlinf_vla.cli serve <overrides> server.port=0``, started at construction.

    :meth:`wait_port` returns the port it printed (``serving ... on ws://127.0.0.1:<port>``);
    :meth:`stop` interrupts it (SIGINT) and waits. ``lines`` holds its output.
    """

    def __init__(self, *overrides: str) -> None:
        cmd = [sys.executable, "-m", "rlinf_vla.cli", "serve", *overrides, "server.port=0"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
        )
        self.lines: list[str] = []
        self._port: list[int] = []
        self._found = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"serving \S+ on ws://127\.0\.0\.1:(\d+)", line)
            if m and not self._port:
                self._port.append(int(m.group(1)))
                self._found.set()
        self._found.set()  # exited without serving

    def wait_port(self, timeout: float = 180.0) -> int:
        self._found.wait(timeout)
        if not self._port:
            raise AssertionError("rlinf-vla serve did not start:\n" + "".join(self.lines))
        return self._port[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

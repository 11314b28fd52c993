"""A server process a benchmark starts for one measurement: its files and log in a
temporary directory, stopped with SIGTERM (SIGKILL if it will not go) and cleaned up."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


class ServerProcess:
    """A server started for one measurement, its files and log in a temporary directory."""

    def __init__(self, prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.log = open(self.dir / "server.log", "w+")
        self.proc: subprocess.Popen | None = None

    def stop(self, timeout_s: float = 60.0) -> str:
        """SIGTERM (SIGKILL after ``timeout_s``); its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return text

"""The thermal watch as the daemon shows it on this machine (one virtio disk, no NVMe, no udev
daemon): it starts, says plainly that nothing is throttled, and in STATUS= too."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tests.daemon.wire import WireClient
from tests.systemd.notify_socket import NotifySocket


def test_status_line_for_systemd_says_the_pack_is_not_on_nvme(start_daemon, monkeypatch):
    directory = Path(tempfile.mkdtemp(prefix="colibrid-notify-"))
    receiver = NotifySocket(directory / "notify.sock")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(receiver.path))
        daemon = start_daemon("--thermal-poll-s", "1")
        receiver.wait_for("READY=1")
        ready = receiver.lines()[receiver.lines().index("READY=1") + 1]
        with WireClient(daemon.socket_path) as client:
            client.hello()
            client.send({"op": "status", "id": 1})
            thermal = client.recv()["thermal"]
        returncode, stderr = daemon.terminate()
    finally:
        receiver.close()
        shutil.rmtree(directory, ignore_errors=True)
    assert ready.startswith("STATUS=serving demo: ") and ready.endswith("; no NVMe device, unthrottled")
    assert thermal["state"] == "unthrottled" and thermal["poll_s"] == 1.0
    assert returncode == 0 and "Traceback" not in stderr

"""SIGHUP reloads the config - what can change without the model - between RELOADING=1 and READY=1."""

from __future__ import annotations

import signal

from tests.daemon.wire import WireClient


def status(socket_path) -> dict:
    with WireClient(socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        return client.recv()


def test_sighup_applies_the_new_settings_without_reloading_the_model(start_service, notify_socket, work_dir):
    config = work_dir / "colibrid.toml"
    config.write_text("max_queue = 4\n")
    service = start_service("--config", str(config), env={"NOTIFY_SOCKET": str(notify_socket.path)})
    ready = notify_socket.wait_for("READY=1")
    before = status(work_dir / "colibrid.sock")
    assert before["queue_limit"] == 4 and before["settings"]["log_level"] == "info"
    with WireClient(work_dir / "colibrid.sock") as client:
        client.hello()
        client.ask("a", max_tokens=3)
        client.collect("a")

    assert before["cache"]["prefetch"] is True and before["cache"]["io_queue_depth"] == 16  # the defaults
    config.write_text('max_queue = 7\nlog_level = "debug"\nstall_timeout_s = 30\nmax_context = 64\n'
                      'prefetch = "off"\nio_queue_depth = 4\ncache_policy = "lfru"\n')
    service.proc.send_signal(signal.SIGHUP)
    reloading = notify_socket.wait_for("RELOADING=1", after=ready + 1)
    notify_socket.wait_for("READY=1", after=reloading + 1)
    after = status(work_dir / "colibrid.sock")
    assert after["queue_limit"] == 7
    assert after["cache"]["prefetch"] is False and after["cache"]["io_queue_depth"] == 4
    assert after["cache"]["policy"] == "lfru"
    assert after["settings"]["log_level"] == "debug" and after["settings"]["stall_timeout_s"] == 30.0
    # The same process and the same model: counters and uptime went on.
    assert after["requests_served"] == 1 and after["uptime_s"] > before["uptime_s"]
    assert service.proc.poll() is None

    config.write_text("max_queue = -1\n")  # a broken file: logged, and the running settings stay
    service.proc.send_signal(signal.SIGHUP)
    notify_socket.wait_for("READY=1", after=notify_socket.wait_for("RELOADING=1", after=reloading + 2) + 1)
    assert status(work_dir / "colibrid.sock")["queue_limit"] == 7

    returncode, stderr = service.stop()
    assert returncode == 0
    assert stderr.count("colibrid: serving demo") == 1, "the model was loaded once"
    assert "max_context changed to 64; it takes effect at the next restart" in stderr
    assert "max_queue: 4 -> 7" in stderr
    assert "reload failed, keeping the running configuration: max_queue = -1" in stderr
    assert "debug: colibrid.daemon.connection: connection" in stderr, "log_level debug applied at once"


def test_sighup_resizes_the_expert_cache_between_requests(start_service, notify_socket, work_dir):
    config = work_dir / "colibrid.toml"
    config.write_text('cache_size = "1M"\n')
    service = start_service("--config", str(config), env={"NOTIFY_SOCKET": str(notify_socket.path)})
    ready = notify_socket.wait_for("READY=1")
    before = status(work_dir / "colibrid.sock")["cache"]
    config.write_text('cache_size = "3M"\n')
    service.proc.send_signal(signal.SIGHUP)
    notify_socket.wait_for("READY=1", after=notify_socket.wait_for("RELOADING=1", after=ready + 1) + 1)
    with WireClient(work_dir / "colibrid.sock") as client:  # generation works on the new pool
        client.hello()
        client.ask("a", max_tokens=4)
        _, done = client.collect("a")
    after = status(work_dir / "colibrid.sock")["cache"]
    assert done["event"] == "done"
    assert after["slots"] > before["slots"] and after["region_bytes"] > before["region_bytes"]
    assert service.proc.poll() is None

"""colibri-openai under a real systemd (booted in a PID + mount namespace, as in
test_under_systemd.py): the shipped units installed with `make install`, the gateway started by
its socket unit on the first HTTP connection, colibrid by its own on the gateway's first ask.
The openai package's chat, streaming, completions and tool-call calls go through both. The pack
is tests/gateway/steered_pack.py's, whose Hermes chat template renders tools and whose answer is
a tool call, so a tool call can be checked end to end."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from pathlib import Path

import pytest

from tests.gateway.steered_pack import ANSWER_TEXT, build_steered_pack
from tests.hermes_template import WEATHER_TOOL
from tests.systemd.test_under_systemd import (
    PYTHON, SOCKET, WHY_NOT, _private_tmp_bindings, _service_environment, boot_systemd_with,
)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def booted_with_steered_pack():
    with tempfile.TemporaryDirectory(prefix="colibri-gw-") as directory:
        pack = build_steered_pack(Path(directory))
        with boot_systemd_with(pack) as systemd:
            yield systemd


def _service_drop_in(exec_start: str) -> str:
    return ("[Service]\nExecStart=\n" + f"ExecStart={exec_start}\n"
            "# This Python lives under /root: readable, not hidden (the namespace's /root holds only it).\n"
            "ProtectHome=read-only\n" + _private_tmp_bindings()
            + "".join(f"Environment={name}={value}\n" for name, value in _service_environment().items()))


def test_the_openai_package_through_the_socket_activated_gateway(booted_with_steered_pack):
    systemd = booted_with_steered_pack
    systemd.run("make", "-s", "-C", "/run/colibri-test/repo", "install", "UNITDIR=/etc/systemd/system",
                "SYSUSERSDIR=/etc/sysusers.d", "TMPFILESDIR=/etc/tmpfiles.d", "UDEVRULESDIR=/etc/udev/rules.d",
                "SYSCTLDIR=/etc/sysctl.d", "DOCDIR=/run/colibri-test/doc", "BINDIR=/usr/bin")
    systemd.run("systemd-sysusers", "/etc/sysusers.d/colibri.conf")
    port = _free_port()
    systemd.write("/etc/systemd/system/colibrid.service.d/test.conf", _service_drop_in(
        f"{PYTHON} -m colibrid --config /etc/colibri/colibrid.toml --model /run/colibri-test/demo.pack"))
    systemd.write("/etc/systemd/system/colibrid.socket.d/test.conf", f"[Socket]\nListenStream=\nListenStream={SOCKET}\n")
    systemd.write("/etc/systemd/system/colibri-openai.service.d/test.conf", _service_drop_in(
        f"{PYTHON} -m colibrid.gateway --config /etc/colibri/colibri-openai.toml --socket {SOCKET}"))
    systemd.write("/etc/systemd/system/colibri-openai.socket.d/test.conf",
                  f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n")
    systemd.run("systemctl", "daemon-reload")
    systemd.run("systemctl", "start", "colibrid.socket", "colibri-openai.socket")
    assert systemd.show("colibri-openai.service", "ActiveState") == "inactive"
    assert systemd.show("colibrid.service", "ActiveState") == "inactive"

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    # The first connection starts the gateway; its first ask starts colibrid.
    chat = client.chat.completions.create(model="demo", messages=question, temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == ANSWER_TEXT
    assert systemd.show("colibri-openai.service", "ActiveState") == "active"
    assert systemd.show("colibrid.service", "ActiveState") == "active"

    chunks = list(client.chat.completions.create(model="demo", messages=question, temperature=0, max_tokens=8,
                                                 stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == ANSWER_TEXT
    completion = client.completions.create(model="demo", prompt="Weather?", temperature=0, max_tokens=4)
    assert completion.object == "text_completion" and completion.usage.completion_tokens >= 1
    called = client.chat.completions.create(model="demo", messages=question, tools=[WEATHER_TOOL], temperature=0,
                                            max_tokens=8)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # Its own user (a dynamic one), in group colibri; not colibrid's user, not root.
    main_pid = systemd.show("colibri-openai.service", "MainPID")
    user, groups = systemd.run("ps", "-o", "user=,supgrp=", "-p", main_pid).stdout.split(maxsplit=1)
    assert user not in ("root", "colibri") and "colibri" in groups.split(","), (user, groups)

    systemd.run("systemctl", "stop", "colibri-openai.service", "colibrid.service")
    assert systemd.show("colibri-openai.service", "Result") == "success"
    journal = systemd.run("journalctl", "-u", "colibri-openai.service", "-o", "cat", "--no-pager").stdout
    assert "serving on 127.0.0.1:" in journal and "stopped" in journal, journal
    deadline = time.monotonic() + 5
    while systemd.show("colibri-openai.socket", "ActiveState") != "active":
        assert time.monotonic() < deadline
        time.sleep(0.1)

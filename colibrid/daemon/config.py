"""colibrid's settings: DaemonConfig, one field per key, and the checks of their values.

    model = "/var/lib/colibri/olmoe.pack"      <->  --model /var/lib/colibri/olmoe.pack
    max_queue = 16                             <->  --max-queue 16

colibrid.settings reads them (the defaults, then the file, then the flags) and checks every key
once, at start: the first bad one stops the daemon with one line that names the key, the value
and what is allowed.

Each field below is its key's only description. etc/colibri/colibrid.toml is written from this
table (`python -m colibrid.daemon.config > etc/colibri/colibrid.toml`; tests/daemon/test_config.py
fails when the two differ), and --help shows each key's summary. A key marked `reloadable`
takes effect on SIGHUP (`systemctl reload colibrid`); the others only at the next start, because
they are bound into something built once (the loaded model, the listening socket). To add a key:
a field here, its use, and - if reloadable - its use in Daemon.apply_reload; then write the
shipped file again.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibrid.settings import (BOOLEAN, LOG_LEVEL, REQUIRED, SOCKET_PATH, Check, ConfigError, ProgramSettings,
                               float_from_flag, int_from_flag, integer, is_int, is_number, number, one_of,
                               setting)

DEFAULT_CONFIG_PATH = Path("/etc/colibri/colibrid.toml")
# A frame must hold a hello and a short ask; above 64 MiB one client could pin too much memory.
MIN_FRAME_BYTES = 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Each connection costs a file descriptor and up to max_outbox_bytes of memory.
MAX_CONNECTIONS = 65536
MIN_OUTBOX_BYTES = 64 * 1024
MAX_OUTBOX_BYTES = 256 * 1024 * 1024
# Thermal thresholds a drive can meaningfully have, and the shortest poll: every poll makes the
# drive answer SMART commands, so it must stay a matter of seconds, never a tight loop.
MIN_THERMAL_C, MAX_THERMAL_C = 20.0, 120.0
MIN_THERMAL_POLL_S = 1.0


# --------------------------------------------------------------------------------------------
# The checks of values only the daemon has
# --------------------------------------------------------------------------------------------


def _is_pack_dir(value: Any) -> bool:
    return isinstance(value, str) and value != "" and Path(value).is_dir()


def _is_size(value: Any, minimum: int) -> bool:
    # Imported here: a percentage is of the memory budget, which only a size check needs measured.
    from colibrid.system.memory import parse_size

    if not isinstance(value, (str, int)) or isinstance(value, bool):
        return False
    try:
        return parse_size(value, "cache_size") >= minimum
    except (ValueError, OSError):
        return False


def _size(allowed: str, minimum: int = 1) -> Check:
    """Bytes (123), K/M/G/T ("6G") or a percentage of the memory budget ("40%"), at least ``minimum`` bytes."""
    return Check(allowed, lambda v: _is_size(v, minimum), int_from_flag)


def _principals_from_flag(text: str) -> list[str | int]:
    """--allow-users alice,1001 -> ["alice", 1001]: numbers are ids, anything else a name."""
    return [int(item) if item.strip().isdigit() else item.strip() for item in text.split(",") if item.strip()]


def _is_principal_list(value: Any) -> bool:
    return isinstance(value, list) and all((isinstance(v, str) and v != "") or (is_int(v) and v >= 0) for v in value)


def _is_hugepages(value: Any) -> bool:
    return value in ("auto", "thp", "off") or (is_int(value) and value >= 0)


def _is_celsius_setting(value: Any) -> bool:
    """"auto" or a temperature a drive can have, in °C."""
    return value == "auto" or (is_number(value) and MIN_THERMAL_C <= value <= MAX_THERMAL_C)


def _is_cpu_setting(value: Any) -> bool:
    # Imported here: affinity reads the machine's topology, which config parsing never needs otherwise.
    from colibrid.system.affinity import CpuListError, check_cpu_setting

    if not isinstance(value, str):
        return False
    try:
        check_cpu_setting(value)
    except CpuListError:
        return False
    return True


PACK_DIR = Check("must be the path of a pack directory (colibri-convert or python -m colibrid.tools.demo writes one)",
                 _is_pack_dir, normalise=Path)
SOCKET = dataclasses.replace(SOCKET_PATH, normalise=Path)
GROUP = Check('must be a group name, or "" to leave the group as created', lambda v: isinstance(v, str))
USERS = Check("must be a list of user names or uids", _is_principal_list, _principals_from_flag, tuple)
GROUPS = Check("must be a list of group names or gids", _is_principal_list, _principals_from_flag, tuple)
SECONDS = number(0, above=True, unit="seconds")
HUGEPAGES = Check('must be "auto", "thp", "off" or a whole number of 2 MiB pages', _is_hugepages,
                  lambda text: int(text) if text.isdigit() else text)
CELSIUS = Check(f'must be "auto" or a temperature in [{MIN_THERMAL_C:g}, {MAX_THERMAL_C:g}] (°C)', _is_celsius_setting,
                lambda text: text if text == "auto" else float_from_flag(text),
                lambda value: value if value == "auto" else float(value))


def _cpus(example: str) -> Check:
    return Check(f'"auto" or a CPU list such as "{example}" naming CPUs colibrid may run on', _is_cpu_setting)


# --------------------------------------------------------------------------------------------
# The keys
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonConfig:
    model: Path = setting(REQUIRED, PACK_DIR, "PATH", example="/var/lib/colibri/model.pack",
                          heading="The model, and who may use it", doc="The pack directory to serve.")
    socket: Path = setting(Path("/run/colibri/colibrid.sock"), SOCKET, "PATH", doc="""
        The Unix stream socket clients connect to (docs/protocol.md), unless systemd passes one.

        Its directory is created if missing (mode 0755, whatever the umask). Like OpenSSH's
        StrictModes, colibrid refuses a directory that it or one of its ancestors lets others
        change: owned by someone other than root or colibrid's user, or writable by group or others
        without the sticky bit (/tmp, sticky, is fine). A socket file left behind by a dead daemon
        is replaced (if it is ours); if a live daemon answers on it, colibrid refuses to start.
        Under systemd socket activation (colibrid.socket) the socket systemd passes is served
        instead, and this key is not used.""")
    socket_group: str = setting("colibri", GROUP, "GROUP", doc="""
        Group given to a socket colibrid binds itself, if that group exists.

        The socket's mode is 0660: its owner and this group may connect. Applied only if the group
        exists and colibrid may chown to it; "" leaves the group the socket was created with. Under
        socket activation colibrid.socket sets both.""")
    allow_users: tuple[str | int, ...] = setting((), USERS, "USERS", reloadable=True, doc="""
        Users allowed to connect, by name or uid (as a flag, comma-separated: alice,1001).

        Checked per connection against the peer's credentials (SO_PEERCRED). With allow_users and
        allow_groups both empty, anyone who can open the socket may (its mode and group are the
        gate). Otherwise a peer is served if its user is in allow_users or any of its groups is in
        allow_groups; root and colibrid's own user always are. Others get a `forbidden` error.""")
    allow_groups: tuple[str | int, ...] = setting((), GROUPS, "GROUPS", reloadable=True, doc="""
        Groups whose members may connect, by name or gid (as a flag, comma-separated).

        A peer any of whose groups is listed is served, as allow_users says.""")
    max_queue: int = setting(16, integer(1), "N", reloadable=True, heading="The batch", doc="""
        Requests that may wait while the batch runs.

        They wait for a free batch slot, or for KV memory. One more is answered at once with a
        `busy` error.""")
    max_batch: int = setting(8, integer(1, 256), "N", doc="""
        Requests decoding together.

        Each step advances every request of the batch by a token, and each routed expert is read
        and computed once per layer for all the requests routed to it, so the tokens per second of
        the whole box grow with the batch.""")
    prefill_chunk: int = setting(512, integer(1, 512), "TOKENS", doc="""
        Prompt tokens per step, in all.

        A new request's prompt is fed in chunks of this size between the running requests' tokens,
        so a long prompt slows the others' tokens instead of stopping them. Smaller: steadier
        tokens for the others; larger: faster first tokens. A step in which no request is
        generating yet (requests that arrived together) takes twice as many.""")
    kv_cache_size: str = setting("10%", _size(
        'must be a size above 0: bytes (123), K/M/G/T ("512M", "2G") or a percentage of the memory budget ("10%")'),
        "SIZE", doc="""
        Memory for the running requests' KV caches together: bytes, "2G", "512M" or "10%" of the
        memory budget.

        The budget is measured at start: MemAvailable or, if smaller, the room under the cgroup
        memory limit. Each request reserves its prompt plus max_tokens (at most max_context) when
        it joins the batch; one that does not fit now waits in the queue, and one that could never
        fit is refused with `invalid_params`.""")
    kv_cache_type: str = setting("f32", one_of("f32", "f16"), "TYPE", doc="""
        What attention layers store their keys and values as: "f32" or "f16".

        "f32" keeps the model's numbers exactly; "f16" halves the KV memory (a request's
        reservation, and what prefix reuse keeps) and what attention reads each token, rounding
        each key and value to float16 as it is stored (llama.cpp's default cache type). Latent
        (DeepSeek-V3) and recurrent (DeltaNet) states stay float32.""")
    prefix_cache_size: str = setting("5%", _size(
        'must be a size: bytes (123, or 0 for off), K/M/G/T ("512M", "1G") or a percentage of the memory budget ("5%")',
        minimum=0), "SIZE", doc="""
        Memory for prefix reuse: bytes, "1G", "512M" or "5%" of the memory budget; 0 turns it off.

        The states of finished requests are kept so that a request whose tokens begin with the
        same ones prefills only the rest (the next turn of a chat, which resends the conversation
        so far; a shared system prompt; the same document asked again). A percentage is of the
        budget at start, as for kv_cache_size. The least recently used leave first; a request gets
        a copy, so its answer is exactly what it would be without reuse
        (`usage.cached_prompt_tokens` says how many prompt tokens were reused). Per kept token, a
        full-attention layer costs 2 x kv_heads x head_dim x 4 bytes (OLMoE-1B-7B: 256 KiB a
        token over its 16 layers).""")
    max_frame_bytes: int = setting(1024 * 1024, integer(MIN_FRAME_BYTES, MAX_FRAME_BYTES), "BYTES", reloadable=True,
                                   heading='What one client may cost (docs/protocol.md, "Limits")', doc="""
        Largest frame, in bytes, accepted from a client (length prefix excluded).

        Announced to clients in `hello`. A longer length prefix costs that client its connection,
        before a byte of the body is read. A reload applies it to new connections.""")
    max_connections: int = setting(128, integer(1, MAX_CONNECTIONS), "N", reloadable=True, doc="""
        Clients connected at once.

        One more is answered with a `busy` error (id null) and closed at once, rather than left
        waiting. Each connection holds a file descriptor: keep this well under the open files
        limit (LimitNOFILE= in colibrid.service, 8192; colibrid raises its soft limit to the hard
        one at start and warns when this does not fit).""")
    max_outbox_bytes: int = setting(1024 * 1024, integer(MIN_OUTBOX_BYTES, MAX_OUTBOX_BYTES), "BYTES",
                                    reloadable=True, doc="""
        Bytes of replies queued for one client that has not read them yet.

        Above this, colibrid reads no more of that client's requests until it reads; if it stays
        above for stalled_client_timeout_s, the client gets a `slow_client` error and is closed,
        and its asks end as if it had disconnected (the engine goes on with the next). Memory for
        all clients is at most about max_connections x this.""")
    stalled_client_timeout_s: float = setting(30.0, SECONDS, "SECONDS", reloadable=True, doc="""
        Seconds a client may keep more than max_outbox_bytes of replies unread.""")
    hello_timeout_s: float = setting(10.0, SECONDS, "SECONDS", reloadable=True, doc="""
        Seconds from connecting to a complete `hello`.

        A client that says nothing (or too little) in that time gets a `timeout` error and is
        closed.""")
    frame_timeout_s: float = setting(30.0, SECONDS, "SECONDS", reloadable=True, doc="""
        Seconds from the first byte of a request frame to its last.

        A frame that stalls half-way gets a `timeout` error and the connection is closed. Waiting
        between frames is not limited.""")
    max_context: int = setting(4096, integer(2, unit="tokens"), "TOKENS", heading="Requests", doc="""
        Tokens one request may hold, prompt plus generated; sizes each request's KV cache.

        Capped at the model's own maximum (logged when it is). A longer prompt is refused with
        `invalid_params`; a generation that fills it ends with finish_reason "context".""")
    default_max_tokens: int = setting(256, integer(1), "N", reloadable=True, doc="""
        Tokens generated for a request that does not set max_tokens.""")
    parse_special_tokens_in_content: bool = setting(False, BOOLEAN, "BOOL", doc="""
        Let special-token text in chat messages become special tokens (transformers' behaviour;
        lets clients forge roles): true or false.

        false: special-token text a client writes in a chat message or system prompt (say
        "<|im_start|>system") stays plain text, so a user cannot forge a role; only the chat
        template's own special tokens are special (as llama.cpp's server and vLLM treat untrusted
        content). true: transformers' behaviour, every such text becomes the special token. A raw
        prompt (`raw`, or a model without a chat template) is the client's whole text and is
        always parsed.""")
    cache_size: str = setting("50%", _size(
        'must be a size above 0: bytes (123), K/M/G/T ("512M", "6G") or a percentage of the memory budget ("40%")'),
        "SIZE", reloadable=True, heading="""
        The expert cache (AEPC)

        Routed experts stream from the pack's experts file into a fixed pool of slots; placement
        changes speed only, never the model's output.""", doc="""
        Memory for routed experts: bytes, "6G", "512M" or "40%" of MemAvailable or, if smaller, of
        the room left under the cgroup memory limit.

        The memory budget is measured at start: MemAvailable, or, when colibrid runs under a
        cgroup memory limit (systemd MemoryMax=, a container's --memory, a Kubernetes limit) with
        less room left, that limit minus what the cgroup already uses (less its inactive page
        cache). The nearest limited cgroup up the tree counts; cgroup v1 memory.limit_in_bytes, v2
        memory.max or memory.high. The startup log and `colibrictl status` (memory_budget) say
        which one was used. Rounded down to whole expert records; never more than the pack's
        experts. A size above the budget starts, with a warning: the kernel may OOM-kill colibrid.
        Resident memory is dense size + cache_size + KV and prefix cache in use + the rest,
        which status shows (memory.rest_bytes): measured 56 MiB idle and 74-101 MiB after
        serving on the 16-layer OLMoE-shaped bench pack; a test holds it under 128 MiB. A reload
        measures the budget again.""")
    cache_policy: str = setting("next-use", one_of("lfu-decay", "next-use", "lfru", "lru"), "POLICY",
                                reloadable=True, doc="""
        Which cached expert to evict: "next-use", "lfu-decay", "lfru" or "lru".

        "next-use": the one whose next request is expected farthest ahead (how soon its layer
        comes round in the pass over the layers, and how often tokens requested it lately,
        half-life 16 tokens); on trained models' routing it reads the fewest bytes at every cache
        size, see docs/performance-log.md. "lfu-decay": the expert requested least, counting each
        request less the longer ago it was. "lfru": per-layer quotas, then least frequently used
        with aging. "lru": least recently used.""")
    io_queue_depth: int = setting(16, integer(1, 32), "N", reloadable=True, doc="""
        Expert reads in flight at most (O_DIRECT, one read per expert record).

        The thermal watch lowers it when the drive runs hot.""")
    prefetch: str = setting("lookahead", one_of("lookahead", "off"), "MODE", reloadable=True, doc="""
        Read the next layer's predicted experts early: "lookahead" or "off".

        "lookahead": once layer l's own expert reads are done, apply layer l+1's router to layer
        l's input and start reading the (up to 4 per token) experts it ranks highest, so the disk
        works through the rest of layer l and layer l+1's attention; "off": read only what is
        asked. On by default: with a trained model's routing the guesses are 94 % right, and on
        the OLMoE-shaped pack it measured 1.88x the tokens/s of reading on demand inside a memory
        limit of 40 % of the pack, 1.06x with a 25 % cache and no limit, and the same (within 1 %)
        at 50 % (docs/performance-log.md). Turn it off when the disk is shared and every read
        counts: the wrong guesses still cost a read each.""")
    lookahead_predictor: str = setting("router-on-moe-input", one_of("router-on-moe-input", "router-on-residual"),
                                       "PREDICTOR", doc="""
        What lookahead guesses the next layer's experts from: "router-on-moe-input" or
        "router-on-residual".

        "router-on-moe-input" applies layer l+1's router to layer l's MoE input as soon as layer
        l's own reads are done; "router-on-residual" applies it to the residual stream leaving
        layer l, normed as layer l+1 will norm it (what layer l+1 would see if its attention added
        nothing): on the trained models' real routing it catches a few more of the next layer's
        experts for the same reads, but can start them only once layer l's experts have all run
        (docs/performance-log.md, "Lookahead predictors on real routing"). Used only while
        prefetch is "lookahead".""")
    hugepages: str | int = setting("auto", HUGEPAGES, "MODE", doc="""
        Backing of the expert cache: "auto", "thp", "off" or a number of 2 MiB pages.

        "auto": 2 MiB hugetlb pages, raising vm.nr_hugepages when colibrid has the privilege and
        giving them back at exit; else transparent hugepages; else ordinary pages. "thp":
        transparent hugepages. "off": ordinary pages. A number N: raise vm.nr_hugepages to at
        least N and require hugetlb pages. Every fallback is logged and shown in `colibrictl
        status`. See etc/sysctl.d/60-colibri.conf for a persistent setting.

        Hugetlb pages are not charged to a cgroup v1 memory limit, nor to v2's memory.max unless
        cgroup2 is mounted with memory_hugetlb_accounting (only the hugetlb controller counts
        them): under such a limit "auto" uses hugetlb pages already free but never raises
        vm.nr_hugepages, which would take memory from outside the limit; a number N still raises
        it. The cache is sized from the budget either way.""")
    lock_memory: str = setting("try", one_of("required", "try", "off"), "MODE", doc="""
        mlock the expert cache, so that experts are never swapped out: "required", "try" or "off".

        "required": refuse to start if the lock fails, with the fix (LimitMEMLOCK=infinity or
        CAP_IPC_LOCK); "try": log and go on; "off": do not lock.""")
    hugepage_record: Path = setting(Path("/run/colibri/hugepages.json"),
                                    Check("must be a non-empty path", lambda v: isinstance(v, str) and v != "",
                                          normalise=Path), "PATH", doc="""
        File where colibrid writes down the hugepages it raised, so that the next start gives back
        those of a colibrid that was killed.

        It holds the pages colibrid added to vm.nr_hugepages (pid, start time, pages): if colibrid
        is killed or crashes before giving them back, the next colibrid to start gives them back
        (only pages still free). Written as root, atomically (a new file, then rename), never
        through a symbolic link; a record not owned by colibrid's user is ignored.""")
    thermal: str = setting("auto", one_of("auto", "off"), "MODE", reloadable=True, heading="""
        The thermal watch (docs/thermal.md)

        It finds the NVMe drive under the pack's experts file, reads its temperature, and slows
        expert reads down before the drive throttles.""", doc="""
        Throttle expert reads when the NVMe drive under the pack runs hot: "auto" or "off".

        "auto": watch the NVMe drive(s) under the experts file (a pack on tmpfs, a network file
        system, virtio or SATA runs unthrottled, and `colibrictl status` says so); "off": never
        throttle (temperatures are not read).""")
    thermal_poll_s: float = setting(5.0, number(MIN_THERMAL_POLL_S, unit="seconds"), "SECONDS", reloadable=True, doc="""
        Seconds between reads of the drive's temperature.

        Each read makes the drive answer a SMART command, so this is seconds, not a tight loop.""")
    thermal_throttle: float | str = setting("auto", CELSIUS, "CELSIUS", reloadable=True, doc="""
        Temperature (°C) above which expert reads are throttled, or "auto".

        Above this composite temperature the reads in flight are halved at every poll (down to
        one) and prefetch is paused; at or below thermal_resume everything is restored. "auto":
        the drive's warning threshold minus 5 °C, or 65 °C if the drive does not say. At the
        drive's critical threshold (80 °C if it does not say) expert loading pauses: requests that
        need an expert not in memory fail with a `thermal` error, cached experts keep serving.
        thermal_resume must be below thermal_throttle.""")
    thermal_resume: float | str = setting("auto", CELSIUS, "CELSIUS", reloadable=True, doc="""
        Temperature (°C) below which throttled reads are restored, or "auto".

        "auto": thermal_throttle minus 5 °C.""")
    shutdown_grace_s: float = setting(30.0, number(0, unit="seconds"), "SECONDS", reloadable=True,
                                      heading="Stopping, and the health check", doc="""
        Seconds accepted requests may still run after SIGTERM.

        Those are the running and the queued ones; what is not finished by then ends with a
        `shutdown` error. New requests are refused meanwhile. A second SIGTERM ends the grace
        period at once. Keep TimeoutStopSec= in colibrid.service above this plus about 15 s.""")
    stall_timeout_s: float = setting(120.0, SECONDS, "SECONDS", reloadable=True, doc="""
        Seconds without a token on an accepted request before the health check fails.

        The health check is behind the systemd watchdog. Processing the prompt counts as
        producing the first token, so allow for the longest prompt. While the check fails colibrid
        stops sending WATCHDOG=1, and systemd restarts it WatchdogSec= later.""")
    cpu_affinity: str = setting("auto", _cpus("0-3,8"), "CPUS", heading="CPUs, niceness and logging", doc="""
        CPUs for the engine thread (and the native compute threads it starts): "auto" or a list
        like 0-3,8.

        "auto": one logical CPU per physical core. Otherwise a Linux CPU list naming CPUs colibrid
        may use. Shown in `colibrictl status`.""")
    io_cpus: str = setting("auto", _cpus("4,5"), "CPUS", doc="""
        CPUs for the server and I/O threads: "auto" or a list like 4,5.

        "auto": the SMT siblings of the compute CPUs (on a machine without SMT, anywhere).
        Otherwise a Linux CPU list naming CPUs colibrid may use. Shown in `colibrictl status`.""")
    nice: int = setting(0, integer(-20, 19), "N", doc="""
        Scheduling niceness set at start, -20 (most favoured) to 19; 0 leaves it as inherited.

        Negative values need CAP_SYS_NICE; without it the setting is logged and skipped.""")
    log_level: str = setting("info", LOG_LEVEL, "LEVEL", reloadable=True, doc="""
        How much colibrid logs to stderr (the journal under systemd).

        info logs startup, shutdown and problems; debug adds one line per connection and request.
        Under systemd (JOURNAL_STREAM names stderr) every line starts with its sd-daemon priority,
        <3> error to <7> debug, so `journalctl -p warning` works.""")


def _check_thermal_hysteresis(values: dict[str, Any]) -> None:
    """Resuming at or above the throttle temperature would flap at every poll."""
    throttle, resume = values.get("thermal_throttle", "auto"), values.get("thermal_resume", "auto")
    if throttle != "auto" and resume != "auto" and resume >= throttle:
        raise ConfigError(f"thermal_resume = {resume:g} must be below thermal_throttle = {throttle:g} "
                          "(the gap keeps the throttle from switching on and off at every poll)", key="thermal_resume")


DAEMON_SETTINGS = ProgramSettings(
    program="colibrid",
    config_type=DaemonConfig,
    default_path=DEFAULT_CONFIG_PATH,
    description="Serve a Mixture-of-Experts model over a Unix socket (protocol: docs/protocol.md).",
    file_header="""
        colibrid configuration. Installed as /etc/colibri/colibrid.toml; read at start, and again
        on SIGHUP (`systemctl reload colibrid`). Keys marked "Reloadable" take effect on reload
        without reloading the model; the others are kept until the next restart (a change is
        logged).

        Every key below is also a command-line flag of the same name in kebab case (max_queue <->
        --max-queue); a flag overrides the file, the file overrides the default. Keys shown
        commented out are at their default. An unknown key or a value out of range stops colibrid
        at start with one line naming the key (exit code 2).

        These descriptions are written from colibrid/daemon/config.py, the daemon's one table of
        keys (python -m colibrid.daemon.config).""",
    reloads=True,
    check_together=_check_thermal_hysteresis,
)
KEYS = DAEMON_SETTINGS.keys


def build_arg_parser() -> argparse.ArgumentParser:
    return DAEMON_SETTINGS.arg_parser()


def load_config(argv: Sequence[str] | None = None) -> DaemonConfig:
    """The defaults, then the file, then the flags; ConfigError for the first bad key."""
    return DAEMON_SETTINGS.load(argv)


if __name__ == "__main__":  # python -m colibrid.daemon.config > etc/colibri/colibrid.toml
    print(DAEMON_SETTINGS.documented_toml(), end="")

"""The daemon's `verify` request: the whole pack checked (colibrid/pack/verify.py) while the
daemon serves, one verify at a time, on a thread of its own at idle I/O priority.

Why a thread of its own rather than tasks between engine steps (EngineLoop.run_between_steps):
a task runs on the engine thread, so the time to read and hash each chunk would be added to
the step after it - to the next token of every running request. This thread adds nothing to a
step:
  - a verify in the foreground (`colibrictl verify`, the client watching its progress) reads
    only while the engine is idle (no request running or waiting), checking before each read:
    a request that arrives waits at most for the one read in flight, which the disk serves
    after the expert loads (IOPRIO_CLASS_IDLE). It ends when its client goes away.
  - a scrub in the background (`colibrictl verify --background`) goes on while requests run,
    since a busy daemon would otherwise never finish one, but at a bandwidth cap
    (max_mb_per_s, DEFAULT_BACKGROUND_MB_PER_S), at idle I/O priority and at the lowest CPU
    priority. It outlives the connection that started it; `verify` with `stop` ends it.
The thread's I/O class is set with ioprio_set before it starts the loader's I/O threads and
its hashing thread, which inherit it; if the kernel refuses, the verify runs anyway at normal
priority and says so (log and status).

What a verify finds marks the pack's damaged expert records (pack.damage), so the requests
that need one fail at once; a record it reads intact loses its mark. A shutdown stops it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colibrid import native
from colibrid.pack.damage import DamagedRecord
from colibrid.pack.verify import PackVerifier
from colibrid.pack.verify_report import Damage, Progress, VerifyControls, VerifyReport

log = logging.getLogger(__name__)

DEFAULT_BACKGROUND_MB_PER_S = 50.0  # a background scrub's cap: ~3 minutes a 10 GB pack, ~1 % of an NVMe drive
IDLE_POLL_S = 0.05  # how often a paused foreground verify looks whether the engine is idle again
CPU_NICE = 19  # the verify threads' niceness: hashing yields the CPU to the engine
MAX_KEPT_DAMAGE = 64  # findings of the last verify kept for status


class VerifyBusy(Exception):
    """A verify is already running."""


@dataclass
class VerifyRun:
    """One verify: who started it, how it reads, how far it is."""

    origin: str  # the connection, for the log and status
    background: bool
    max_mb_per_s: float | None
    on_progress: Callable[[dict], None]
    on_damage: Callable[[Damage], None]
    on_done: Callable[[VerifyReport], None]
    controls: VerifyControls = field(default_factory=VerifyControls)
    started_s: float = field(default_factory=time.monotonic)
    progress: Progress | None = None
    paused: bool = False  # waiting for the engine to be idle (foreground only)
    thread_id: int | None = None  # the reading thread's Linux tid
    io_priority: str = "idle"  # or why it is not

    def status(self) -> dict[str, Any]:
        progress = self.progress.to_json() if self.progress is not None else {}
        return {"running": True, "mode": "background" if self.background else "foreground", "started_by": self.origin,
                "max_mb_per_s": self.max_mb_per_s, "paused": self.paused, "io_priority": self.io_priority,
                "thread_id": self.thread_id, **progress}


class PackVerification:
    """The verify of the pack a daemon serves. ``busy()`` says whether the engine has work
    (the foreground verify waits while it does); ``io_queue_depth()`` the loader's reads in
    flight now (the verify reads at the same depth)."""

    def __init__(self, pack, busy: Callable[[], bool], io_queue_depth: Callable[[], int]) -> None:
        self.pack = pack
        self._busy = busy
        self._io_queue_depth = io_queue_depth
        self._lock = threading.Lock()
        self._run: VerifyRun | None = None
        self._thread: threading.Thread | None = None
        self._last: dict[str, Any] | None = None  # the last verify's outcome, for status

    def start(self, run: VerifyRun) -> None:
        """Start ``run`` on its thread; VerifyBusy if one is running."""
        with self._lock:
            if self._run is not None:
                raise VerifyBusy(self._describe_running(self._run))
            self._run = run
            self._thread = threading.Thread(target=self._work, args=(run,), name="colibrid-verify", daemon=True)
        if run.max_mb_per_s:
            run.controls.max_bytes_per_s = run.max_mb_per_s * 1e6
        run.controls.progress_interval_s = 1.0
        run.controls.on_progress = lambda progress: self._progress(run, progress)
        run.controls.on_damage = run.on_damage
        run.controls.on_expert = self._expert_checked
        if not run.background:
            run.controls.before_read = lambda: self._wait_for_idle(run)
        log.info("verify of %s started by %s (%s%s)", self.pack.path, run.origin,
                 "background" if run.background else "foreground",
                 f", at most {run.max_mb_per_s:g} MB/s" if run.max_mb_per_s else "")
        self._thread.start()

    def stop(self, run: VerifyRun | None = None) -> bool:
        """Stop ``run`` (or whichever runs) at its next read; False if it was not running."""
        with self._lock:
            current = self._run
        if current is None or (run is not None and current is not run):
            return False
        current.controls.stop.set()
        return True

    def shutdown(self, timeout_s: float) -> None:
        """Stop the running verify and wait up to timeout_s for its thread (a shutdown)."""
        self.stop()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout_s)

    def status(self) -> dict[str, Any]:
        with self._lock:
            run = self._run
        if run is not None:
            return {**run.status(), "last": self._last}
        return {"running": False, "last": self._last}

    # ---- the verify thread ------------------------------------------------------------------

    def _work(self, run: VerifyRun) -> None:
        run.thread_id = threading.get_native_id()
        self._lower_priority(run)
        report = None
        try:
            report = PackVerifier(self.pack.path, queue_depth=self._io_queue_depth(), controls=run.controls).run()
        except Exception:  # the daemon must survive a failed verify as it survives a failed request
            log.exception("verify of %s failed", self.pack.path)
            report = VerifyReport(str(self.pack.path), notes=["the verify failed; see the daemon log"], cancelled=True)
        finally:
            with self._lock:
                self._run = None
                self._last = self._summary(run, report)
        self._log_report(run, report)
        run.on_done(report)

    def _lower_priority(self, run: VerifyRun) -> None:
        """Idle I/O class and the lowest CPU priority for this thread and those it starts."""
        try:
            native.set_io_priority(native.IoClass.IDLE)
        except native.ColibriError as exc:
            run.io_priority = f"normal: ioprio_set refused ({exc})"
            log.warning("verify: cannot lower its I/O priority, reading at normal priority: %s", exc)
        try:
            os.setpriority(os.PRIO_PROCESS, run.thread_id, CPU_NICE)  # Linux: per thread
        except OSError as exc:
            log.warning("verify: cannot lower its CPU priority: %s", exc.strerror)

    def _wait_for_idle(self, run: VerifyRun) -> None:
        """Before each read of a foreground verify: wait while the engine has requests."""
        while self._busy() and not run.controls.stop.is_set():
            if not run.paused:
                run.paused = True
                self._emit_progress(run)
            run.controls.stop.wait(IDLE_POLL_S)
        if run.paused:
            run.paused = False
            self._emit_progress(run)

    def _progress(self, run: VerifyRun, progress: Progress) -> None:
        run.progress = progress
        self._emit_progress(run)

    @staticmethod
    def _emit_progress(run: VerifyRun) -> None:
        if run.progress is not None:
            run.on_progress({**run.progress.to_json(), "paused": run.paused})

    def _expert_checked(self, record, intact: bool, wrong_crc32c: int | None) -> None:
        if intact:
            self.pack.damage.clear(record.layer, record.expert)
        elif wrong_crc32c is not None:
            self.pack.damage.mark(DamagedRecord(record.layer, record.expert, record.offset, record.length, "verify",
                                                wrong_crc32c))

    @staticmethod
    def _summary(run: VerifyRun, report: VerifyReport | None) -> dict[str, Any]:
        summary = {"started_by": run.origin, "mode": "background" if run.background else "foreground",
                   "finished_unix_s": round(time.time(), 1)}
        if report is not None:
            full = report.to_json()
            summary.update({key: full[key] for key in ("clean", "cancelled", "bytes_read", "seconds", "notes")},
                           damage=full["damage"][:MAX_KEPT_DAMAGE], damage_found=len(report.damage))
        return summary

    def _log_report(self, run: VerifyRun, report: VerifyReport) -> None:
        if report.cancelled:
            log.info("verify of %s stopped after %.1f s (%d bytes read)", self.pack.path, report.seconds,
                     report.bytes_read)
        elif report.clean:
            log.info("verify of %s: intact (%d bytes in %.1f s)", self.pack.path, report.bytes_read, report.seconds)
        else:
            for damage in report.damage:
                log.error("verify of %s: %s", self.pack.path, damage.message)

    @staticmethod
    def _describe_running(run: VerifyRun) -> str:
        done = ""
        if run.progress is not None and run.progress.bytes_total:
            done = f", {100 * run.progress.bytes_done / run.progress.bytes_total:.0f}% done"
        mode = "background" if run.background else "foreground"
        return f"a verify is already running ({mode}, started by {run.origin}{done}); `colibrictl status` shows it"

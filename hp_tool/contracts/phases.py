"""Where a trial's time went: each rank appends a line per phase it finishes to ``phases.rank<N>.jsonl`` in
the trial's output folder, flushed at once, so a trial that is killed, times out or fails still says how far
it got and how long each part took.

A line: ``{"phase": <finished>, "next": <now under way>, "time": <unix s>, "elapsed_s": <since the process
started>}`` (step lines add ``"step"``). The phases, in order (``PHASES``; a phase a trial does not need is
left out, e.g. quantisation without QLoRA): the process start, imports, distributed init, model build
(on the meta device, parallelized), weights (initialised or loaded), quantisation, optimizer, first
forward, first backward, first optimizer step, then one line per step.

Written by the trial (``start`` once per process, then ``mark``: a no-op when no log was started, so engine
code can mark phases in a test harness too); read without torch by the launcher and the collector
(``summary``: "timeout in first forward after 96 s; imports 8 s, model build 41 s, ..."). Pure but for the
file I/O.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FILE_GLOB = "phases.rank*.jsonl"

# phase -> how a sentence names it; the order is the order a trial goes through them
PHASES = {
    "start": "process start-up",
    "imports": "imports",
    "distributed_init": "distributed init",
    "model_build": "model build",
    "weights": "weight initialisation / loading",
    "quantise": "quantisation",
    "optimizer": "optimizer build",
    "first_forward": "first forward",
    "first_backward": "first backward",
    "first_step": "first optimizer step",
    "step": "training steps",
}
BUILD = ("start", "imports", "distributed_init", "model_build", "weights", "quantise", "optimizer")


def file_name(rank: int) -> str:
    return f"phases.rank{rank}.jsonl"


def process_start_unix() -> float:
    """When this process started (Linux: /proc/self/stat's start time after boot), else now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of the whole line: starttime in clock ticks after boot
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class PhaseLog:
    """One rank's phase lines, appended and flushed as they happen (and kept, for ``where``)."""

    def __init__(self, folder: Path, rank: int, started_unix: float):
        self.rank, self.started, self.rows = rank, started_unix, []
        self.file = open(Path(folder) / file_name(rank), "w", encoding="utf-8")  # noqa: SIM115 - kept open

    def mark(self, phase: str, next_phase: Optional[str], at: Optional[float] = None, **extra) -> None:
        if phase not in PHASES or (next_phase is not None and next_phase not in PHASES):
            raise ValueError(f"unknown phase {phase!r} or {next_phase!r}; phases are {list(PHASES)}")
        now = time.time() if at is None else at
        row = {"phase": phase, "next": next_phase, "time": now, "elapsed_s": round(now - self.started, 3), **extra}
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


_current: Optional[PhaseLog] = None


def start(folder: Path, rank: int, started_unix: Optional[float] = None) -> PhaseLog:
    """Open this process's phase log in ``folder`` (a line for the process start, then one for the imports,
    which are done by now) and make it the one ``mark`` writes to."""
    global _current
    stop()
    _current = PhaseLog(folder, rank, process_start_unix() if started_unix is None else started_unix)
    _current.mark("start", "imports", at=_current.started)
    _current.mark("imports", "distributed_init")
    return _current


def mark(phase: str, next_phase: Optional[str], **extra) -> None:
    """Record that ``phase`` finished and ``next_phase`` began, in this process's log (if one is open)."""
    if _current is not None:
        _current.mark(phase, next_phase, **extra)


def where() -> Optional[str]:
    """Where this process is now, for a failure's reason ("in first forward after 12 s; imports 8 s, ..."),
    or None without a log."""
    if _current is None:
        return None
    return describe(RankPhases(_current.rank, list(_current.rows)), time.time())


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


# ---- reading (the launcher and collector; no torch) ----

@dataclass(frozen=True)
class RankPhases:
    """One rank's lines as read back."""

    rank: int
    rows: list

    @property
    def steps(self) -> int:
        """Optimizer steps finished."""
        return max((int(r.get("step", 0)) for r in self.rows), default=0)

    @property
    def current(self) -> Optional[str]:
        """The phase under way when the last line was written (the last line's ``next``)."""
        return self.rows[-1].get("next") if self.rows else None

    @property
    def progress(self) -> tuple[int, int]:
        """How far the rank got, for finding the one furthest behind: (phase index, steps)."""
        order = list(PHASES)
        last = self.rows[-1].get("phase") if self.rows else "start"
        return (order.index(last) if last in order else 0, self.steps)

    def durations(self) -> dict[str, float]:
        """Seconds each finished phase took (the process start: from the process start to the log's first
        line is 0), steps excluded."""
        out, previous = {}, None
        for row in self.rows:
            phase, when = row.get("phase"), float(row.get("time", 0.0))
            if previous is not None and phase != "step" and phase in PHASES:
                out[phase] = when - previous
            previous = when
        out.pop("start", None)
        return out


def read(folder: Path) -> list[RankPhases]:
    """Every rank's phase lines in ``folder`` (a cut-off last line, from a hard kill, is dropped)."""
    ranks = []
    for path in sorted(Path(folder).glob(FILE_GLOB)):
        rows = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        try:
            rank = int(path.name[len("phases.rank"):-len(".jsonl")])
        except ValueError:
            continue
        ranks.append(RankPhases(rank, rows))
    return ranks


def describe(ranked: "RankPhases", ended_unix: Optional[float] = None, limit_min: Optional[float] = None) -> str:
    """"in first forward after 96 s; imports 8 s, distributed init 1 s, model build 41 s" for one rank's
    lines; ``ended_unix`` (default: its last line's time) is when it stopped. With ``limit_min`` (a time limit
    it reached) a rank still building says the build alone took longer."""
    rows = ranked.rows
    started = float(rows[0].get("time", 0.0))
    ended = ended_unix if ended_unix is not None else float(rows[-1].get("time", started))
    current = ranked.current
    name = f"step {ranked.steps + 1}" if current == "step" else PHASES.get(current or "", "the end")
    text = f"in {name} after {max(0.0, ended - started):.0f} s"
    spent = ", ".join(f"{PHASES[p]} {s:.0f} s" for p, s in ranked.durations().items())
    if spent:
        text += f"; {spent}"
    if limit_min is not None and current in BUILD:
        text += (f"; the build alone took longer than the {limit_min:g}-minute limit: raise "
                 "search_config.train_settings.max_minutes_per_run")
    return text


def summary(folder: Path, status: str, limit_min: Optional[float] = None,
            now_unix: Optional[float] = None) -> Optional[str]:
    """How far the trial in ``folder`` got, for a reason: "timeout in first forward after 96 s (rank 1, the
    furthest behind); imports 8 s, ...", from the rank that got least far. ``now_unix``: when it ended (default:
    that rank's last line); ``limit_min``: the time limit it reached, if it timed out. None when no rank wrote
    a line."""
    ranks = [r for r in read(folder) if r.rows]
    if not ranks:
        return None
    behind = min(ranks, key=lambda r: (r.progress, r.rank))
    text = describe(behind, now_unix, limit_min)
    who = f" (rank {behind.rank}, the furthest behind)" if len(ranks) > 1 else ""
    head, _, tail = text.partition(";")
    return f"{status} {head}{who}" + (f";{tail}" if tail else "")

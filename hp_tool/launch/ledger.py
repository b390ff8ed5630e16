"""jobs.jsonl: the search's memory of what it submitted. Append-only; the last line per trial wins.

A line is written *before* a submission (state ``submitting``) and again with the job id after it, so an
orchestrator killed in between leaves a trace; the next run looks the job up by name before
resubmitting. Re-running the same command reads this file to resume.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from hp_tool.fsutil import atomic_write_text
from hp_tool.vocab import LEDGER_FILE, SEARCH_ID_FILE



def search_id(results_dir: Path) -> str:
    """This results folder's id (made once, kept in <results_dir>/search_id): job names carry it."""
    path = Path(results_dir) / SEARCH_ID_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, uuid.uuid4().hex[:8] + "\n")
    return path.read_text().strip()


@dataclass
class Entry:
    trial_id: str
    state: str  # submitting | submitted | a result status (ok, failed, timeout, cancelled, oom, ...)
    job_id: Optional[str] = None
    fingerprint: Optional[str] = None  # of the job's config (JobSpec.fingerprint) when it was submitted
    kind: Optional[str] = None  # local | slurm
    folder: Optional[str] = None  # submitit's folder for this job (logs, pickles)
    tasks: int = 1
    reason: Optional[str] = None
    time: float = 0.0
    inputs: Optional[dict] = None  # a gate's decision (skipped, ...): the settings it was made under (Gate.inputs)


class Ledger:
    def __init__(self, results_dir: Path):
        self.path = Path(results_dir) / LEDGER_FILE

    def append(self, entry: Entry) -> None:
        entry.time = entry.time or time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:  # one short line per write: appends are atomic in practice
            fh.write(json.dumps(asdict(entry)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def entries(self) -> list[Entry]:
        """Every line in order; a torn last line (killed mid-write) is skipped."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(Entry(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
        return out

    def latest(self) -> dict[str, Entry]:
        """Last entry of each trial, keeping the job id known for it."""
        out: dict[str, Entry] = {}
        for entry in self.entries():
            if entry.job_id is None and entry.trial_id in out and out[entry.trial_id].job_id:
                entry.job_id = out[entry.trial_id].job_id
            out[entry.trial_id] = entry
        return out

    def submissions(self) -> list[Entry]:
        """Every successful submission (to count them)."""
        return [e for e in self.entries() if e.state == "submitted"]

"""One orchestrator per results folder: an exclusive lock on ``<results_dir>/.hp_tool.lock``.

``flock`` is released by the kernel when its holder dies, so the lock of a killed orchestrator is taken
over at once; the file's text (host, pid, start time, command) only names the holder in messages. A
second orchestrator exits (ConfigError -> exit code 2) naming the holder, or with ``wait_for_lock=true``
waits for it. Shared file systems must support flock (NFSv4 and Lustre with ``flock`` do).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from hp_tool.errors import ConfigError
from hp_tool.vocab import LOCK_FILE

log = logging.getLogger(__name__)



class ResultsLock:
    def __init__(self, results_dir: Path):
        self.path = Path(results_dir) / LOCK_FILE
        self.fd: Optional[int] = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "another hp_tool process"
        except OSError:
            return "another hp_tool process"

    def acquire(self, wait: bool) -> "ResultsLock":
        """Take the lock; if held: wait (``wait``) or raise ConfigError naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.holder()
            if not wait:
                os.close(fd)
                raise ConfigError("wait_for_lock", False, f"{self.path.parent} is in use by {holder}",
                                  "let that search finish (or stop it), or add wait_for_lock=true to wait "
                                  "for it; re-running the same command resumes") from None
            log.warning("%s is in use by %s; waiting for it (wait_for_lock=true)", self.path.parent, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, (f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n").encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "ResultsLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

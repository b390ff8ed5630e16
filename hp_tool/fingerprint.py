"""A short, stable hash of what a job measures; result files, the ledger and the plan carry it, so a result
counts only for the exact configuration it measured (a changed setting re-runs the job)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint_of(data: Any) -> str:
    """16 hex characters of the SHA-256 of ``data`` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

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


STALE = "stale"  # the status of a result whose fingerprint is not the plan's: shown, never ranked


def stale_reason(found: object, expected: str) -> str:
    """Why a result on disk is not a measurement of the planned configuration."""
    return (f"result.json measured another configuration (fingerprint {found}, plan {expected}); re-run the "
            "same command to measure this one")

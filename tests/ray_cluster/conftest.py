"""Tests that run searches on a real Ray cluster: the one-machine head of tests/ray_cluster/head.sh (4 CPUs, no GPU).

Every test here gets the ``ray`` and ``e2e`` markers. Without a head answering at HP_TOOL_RAY_ADDRESS (default
http://127.0.0.1:8265) they are skipped with a hint to start one; with ``HP_TOOL_REQUIRE_RAY=1`` they fail instead
(CI sets it, so a broken head cannot pass silently).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import pytest

ADDRESS = os.environ.get("HP_TOOL_RAY_ADDRESS", "http://127.0.0.1:8265")
START_HINT = "run `bash tests/ray_cluster/head.sh start` to start the one-machine Ray cluster"


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> Optional[str]:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        return f'Ray is not installed (pip install -e ".[ray]"); {START_HINT}'
    try:
        JobSubmissionClient(ADDRESS).list_jobs()
    except Exception as exc:  # noqa: BLE001 - any connection failure: no head
        return f"no Ray job API at {ADDRESS} ({type(exc).__name__}); {START_HINT}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/ray_cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def ray_address() -> str:
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("HP_TOOL_REQUIRE_RAY", "").strip().lower() in {"1", "true", "yes", "on"}:
            pytest.fail(reason)
        pytest.skip(reason)
    return ADDRESS


@pytest.fixture(scope="session")
def ray_client(ray_address):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(ray_address)

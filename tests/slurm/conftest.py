"""Fixtures for tests that submit real jobs to a SLURM cluster.

Every test under tests/slurm/ gets the ``slurm`` marker. When no cluster is reachable the tests are
skipped with a hint to run ``bash tests/slurm/testbed.sh start``; with ``HP_TOOL_REQUIRE_SLURM=1`` they
fail instead (CI sets it, so a broken testbed cannot pass silently).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional

import pytest

HERE = Path(__file__).resolve().parent
TESTBED = HERE / "testbed.sh"
START_HINT = "run `bash tests/slurm/testbed.sh start` (as root) to start the one-node test cluster"
REQUIRE_ENV = "HP_TOOL_REQUIRE_SLURM"

# sacct states after which a job will not change any more
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


def _require_slurm() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@functools.lru_cache(maxsize=1)
def cluster_unavailable_reason() -> Optional[str]:
    """None when the cluster accepts jobs, otherwise why not."""
    if shutil.which("sinfo") is None:
        return f"SLURM is not installed (no `sinfo` on PATH); {START_HINT}"
    try:
        proc = _run(["sinfo", "-h"], timeout=20)
    except subprocess.TimeoutExpired:
        return f"`sinfo` timed out; {START_HINT}"
    if proc.returncode != 0:
        return f"`sinfo` failed ({(proc.stderr or proc.stdout).strip()[:200]}); {START_HINT}"
    try:
        proc = _run(["bash", str(TESTBED), "status"], timeout=60)
    except subprocess.TimeoutExpired:
        return f"`testbed.sh status` timed out; {START_HINT}"
    if proc.returncode != 0:
        detail = " | ".join(line.strip() for line in proc.stdout.splitlines() if line.strip())
        return f"SLURM test cluster is not accepting jobs ({detail[:300]}); {START_HINT}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs a reachable SLURM cluster (tests/slurm/testbed.sh start)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def _in_this_folder(item: pytest.Item) -> bool:
    try:
        Path(str(item.path)).resolve().relative_to(HERE)
    except ValueError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_this_folder(item):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(autouse=True)
def _slurm_required_or_skip(request: pytest.FixtureRequest) -> None:
    """Skip (or, with HP_TOOL_REQUIRE_SLURM=1, fail) when the cluster does not accept jobs."""
    reason = cluster_unavailable_reason()
    if reason is None:
        return
    if _require_slurm():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


# --------------------------------------------------------------------------------------------------
# cluster description


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    partition: str
    node: str
    gpus_per_node: int
    cpus_per_node: int
    real_memory_mb: int
    cluster_name: str


def _scontrol_fields(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """Default partition, its (first) node and what that node offers."""
    reason = cluster_unavailable_reason()
    if reason is not None:  # session fixtures run before the autouse check can skip
        if _require_slurm():
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    parts = _run(["sinfo", "-h", "-o", "%P"]).stdout.split()
    default = [p for p in parts if p.endswith("*")]
    partition = (default or parts)[0].rstrip("*")
    nodes = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"]).stdout.split()
    node = nodes[0]
    fields = _scontrol_fields(_run(["scontrol", "show", "node", node, "-o"]).stdout)
    gpus = 0
    for gres in fields.get("Gres", "").split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", gres)
        if m:
            gpus += int(m.group(1))
    conf = _run(["scontrol", "show", "config"]).stdout
    m = re.search(r"^ClusterName\s*=\s*(\S+)", conf, re.MULTILINE)
    return SlurmCluster(
        partition=partition,
        node=node,
        gpus_per_node=gpus,
        cpus_per_node=int(fields.get("CPUTot", "1")),
        real_memory_mb=int(fields.get("RealMemory", "0")),
        cluster_name=m.group(1) if m else "",
    )


# --------------------------------------------------------------------------------------------------
# accounting helpers


@dataclasses.dataclass(frozen=True)
class SacctJob:
    job_id: str
    name: str
    state: str  # first word of sacct's State: "CANCELLED by 0" -> "CANCELLED"
    elapsed: str
    exit_code: str


class Sacct:
    """Small reader of `sacct` (allocations only, no steps) for assertions about jobs."""

    FIELDS = "JobID,JobName%200,State,Elapsed,ExitCode"

    def _query(self, args: Iterable[str]) -> list[SacctJob]:
        cmd = ["sacct", "-n", "-X", "-P", "-S", "2000-01-01", "-o", self.FIELDS, *args]
        proc = _run(cmd)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
        jobs = []
        for line in proc.stdout.splitlines():
            cols = line.split("|")
            if len(cols) < 5:
                continue
            state = cols[2].split()[0] if cols[2].strip() else ""
            jobs.append(SacctJob(cols[0], cols[1], state, cols[3], cols[4]))
        return jobs

    def jobs_named(self, name: str, settle_s: float = 5.0) -> list[SacctJob]:
        """Jobs called `name`. slurmdbd can answer a name query a moment after a job-id query, so an
        empty answer is asked again for up to `settle_s` seconds."""
        deadline = time.monotonic() + settle_s
        while True:
            jobs = [j for j in self._query(["--name", name]) if j.name == name]
            if jobs or time.monotonic() >= deadline:
                return jobs
            time.sleep(0.5)

    def count(self, name: str, states: Optional[Iterable[str]] = None) -> int:
        """Number of jobs (array tasks count one each) called `name`, optionally only in `states`."""
        wanted = None if states is None else {s.upper() for s in states}
        return sum(1 for j in self.jobs_named(name) if wanted is None or j.state in wanted)

    def job(self, job_id: str) -> Optional[SacctJob]:
        found = [j for j in self._query(["-j", str(job_id)]) if j.job_id == str(job_id)]
        return found[0] if found else None

    def state(self, job_id: str) -> str:
        job = self.job(job_id)
        return job.state if job else ""

    def wait_for_state(
        self, job_id: str, states: Iterable[str], timeout_s: float, poll_s: float = 1.0
    ) -> str:
        """Poll until the job's state is one of `states` (or final); return it. Fails after timeout."""
        wanted = {s.upper() for s in states}
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in wanted or state in FINAL_STATES:
                return state
            time.sleep(poll_s)
        pytest.fail(f"job {job_id} still '{state or 'unknown'}' after {timeout_s:.0f}s (wanted {sorted(wanted)})")


@pytest.fixture(scope="session")
def sacct() -> Sacct:
    """`sacct.count(name)`, `sacct.state(job_id)`, `sacct.wait_for_state(job_id, states, timeout_s)`."""
    return Sacct()


@pytest.fixture
def count_jobs(sacct: Sacct) -> Callable[..., int]:
    """count_jobs(name, states=None): how many jobs called `name` sacct knows about."""
    return sacct.count


# --------------------------------------------------------------------------------------------------
# submission helpers


@pytest.fixture
def slurm_job_name(request: pytest.FixtureRequest) -> str:
    """A job name unique to this test run, so sacct counts are not confused by earlier runs."""
    test = re.sub(r"[^A-Za-z0-9_]+", "_", request.node.name)[:40]
    return f"hp_tool_test_{test}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def slurm_folder(tmp_path: Path) -> Path:
    """A submitit folder whose path has a space and a single quote, to catch shell-quoting bugs."""
    folder = tmp_path / "submitit logs 'quoted'"
    folder.mkdir()
    return folder


@pytest.fixture
def slurm_executor(slurm_cluster: SlurmCluster, slurm_folder: Path, slurm_job_name: str):
    """Factory: slurm_executor(**params) -> submitit.AutoExecutor on the test partition."""
    import submitit

    def make(**params):
        executor = submitit.AutoExecutor(folder=str(slurm_folder / "%j"), cluster="slurm")
        defaults = dict(
            slurm_partition=slurm_cluster.partition,
            name=slurm_job_name,
            timeout_min=5,
            cpus_per_task=1,
        )
        defaults.update(params)
        executor.update_parameters(**defaults)
        return executor

    return make


# --------------------------------------------------------------------------------------------------
# the timeout test's search, run beside other tests


TIMEOUT_TEST = "test_job_past_its_time_limit_is_a_timeout_row"


@pytest.fixture(scope="session")
def timed_out_search(tmp_path_factory, slurm_cluster):
    """test_search_on_slurm.py's timeout test's search (``start_timed_out_search``), started once a session: its job
    waits out SLURM's 1-minute limit (60-90 s), so it starts before the tests that run beside it
    (``beside_timed_out_search``) and the timeout test reads it at the end. Stopped (its job scancelled) at the
    end of the session."""
    from test_search_on_slurm import start_timed_out_search  # the search lives with its test (tests/slurm on sys.path)

    search = start_timed_out_search(tmp_path_factory.mktemp("timed_out"))
    yield search
    search.stop()


@pytest.fixture(scope="module")
def beside_timed_out_search(request: pytest.FixtureRequest) -> None:
    """For a module whose tests run beside the timeout test's search (their jobs share the node with its job):
    starts that search now, when the timeout test is selected in this session."""
    if any(item.name == TIMEOUT_TEST for item in request.session.items):
        request.getfixturevalue("timed_out_search")

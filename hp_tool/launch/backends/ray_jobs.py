"""An existing Ray cluster (``cluster=ray``: a local head, KubeRay, Anyscale) through Ray's job API: each trial is
one Ray job, submitted under the trial's search-unique name, whose driver (ray_driver.py) runs the trial's entry as
a Ray Train run of one worker per trial process. Ray jobs outlive the orchestrator: a second run of the search
finds each live job by its name and follows it instead of submitting it again (detachable).

What the backend assumes and checks: ``cluster.ray.address`` is the cluster's job API (its dashboard, ``http://head:8265``;
``auto``: ``RAY_ADDRESS`` or this machine's head); the results folder is the same folder on the cluster's nodes (a
shared file system, or one machine), which ``preflight`` checks by a probe job that writes into it, before any file
of the search is written. A trial whose workers need more than the cluster has in all (GPUs, CPUs, an accelerator
type) is ``unschedulable`` with the cluster's numbers; a job that fails is ``failed`` with Ray's message and the end
of its log, read through the job API.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from pathlib import Path
from typing import Optional, Sequence

from hp_tool.config import ClusterConfig, GpuConfig
from hp_tool.errors import ConfigError
from hp_tool.launch.backends import ray_driver
from hp_tool.launch.backends.base import Backend, Handle, Pending, Sized
from hp_tool.launch.job import JobSpec
from hp_tool.launch.ledger import Entry

KEY = "cluster.ray.address"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
LOCAL_DASHBOARD = "http://127.0.0.1:8265"
PROBE_TIMEOUT_S = 120.0
FIX = ("start one (ray start --head) or give its job API: cluster.ray.address=http://<head>:8265 (the dashboard's "
       "address; a ray:// client address is not the job API)")


def job_api_address(address: Optional[str]) -> str:
    """The job API's address for ``cluster.ray.address`` (``auto``/null: RAY_ADDRESS when it is an http one, else this
    machine's head)."""
    if address in (None, "", "auto"):
        env = os.environ.get("RAY_ADDRESS", "")
        return env if env.startswith("http") else LOCAL_DASHBOARD
    return address if "://" in address else f"http://{address}"


def status_name(status) -> str:
    """A job status as its name (the job API's JobStatus, a str enum)."""
    return str(getattr(status, "value", status))


def submission_id(name: str) -> str:
    """A job name as a Ray submission id (letters, digits, ``-_.``)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


class RayJob:
    """A Ray job as the launcher follows it: its submission id, and its state from the last ``refresh``."""

    def __init__(self, client, job_id: str, out: Path):
        self.client, self.job_id, self.out = client, job_id, out
        self.status, self.message = "PENDING", ""

    def refresh(self) -> None:
        info = self.client.get_job_info(self.job_id)
        self.status, self.message = status_name(info.status), info.message or ""

    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def state(self) -> str:
        """RUNNING once the trial's workers have started (their phase logs appear); the driver waiting for its
        workers' placement is PENDING, as a queued SLURM job is."""
        if self.status == "RUNNING" and not any(self.out.glob("phases.rank*.jsonl")):
            return "PENDING"
        return self.status

    def cancel(self) -> None:
        if not self.done():
            self.client.stop_job(self.job_id)


class RayBackend(Backend):
    """``cluster=ray``: trials as Ray jobs on an existing Ray cluster."""

    kind = "ray"
    detachable = True
    max_poll_s = 5.0
    min_poll_s = 1.0

    def __init__(self, cluster: ClusterConfig, gpu: GpuConfig):
        super().__init__(cluster)
        self.gpu = gpu
        self.address = job_api_address(cluster.ray.address)
        self._client = None

    @property
    def client(self):
        if self._client is None:
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError as exc:
                raise ConfigError("cluster", "ray", f"needs Ray's job API ({exc})",
                                  'install the ray extra: pip install -e ".[ray]"') from exc
            try:
                self._client = JobSubmissionClient(self.address)
            except Exception as exc:  # noqa: BLE001 - connection errors of every kind: the cluster does not answer
                raise ConfigError(KEY, self.cluster.ray.address, f"no Ray job API answers at {self.address} "
                                  f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})", FIX) from exc
        return self._client

    # ---- what a trial's workers ask ----
    def worker_need(self) -> dict[str, float]:
        """One worker's resources: its CPUs (cluster.cpus_per_task, default 1), one GPU unless gpu=cpu (or
        cluster.ray.gpus_per_worker), the accelerator label (cluster.ray.accelerator_type)."""
        gpus = self.cluster.ray.gpus_per_worker if self.cluster.ray.gpus_per_worker is not None else \
            (0 if self.gpu.name == "cpu" else 1)
        return ray_driver.worker_resources(self.cluster.cpus_per_task or 1, gpus, self.cluster.ray.accelerator_type)

    def driver_args(self, job: JobSpec, name: str) -> list[str]:
        """The Ray job's entrypoint: the driver running the job's entry in one worker per task."""
        return ray_driver.driver_command(ray_driver.entry_name(job.entry), job.tasks, self.worker_need(),
                                         str(Path(job.config_path).resolve()), self.cluster.ray.accelerator_type,
                                         submission_id(name), str(job.folder.resolve()))

    def runtime_env(self) -> dict:
        """cluster.ray.runtime_env, with this checkout on the jobs' Python path unless it sets a working_dir (or an
        image) of its own."""
        env = dict(self.cluster.ray.runtime_env or {})
        if not {"working_dir", "image_uri", "container"} & env.keys():
            repo = str(Path(__file__).resolve().parents[3])
            env_vars = dict(env.get("env_vars") or {})
            env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env_vars.get("PYTHONPATH")) if p)
            env["env_vars"] = env_vars
        return env

    # ---- the protocol ----
    def preflight(self, jobs: Sequence[Sized]) -> None:
        """The cluster answers its job API, and a probe job on it sees the results folder this machine writes
        (the jobs' results come back through it). Resource shortfalls are per trial (unschedulable)."""
        folder = shared_folder(jobs)
        probe_file = folder / ray_driver.PROBE_FILE
        probe_file.unlink(missing_ok=True)
        job_id = self._submit(["python3", "-m", "hp_tool.launch.backends.ray_driver", "--probe", str(folder)], None)
        deadline = time.time() + PROBE_TIMEOUT_S
        status = ""
        while time.time() < deadline:
            status = status_name(self.client.get_job_status(job_id))
            if status in TERMINAL:
                break
            time.sleep(0.5)
        logs = self.client.get_job_logs(job_id)
        if status != "SUCCEEDED":
            raise ConfigError(KEY, self.cluster.ray.address, f"the probe job on the Ray cluster at {self.address} did "
                              f"not succeed ({status or 'no answer'} within {PROBE_TIMEOUT_S:.0f} s); its log: "
                              f"{tail(logs)}", "check that the cluster's nodes can import hp_tool "
                              "(cluster.ray.runtime_env: a working_dir, pip or image) and that it runs a job's driver")
        seen = probe_file.exists()
        probe_file.unlink(missing_ok=True)
        if not seen:
            raise ConfigError(KEY, self.cluster.ray.address, f"the Ray cluster's nodes do not see {folder} (a probe job "
                              "wrote there and this machine does not find the file): trials' results would not "
                              "come back", "run the search from a folder on a file system the cluster's nodes share "
                              "(or on the head node itself)")

    def _submit(self, args: list[str], name: Optional[str]) -> str:
        return self.client.submit_job(entrypoint=" ".join(shlex.quote(a) for a in args),
                                      submission_id=None if name is None else submission_id(name),
                                      runtime_env=self.runtime_env(), entrypoint_num_cpus=0)

    def submit(self, job: JobSpec, name: str) -> Handle:
        job.folder.mkdir(parents=True, exist_ok=True)
        job_id = self._submit(self.driver_args(job, name), name)
        return RayJob(self.client, job_id, job.out)

    def find(self, name: str) -> Optional[str]:
        try:
            self.client.get_job_info(submission_id(name))
        except Exception:  # noqa: BLE001 - the job API raises a RuntimeError for an unknown id
            return None
        return submission_id(name)

    def reattach(self, job: JobSpec, entry: Entry, job_id: str) -> Optional[Handle]:
        handle = RayJob(self.client, job_id, job.out)
        try:
            handle.refresh()
        except Exception:  # noqa: BLE001 - no such job on this cluster (restarted, or another cluster)
            return None
        return None if handle.done() else handle  # a job that ended without its result runs again

    def refresh(self, handles: Sequence[Handle]) -> None:
        for handle in handles:
            handle.refresh()

    def pending(self, handles: Sequence[Handle]) -> dict[str, Pending]:
        """Jobs whose driver waits for its workers' placement (cluster.max_queue_minutes applies to them; a
        placement that can never happen is the driver's to say, before it asks)."""
        return {h.job_id: Pending("waiting for the Ray cluster to place its workers") for h in handles
                if h.state == "PENDING"}

    def log_tail(self, handle: Handle, job: JobSpec) -> str:
        try:
            return tail(self.client.get_job_logs(handle.job_id))
        except Exception:  # noqa: BLE001 - the logs are gone with the job
            return ""

    def end_state(self, handle: Handle, job: JobSpec, ran_s: float, log_tail: str) -> tuple[str, str]:
        if ray_driver.UNSCHEDULABLE_MARK in log_tail:  # the driver's last line: the workers can never be placed
            return "unschedulable", log_tail.split(ray_driver.UNSCHEDULABLE_MARK, 1)[1].split(" | ", 1)[0].strip()
        if ran_s >= job.timeout_min * 60 - 1:
            return "timeout", f"Ray job reached its {job.timeout_min}-minute limit without a result"
        if handle.status == "STOPPED":
            return "cancelled", f"Ray job {handle.job_id} was stopped ({handle.message})"
        # Ray's message repeats the job's log after its first sentence: the tail below says it once
        message = handle.message.split(", last available logs", 1)[0].split("\n", 1)[0]
        return "failed", f"Ray job {handle.job_id} {handle.status.lower()}: {message}; log tail: {log_tail}"


def shared_folder(jobs: Sequence[Sized]) -> Path:
    """The folder the preflight probes: the nearest existing folder above the first job's results (none of the
    search's own folders exist yet), else the working directory."""
    given = getattr(jobs[0], "output_dir", None) if jobs else None
    folder = Path(given or os.getcwd()).resolve()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    return folder


def tail(logs: str, lines: int = 6, chars: int = 600) -> str:
    """The end of a job's log as one line, without the terminal colours Ray's worker prefixes carry."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", logs).strip()
    return " | ".join(plain[-chars:].splitlines()[-lines:])

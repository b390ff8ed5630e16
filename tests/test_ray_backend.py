"""The Ray backend's rules that need no cluster: what a trial's workers ask, when a cluster can never place them,
the driver's command line (the backend's jobs and the optimal config's Ray line), names and addresses. A search on
a real Ray head: tests/ray_cluster/."""

import pytest

from hp_tool.cli import compose
from hp_tool.config import RaySettings, to_app_config
from hp_tool.errors import ConfigError
from hp_tool.launch.backends import backend_for
from hp_tool.launch.backends.ray_driver import driver_command, entry_of, never_placed, worker_resources
from hp_tool.launch.backends.ray_jobs import RayBackend, job_api_address, submission_id, tail
from hp_tool.launch.job import trial_job


def test_a_worker_asks_its_cpus_a_gpu_and_the_accelerator_label():
    assert worker_resources(2, 1, "A100") == {"CPU": 2, "GPU": 1, "accelerator_type:A100": 0.001}
    assert worker_resources(1, 0, None) == {"CPU": 1}  # a CPU worker asks no GPU


def test_a_cluster_too_small_in_all_is_named_with_its_numbers():
    cluster = {"CPU": 4.0, "GPU": 2.0, "accelerator_type:A100": 1.0}
    assert never_placed(2, {"CPU": 1, "GPU": 1}, cluster) is None
    assert never_placed(4, {"CPU": 1, "GPU": 1}, cluster) == \
        "the trial's 4 worker(s) need 4 GPU and the Ray cluster has 2 in all"
    assert never_placed(5, {"CPU": 1}, cluster) == "the trial's 5 worker(s) need 5 CPU and the Ray cluster has 4 in all"
    assert "need H100 GPUs" in never_placed(1, worker_resources(1, 1, "H100"), cluster)
    assert never_placed(2, worker_resources(1, 1, "A100"), cluster) is None  # the label is on a node, not counted


def test_the_driver_command_runs_the_entry_it_names():
    args = driver_command("hp_tool.launch.job:trial_job", 8, worker_resources(4, 1, "H100"), "/r/t.yaml", "H100",
                          "hpt-x-t1", "/r/job")
    assert args[:3] == ["python3", "-m", "hp_tool.launch.backends.ray_driver"]
    assert args[args.index("--workers") + 1] == "8" and args[args.index("--gpus-per-worker") + 1] == "1"
    assert args[args.index("--cpus-per-worker") + 1] == "4" and args[-1] == "/r/t.yaml"
    assert entry_of(args[args.index("--entry") + 1]) is trial_job


def test_names_and_addresses():
    assert submission_id("hp_tool:ab12:gpt3_tp1 pp2") == "hp_tool-ab12-gpt3_tp1-pp2"
    assert job_api_address("10.0.0.1:8265") == "http://10.0.0.1:8265"
    assert job_api_address("http://head:8265") == "http://head:8265"


def test_cluster_ray_picks_the_ray_backend_and_refuses_negative_gpus():
    app = to_app_config(compose(["search_config=gpt3/tiny", "cluster=ray", "cluster.ray.address=head:8265"])[0])
    backend = backend_for(app.cluster, app.gpu)
    assert (backend.kind, backend.detachable, backend.address) == ("ray", True, "http://head:8265")
    assert backend.worker_need() == {"CPU": 1}  # gpt3/tiny trains on CPU processes: no GPU asked
    h100 = to_app_config(compose(["search_config=gpt3/tiny", "cluster=ray", "gpu=h100_80gb",
                                  "cluster.ray.accelerator_type=H100", "cluster.cpus_per_task=8"])[0])
    assert backend_for(h100.cluster, h100.gpu).worker_need() == {"CPU": 8, "GPU": 1, "accelerator_type:H100": 0.001}
    with pytest.raises(ConfigError, match="cluster.ray.gpus_per_worker"):
        RaySettings(gpus_per_worker=-1)


class Ended:
    """A finished Ray job as the backend sees it (status and message, as the job API gave them)."""

    def __init__(self, status, message):
        self.job_id, self.status, self.message = "hpt-x-t1", status, message


def test_a_failed_job_reads_as_rays_first_sentence_and_the_plain_tail_of_its_log(tmp_path):
    from hp_tool.launch.job import JobSpec

    app = to_app_config(compose(["search_config=gpt3/tiny", "cluster=ray"])[0])
    backend = RayBackend(app.cluster, app.gpu)
    job = JobSpec("t1", "c.yaml", str(tmp_path), 1, 2, 3.0, "fp", trial_job)
    log = "\x1b[36m(RayTrainWorker pid=1)\x1b[0m step 3\n\x1b[36m(RayTrainWorker pid=1)\x1b[0m worker died"
    message = "Job entrypoint command failed with exit code 1, last available logs (truncated):\n" + log
    status, reason = backend.end_state(Ended("FAILED", message), job, 30.0, tail(log))
    assert status == "failed"
    assert reason == ("Ray job hpt-x-t1 failed: Job entrypoint command failed with exit code 1; log tail: "
                      "(RayTrainWorker pid=1) step 3 | (RayTrainWorker pid=1) worker died")
    assert backend.end_state(Ended("STOPPED", "stopped"), job, 30.0, "")[0] == "cancelled"
    assert backend.end_state(Ended("FAILED", "x"), job, 180.0, "")[0] == "timeout"
    never = "the trial's 2 worker(s) need 2 GPU and the Ray cluster has 0 in all"
    log = tail(f"connected\nhp_tool-unschedulable: {never}")
    assert backend.end_state(Ended("FAILED", "exit code 3"), job, 5.0, log) == ("unschedulable", never)

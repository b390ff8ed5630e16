"""Where a job's ranks meet: the rendezvous port every rank of a job derives alike from its job id (the
launcher's submitit entry and a trial started by plain srun)."""

from __future__ import annotations

import re
import zlib

# A job's rendezvous port: below Linux's ephemeral range (32768-60999 by default), where the kernel hands out
# the local ports of outgoing connections and gloo's listening sockets, so a busy node never holds it already;
# consecutive job ids get different ports, so jobs that share a node do not meet on one.
RENDEZVOUS_PORTS = range(20000, 32768)


def rendezvous_port(job_id: str) -> int:
    """MASTER_PORT for a job, the same on every rank: from the job id's number (an array task's index
    added), else a checksum of the id."""
    numbers = [int(n) for n in re.findall(r"\d+", job_id)]
    key = sum(numbers) if numbers else zlib.crc32(job_id.encode())
    return RENDEZVOUS_PORTS.start + key % len(RENDEZVOUS_PORTS)

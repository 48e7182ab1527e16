"""stale_layers="auto" decides on real networks (tests/jobs/auto_network_job.py): with ample
bandwidth (plain loopback) the scheduler keeps the job synchronous (k = 0); on a slow link —
all ranks inside a fresh network namespace whose loopback is rate-limited with ``tc``
(docs/design.md §6) — it stales layers. Skipped, with the reason, where namespaces or ``tc``
are unavailable. The exactness of the switch is tests/distributed/test_auto.py's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from support.paths import JOBS, job_env

pytestmark = pytest.mark.slow  # each job decides k on a compute-heavy model


def _run_job(prefix):
    cmd = prefix + [sys.executable, str(JOBS / "auto_network_job.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_stays_synchronous_with_ample_bandwidth():
    result = _run_job([])
    assert result["k"] == 0, result["summary"]


def _slow_network_prefix():
    if not (shutil.which("unshare") and shutil.which("tc") and shutil.which("ip")):
        pytest.skip("needs unshare, ip and tc (iproute2) to emulate a slow network")
    # MTU 1500: tbf drops any packet larger than its burst, and loopback segments are 64 KB.
    shape = (
        "ip link set lo mtu 1500 up && "
        "tc qdisc add dev lo root tbf rate 40mbit burst 64kbit latency 400ms && "
        'exec "$@"'
    )
    for flags in (["-n"], ["-rn"]):  # as root, else as an unprivileged user namespace
        probe = subprocess.run(
            ["unshare", *flags, "bash", "-c", shape, "_", "true"], capture_output=True
        )
        if probe.returncode == 0:
            return ["unshare", *flags, "bash", "-c", shape, "_"]
    pytest.skip(
        "network namespaces with tc are not permitted here: " + probe.stderr.decode()[-200:]
    )


def test_auto_stales_layers_on_a_slow_link():
    result = _run_job(_slow_network_prefix())
    assert result["k"] > 0, result["summary"]

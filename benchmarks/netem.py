"""Emulate a slower network on one host: a fresh network namespace with a rate-limited loopback.

DESIGN.md §6. Every rank of a job runs inside one new network namespace (``unshare -n`` as
root, ``unshare -rn`` otherwise: a user namespace maps us to root so that ``tc`` may
configure the namespace's own loopback). Inside, ``lo`` is brought up and shaped by a
token-bucket filter::

    ip link set lo up
    tc qdisc add dev lo root tbf rate R burst B limit L

All ranks' traffic crosses the one shaped ``lo`` queue, so R is the *aggregate* rate of all
ranks together: a ring all-reduce of S bytes over n ranks puts 2(n-1)·S bytes on it.

The queue limit L is large (default 32 MiB) on purpose: a drop on loopback costs a TCP
retransmission timeout (>= 200 ms), which would turn a bandwidth limit into random stalls.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "parse_rate", "format_rate", "check", "wrap", "set_rate", "UNLIMITED", "unshare_flags",
]

UNLIMITED = "unlimited"
_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "k": 1e3, "m": 1e6, "g": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
QUEUE_LIMIT_BYTES = 32 * 1024 * 1024


def parse_rate(text: str) -> Optional[float]:
    """'500mbit', '1.5gbit', '2e8' -> bits per second; 'unlimited' / 'none' / '0' -> None."""
    t = str(text).strip().lower()
    if t in (UNLIMITED, "none", "inf", "0", ""):
        return None
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)", t)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot parse rate {text!r}; use e.g. 500mbit, 1.5gbit or unlimited")
    return float(m.group(1)) * _UNITS[m.group(2)]


def format_rate(bits: Optional[float]) -> str:
    if bits is None:
        return UNLIMITED
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.0f} bit/s"


def _tbf_args(bits: float) -> List[str]:
    rate_kbit = max(8, int(round(bits / 1e3)))
    # The bucket must hold at least one 64 KiB loopback (GSO) packet and a few timer ticks
    # of traffic, or tbf throttles below the configured rate.
    burst = max(256 * 1024, int(bits / 8 * 0.005))
    return ["rate", f"{rate_kbit}kbit", "burst", str(burst), "limit", str(QUEUE_LIMIT_BYTES)]


def unshare_flags() -> List[str]:
    """``-n`` as root; ``-rn`` (map to root in a new user namespace) otherwise."""
    return ["-n"] if os.geteuid() == 0 else ["-rn"]


def check() -> Tuple[bool, str]:
    """Whether namespaces and tc work here; (ok, explanation)."""
    missing = [b for b in ("unshare", "ip", "tc") if shutil.which(b) is None]
    if missing:
        return False, (f"missing {', '.join(missing)}: install iproute2 and util-linux "
                       "(`make bench` does it: apt-get install iproute2)")
    script = "ip link set lo up && tc qdisc add dev lo root " + " ".join(["tbf"] + _tbf_args(1e9))
    cmd = ["unshare", *unshare_flags(), "sh", "-c", script]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`{' '.join(cmd)}` failed: {exc}"
    if out.returncode != 0:
        return False, (f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()} — "
                       "run as root, or enable unprivileged user namespaces "
                       "(sysctl kernel.unprivileged_userns_clone=1)")
    return True, f"network namespaces via `unshare {' '.join(unshare_flags())}` and tc tbf on lo"


def wrap(argv: Sequence[str], bits: Optional[float]) -> List[str]:
    """``argv`` to run in a fresh namespace whose loopback is limited to ``bits``/s (None: not limited)."""
    steps = ["ip link set lo up"]
    if bits is not None:
        steps.append("tc qdisc add dev lo root " + " ".join(["tbf"] + _tbf_args(bits)))
    script = " && ".join(steps) + ' && exec "$@"'
    return ["unshare", *unshare_flags(), "sh", "-c", script, "netem", *argv]


def set_rate(bits: Optional[float], dev: str = "lo") -> None:
    """Change the rate of the namespace we are in (used by the calibration probe)."""
    if bits is None:
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return
    subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", *_tbf_args(bits)],
                   check=True, capture_output=True)


if __name__ == "__main__":
    print(check())

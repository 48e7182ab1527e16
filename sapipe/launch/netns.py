"""Emulated network on one host: a fresh network namespace whose loopback is rate-limited
(and optionally delayed) by ``tc`` (docs/design.md §6).

Used by ``sapipe-launch --emulate-net`` and by the benchmarks (``benchmarks/``), which
import it from the installed package: ``from sapipe.launch import netns``.

The whole ``torchrun`` job (agent and every rank) runs inside one new network namespace:
``unshare -n`` as root, ``unshare -rn`` otherwise (a user namespace maps us to root there,
so that ``tc`` may configure the namespace's own loopback). Inside::

    ip link set lo up
    tc qdisc add dev lo root tbf rate R burst B limit L                    # RATE only
    tc qdisc add dev lo root handle 1: netem delay D limit P               # RATE,LATENCY
    tc qdisc add dev lo parent 1:1 handle 10: tbf rate R burst B limit L

* R is the **aggregate** rate of all ranks together: every byte any rank sends crosses the
  one shaped ``lo`` queue (a ring all-reduce of S bytes over n ranks puts 2(n-1)·S on it).
* B, the bucket, is at least 256 KiB: loopback packets are up to 64 KiB (GSO), and tbf
  silently drops a packet larger than its bucket, which stalls TCP.
* L, the queue limit, is 32 MiB: a drop on loopback costs a TCP retransmission timeout
  (>= 200 ms), which would turn a bandwidth limit into random stalls.
* D, the latency, is a one-way delay added to *every* packet by ``netem`` (the root
  qdisc, tbf its child, as in tc-netem(8)); on loopback each packet crosses ``lo`` once,
  so the round-trip time grows by 2·D. (tbf's own ``latency`` parameter is not a delay:
  it only bounds the queue, so it is not used.) ``netem`` needs the kernel's
  ``sch_netem``; where it is missing, a LATENCY fails with a clear message.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MIN_BURST_BYTES",
    "QUEUE_LIMIT_BYTES",
    "NetSpec",
    "check",
    "format_rate",
    "parse_latency",
    "parse_rate",
    "parse_spec",
    "tc_commands",
    "unshare_flags",
    "wrap",
]

QUEUE_LIMIT_BYTES = 32 * 1024 * 1024
MIN_BURST_BYTES = 256 * 1024
NETEM_LIMIT_PACKETS = 100_000  # netem's default (1000 packets) is too small for a fast link
#: exit status of the job when the namespace cannot be set up (like env(1)'s 125)
SETUP_FAILED = 125

_RATE_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_TIME_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}


@dataclass(frozen=True)
class NetSpec:
    """What ``--emulate-net`` asked for: bits/s (None: not limited) and one-way delay in s."""

    rate_bits: float | None
    delay_s: float = 0.0

    def describe(self) -> str:
        parts = [format_rate(self.rate_bits)]
        if self.delay_s:
            parts.append(f"+{self.delay_s * 1e3:g} ms one-way delay")
        return ", ".join(parts)


def parse_rate(text: str) -> float | None:
    """'500mbit', '1.5gbit', '2e8' -> bits per second; 'unlimited' / 'none' / '0' -> None.

    As in tc, ``mbit`` is megaBITS and ``mbps`` megaBYTES per second.
    """
    t = str(text).strip().lower()
    if t in ("unlimited", "none", "inf", "0", ""):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", t)
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(
            f"cannot parse rate {text!r}; use e.g. 200mbit, 1gbit, 1.5gbit or unlimited"
        )
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if bits < 8e3:
        raise ValueError(f"rate {text!r} is below 8kbit, the least tc tbf takes")
    return bits


def parse_latency(text: str) -> float:
    """'2ms', '500us', '0.1s' -> seconds (a unit is required; '0' is no delay)."""
    t = str(text).strip().lower()
    if t == "0":
        return 0.0
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", t)
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"cannot parse latency {text!r}; use e.g. 2ms, 500us or 0.1s")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_spec(text: str) -> NetSpec:
    """``RATE[,LATENCY]``, e.g. ``1gbit``, ``200mbit,2ms``, ``unlimited,5ms``."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) not in (1, 2) or not parts[0]:
        raise ValueError(
            f"cannot parse {text!r}; expected RATE[,LATENCY], e.g. 1gbit or 200mbit,2ms"
        )
    return NetSpec(parse_rate(parts[0]), parse_latency(parts[1]) if len(parts) == 2 else 0.0)


def format_rate(bits: float | None) -> str:
    if bits is None:
        return "unlimited"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.0f} bit/s"


def _tbf_args(bits: float) -> list[str]:
    rate_kbit = max(8, int(round(bits / 1e3)))
    # The bucket must hold at least one 64 KiB loopback (GSO) packet, with room to spare,
    # and a few timer ticks of traffic, or tbf drops/throttles below the configured rate.
    burst = max(MIN_BURST_BYTES, int(bits / 8 * 0.005))
    return ["rate", f"{rate_kbit}kbit", "burst", str(burst), "limit", str(QUEUE_LIMIT_BYTES)]


def tc_commands(spec: NetSpec, dev: str = "lo") -> list[list[str]]:
    """The ``ip``/``tc`` commands that set up the namespace's loopback for ``spec``."""
    cmds = [["ip", "link", "set", dev, "up"]]
    if spec.delay_s > 0:
        usec = max(1, int(round(spec.delay_s * 1e6)))
        cmds.append(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{usec}us",
                "limit",
                str(NETEM_LIMIT_PACKETS),
            ]
        )
        if spec.rate_bits is not None:
            cmds.append(
                [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:1",
                    "handle",
                    "10:",
                    "tbf",
                    *_tbf_args(spec.rate_bits),
                ]
            )
    elif spec.rate_bits is not None:
        cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "tbf", *_tbf_args(spec.rate_bits)])
    return cmds


def unshare_flags() -> list[str]:
    """``-n`` as root; ``-rn`` (map to root in a new user namespace) otherwise."""
    return ["-n"] if os.geteuid() == 0 else ["-rn"]


def _setup_script(spec: NetSpec) -> str:
    steps = " && ".join(shlex.join(c) for c in tc_commands(spec))
    hint = (
        "sapipe: emulated network: could not shape the loopback of the new network "
        "namespace (needs iproute2, kernel modules sch_tbf and, for a LATENCY, sch_netem)"
    )
    return f'{{ {steps}; }} || {{ echo {shlex.quote(hint)} >&2; exit {SETUP_FAILED}; }}; exec "$@"'


def wrap(argv: Sequence[str], spec: NetSpec) -> list[str]:
    """``argv`` to run in a fresh network namespace whose loopback is shaped as ``spec``."""
    return ["unshare", *unshare_flags(), "sh", "-c", _setup_script(spec), "sapipe-netns", *argv]


def check(spec: NetSpec | None = None) -> tuple[bool, str]:
    """Whether namespaces and tc work here (for ``spec``, default 1gbit); (ok, explanation)."""
    missing = [b for b in ("unshare", "ip", "tc") if shutil.which(b) is None]
    if missing:
        return False, (
            f"missing {', '.join(missing)}: install iproute2 and util-linux "
            "(apt-get install iproute2 util-linux)"
        )
    cmd = wrap(["true"], spec or NetSpec(1e9))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`unshare {' '.join(unshare_flags())}` failed: {exc}"
    if out.returncode == SETUP_FAILED:  # the namespace is there, tc failed in it
        return False, f"cannot shape the loopback: {out.stderr.strip()}"
    if out.returncode != 0:
        return False, (
            f"cannot create a network namespace ({out.returncode}): "
            f"{out.stderr.strip()} — run as root, or enable unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1)"
        )
    return True, f"network namespaces via `unshare {' '.join(unshare_flags())}` and tc on lo"

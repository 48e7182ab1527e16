"""docs/multinode.md, the multi-node recipe: every command in it that this host can check
without GPUs. Each ``sapipe-launch`` line (and the ``sapipe-launch`` arguments of each
``docker run`` line) is planned with ``--dry-run``: it must parse and give one torchrun
command per node; the script snippet must compile."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from support.paths import DOCS

DOC = str(DOCS / "multinode.md")


def _blocks(language: str):
    with open(DOC) as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)


def _launch_lines():
    """(environment, sapipe-launch arguments) of every command of the recipe."""
    out = []
    for block in _blocks("sh"):
        for line in block.strip().splitlines():
            words = shlex.split(line)
            env = {}
            while words and re.match(r"^[A-Z_]+=", words[0]):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            if words[:1] == ["sapipe-launch"]:
                out.append((env, words[1:]))
            elif words[:2] == ["docker", "run"]:
                out.append(
                    (env, words[words.index("sapipe") + 1 :])
                )  # the image's entry point is sapipe-launch
    return out


def test_the_recipe_has_its_commands():
    lines = _launch_lines()
    assert len(lines) >= 6 and any("--emulate-cluster" in args for _, args in lines)


@pytest.mark.parametrize(
    "env,args", _launch_lines(), ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_every_launch_line_plans(env, args):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_", "PET_"))}
    out = subprocess.run(
        [sys.executable, "-m", "sapipe.launch", "--dry-run", *args],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "torch.distributed.run" in out.stderr, out.stderr
    if "--emulate-cluster" in args:
        nodes = int(args[args.index("--emulate-cluster") + 1].split("x")[0])
        assert out.stderr.count("--node-rank=") == nodes, out.stderr


def test_the_script_snippet_compiles():
    (snippet,) = _blocks("python")
    compile(snippet, "multinode.md", "exec")

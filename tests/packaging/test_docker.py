"""The Dockerfile builds an image whose ``ppd-router`` runs, where a Docker daemon is reachable."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import pytest

from ..conftest import REPO


def docker_unavailable() -> str | None:
    """Why the image cannot be built here, or None."""
    if shutil.which("docker") is None:
        return "no docker command on this machine"
    r = subprocess.run(["docker", "info", "--format", "{{json .ServerVersion}}"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"no Docker daemon reachable ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'docker info failed'})"
    return None


def test_the_dockerfile_is_multi_stage_and_runs_unprivileged() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) == 2 and " AS build" in stages[0]
    assert stages[1].startswith("FROM python:") and stages[1].endswith("-slim")
    assert "USER 10001" in text  # Kubernetes' runAsNonRoot (deploy/k8s) needs a numeric user


@pytest.mark.skipif(docker_unavailable() is not None, reason=str(docker_unavailable()))
def test_the_image_builds_and_decides_without_rust() -> None:
    tag = f"ppd-router-test:{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "build", "-q", "-t", tag, str(REPO)], check=True, timeout=3600)
    try:
        r = subprocess.run(
            ["docker", "run", "--rm", "-v", f"{REPO / 'tables'}:/tables:ro", tag, "table", "decide",
             "/tables/h100-llama3.1-8b-2P2pD.json", "--turn", "1", "--n-in", "10",
             "--n-out", "10", "--ctx", "0", "--qps", "1"],
            capture_output=True, text=True, timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["reason"] == "turn1"
        r = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", tag, "-c", "command -v cargo || echo none"],
                           capture_output=True, text=True, timeout=300)
        assert r.stdout.strip() == "none"
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)

"""deploy/k8s: the example manifests are valid Kubernetes objects, and the router accepts the
TOML their ConfigMap carries.

kubernetes-validate (the test extra) ships the Kubernetes JSON schemas, so this runs offline;
``--strict`` also refuses fields the schemas do not know (a misspelt key would otherwise be
ignored by the API server's lenient decoding and silently do nothing).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO

K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent / "kubernetes-validate")
    return subprocess.run([exe, "--strict", *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_the_manifests_are_a_configmap_a_deployment_and_a_service() -> None:
    kinds = {line.split(":", 1)[1].strip() for p in MANIFESTS for line in p.read_text().splitlines()
             if line.startswith("kind:")}
    assert kinds == {"ConfigMap", "Deployment", "Service"}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_passes_strict_schema_validation(manifest: Path) -> None:
    r = validate(manifest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "passed" in r.stdout + r.stderr


def test_the_validator_refuses_an_unknown_field(tmp_path: Path) -> None:
    # The check is only worth something if it fails: a misspelt optional field (which the
    # schemas without --strict accept, and the API server would ignore) must be caught.
    bad = tmp_path / "deployment.yaml"
    bad.write_text((K8S / "deployment.yaml").read_text().replace("readOnly: true", "readonly: true", 1))
    r = validate(bad)
    assert r.returncode != 0
    assert "'readonly' was unexpected" in r.stdout + r.stderr


def configmap_toml() -> str:
    """The router.toml of configmap.yaml (a literal block scalar, indented four spaces)."""
    lines = (K8S / "configmap.yaml").read_text().splitlines()
    start = lines.index("  router.toml: |") + 1
    body = [line[4:] for line in lines[start:] if line.startswith("    ") or not line.strip()]
    return "\n".join(body) + "\n"


def test_the_configmap_toml_is_a_valid_router_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ppd_router.cli import main

    cfg = tmp_path / "router.toml"
    cfg.write_text(configmap_toml())
    assert main(["serve", "--config", str(cfg), "--print-config"]) == 0
    settings = json.loads(capsys.readouterr().out)
    # What the Deployment's probes and ports assume.
    assert (settings["host"], settings["port"], settings["admin_port"]) == ("0.0.0.0", 8000, 9000)
    assert "containerPort: 8000" in (K8S / "deployment.yaml").read_text()
    assert "/etc/ppd-router/router.toml" in (K8S / "deployment.yaml").read_text()

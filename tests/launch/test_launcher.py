"""The launcher without vLLM: node plans, each role's vLLM flags and environment, start-up failure
reports, and stopping every process it started, with a stand-in "vLLM" that serves /health."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from ppd_router.launch import (
    SITE_DIR,
    LaunchError,
    VllmCluster,
    find_vllm_python,
    kv_transfer_config,
    plan_nodes,
    vllm_command,
    vllm_env,
)
from tests.helpers import free_base_port, free_port

# A stand-in for `python -m vllm.entrypoints.openai.api_server ...`: FAKE_VLLM=die fails at start-up;
# otherwise it serves /health on --port and forks a grandchild (as vLLM forks its engine) whose pid
# it records, so tests can check that stopping the node reaches the whole process group.
FAKE_VLLM = textwrap.dedent(f"""\
    #!{sys.executable}
    import http.server, os, subprocess, sys
    args = sys.argv[1:]
    if os.environ.get("FAKE_VLLM") == "die":
        print("boom: fake vLLM could not load the model", flush=True)
        sys.exit(3)
    port = int(args[args.index("--port") + 1])
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["FAKE_VLLM_PIDS"], "a") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}\\n")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a zombie has exited; only its parent's wait is missing


def wait_until(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "fake-python"
    exe.write_text(FAKE_VLLM)
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(tmp_path / "pids"))
    return exe


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    return d


def recorded_pids(tmp_path: Path) -> list[int]:
    f = tmp_path / "pids"
    return [int(p) for line in f.read_text().splitlines() for p in line.split()] if f.exists() else []


# --- plans -------------------------------------------------------------------------------------


def test_each_node_gets_its_own_http_side_channel_and_kv_event_ports() -> None:
    plans = plan_nodes(["P", "pD", "pD"], device="cpu", base_port=9000, cpus=[0, 1])
    assert [p.name for p in plans] == ["P0", "pD0", "pD1"]
    assert [p.port for p in plans] == [9000, 9001, 9002]
    assert [p.side_channel_port for p in plans] == [10000, 10001, 10002]
    assert [p.kv_events_port for p in plans] == [11000, 11001, 11002]
    assert plans[2].url == "http://127.0.0.1:9002"


def test_cpu_nodes_are_pinned_round_robin_over_the_given_cores() -> None:
    plans = plan_nodes(["P", "P", "pD", "pD", "D"], device="cpu", base_port=9000, cpus=[4, 7])
    assert [p.cpu for p in plans] == [4, 7, 4, 7, 4]
    assert all(p.gpu is None for p in plans)


def test_prefill_nodes_keep_cores_of_their_own_when_nodes_outnumber_cores() -> None:
    # A D on P's core pulls its KV late: D nodes share the cores P does not use.
    assert [p.cpu for p in plan_nodes(["P", "pD", "pD"], device="cpu", base_port=9000, cpus=[0, 1])] == [0, 1, 1]
    assert [p.cpu for p in plan_nodes(["pD", "P", "D", "pD"], device="cpu", base_port=9000,
                                      cpus=[0, 1, 2])] == [1, 0, 2, 1]
    assert [p.cpu for p in plan_nodes(["R", "P", "pD"], device="cpu", base_port=9000, cpus=[3])] == [3, 3, 3]


def test_cpu_pinning_defaults_to_this_process_affinity() -> None:
    plans = plan_nodes(["P", "pD"], device="cpu", base_port=9000)
    allowed = sorted(os.sched_getaffinity(0))
    assert plans[0].cpu == allowed[0]
    assert all(p.cpu in allowed for p in plans)


def test_cuda_nodes_get_one_gpu_each_in_layout_order() -> None:
    assert [p.gpu for p in plan_nodes(["P", "P", "pD", "pD"], device="cuda", base_port=9000)] == ["0", "1", "2", "3"]
    given = plan_nodes(["P", "pD"], device="cuda", base_port=9000, gpus=["5", "2"])
    assert [p.gpu for p in given] == ["5", "2"]
    assert all(p.cpu is None for p in given)


@pytest.mark.parametrize("kwargs,needle", [
    ({"roles": ["P", "pD", "pD"], "device": "cuda", "gpus": ["0", "1"]}, "--gpus 0,1: 3 nodes need 3 GPUs"),
    ({"roles": ["P", "X"], "device": "cpu"}, "roles"),
    ({"roles": [], "device": "cpu"}, "non-empty"),
    ({"roles": ["P"], "device": "tpu"}, "--device 'tpu'"),
    ({"roles": ["P", "pD"], "device": "cpu", "base_port": 65000}, "--base-port 65000"),
    ({"roles": ["P"], "device": "cpu", "base_port": 0}, "--base-port 0"),
])
def test_bad_plans_are_refused_naming_the_setting(kwargs: dict, needle: str) -> None:
    kwargs.setdefault("base_port", 9000)
    roles = kwargs.pop("roles")
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        plan_nodes(roles, **kwargs)


# --- flags and environment --------------------------------------------------------------------


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_prefill_produces_and_decode_consumes_kv_over_nixl() -> None:
    assert kv_transfer_config("P", "cuda") == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    for role in ("D", "pD"):
        assert kv_transfer_config(role, "cuda") == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert kv_transfer_config("R", "cuda") is None
    cpu = kv_transfer_config("pD", "cpu")
    assert cpu is not None and cpu["kv_buffer_device"] == "cpu"


def test_the_pull_path_makes_every_node_a_bidirectional_nixl_peer() -> None:
    for role in ("P", "D", "pD"):
        cfg = kv_transfer_config(role, "cpu", decoder_kv_blocks_ttl=90.0)
        assert cfg is not None and cfg["kv_role"] == "kv_both"
        assert cfg["kv_connector_extra_config"] == {"num_threads": 0, "bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 90.0}
    assert "kv_connector_extra_config" not in (kv_transfer_config("P", "cuda") or {})
    assert kv_transfer_config("R", "cpu", decoder_kv_blocks_ttl=90.0) is None


def test_dry_run_with_bidirectional_transfer_sets_the_routers_ttl_on_the_nodes(model_dir: Path) -> None:
    r = subprocess.run(launch_cli("--model", str(model_dir), "--layout", "1P_1pD", "--device", "cuda", "--gpus", "0,1",
                                  "--python", sys.executable, "--dry-run", "--policy", "pull",
                                  "--bidirectional-kv-xfer", "--decoder-kv-blocks-ttl", "75"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    for node in plan["nodes"]:
        kv = json.loads(flag(node["command"], "--kv-transfer-config"))
        assert kv["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 75.0}
    assert plan["router"]["bidirectional_kv_xfer"] is True and plan["router"]["policy"] == "pull"


def test_launched_nodes_require_the_routers_upstream_key_which_no_command_line_shows(
    model_dir: Path, tmp_path: Path
) -> None:
    key = tmp_path / "upstream.key"
    key.write_text("upstream-secret-1\n")
    r = subprocess.run(launch_cli("--model", str(model_dir), "--layout", "1P_1pD", "--device", "cuda", "--gpus", "0,1",
                                  "--python", sys.executable, "--dry-run", "--upstream-api-key-file", str(key)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "upstream-secret-1" not in r.stdout
    plan = json.loads(r.stdout)
    for node in plan["nodes"]:
        # vLLM reads VLLM_API_KEY as --api-key; the dry run shows that it is set, not what it is.
        assert node["env"]["VLLM_API_KEY"] == "<set>"
        assert "--api-key" not in node["command"]
    plain = subprocess.run(launch_cli("--model", str(model_dir), "--layout", "1P_1pD", "--device", "cuda",
                                      "--gpus", "0,1", "--python", sys.executable, "--dry-run"),
                           capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "PPD_UPSTREAM_API_KEY"})
    assert all("VLLM_API_KEY" not in n["env"] for n in json.loads(plain.stdout)["nodes"])


def test_bidirectional_cpu_nodes_run_their_executor_in_process() -> None:
    p, pd = plan_nodes(["P", "pD"], device="cpu", base_port=9000, cpus=[0])
    for node in (p, pd):
        cmd = vllm_command(node, model="/m", python="/py", device="cpu", served_model_name="tiny",
                           decoder_kv_blocks_ttl=90.0)
        assert flag(cmd, "--distributed-executor-backend") == "uni"
        # vLLM's CPU platform keeps "uni" only with the engine in the API server's process.
        assert vllm_env(node, device="cpu", base={}, bidirectional=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        plain = vllm_command(node, model="/m", python="/py", device="cpu", served_model_name="tiny")
        assert "--distributed-executor-backend" not in plain
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_env(node, device="cpu", base={})
    gpu_p, = plan_nodes(["P"], device="cuda", base_port=9000, gpus=["0"])
    gpu = vllm_command(gpu_p, model="/m", python="/py", device="cuda", served_model_name="m",
                       decoder_kv_blocks_ttl=90.0)
    assert "--distributed-executor-backend" not in gpu


def test_vllm_command_carries_the_role_flags_then_the_users() -> None:
    p, pd, r = plan_nodes(["P", "pD", "R"], device="cpu", base_port=9000, cpus=[0])
    cmd = vllm_command(pd, model="/m", python="/py", device="cpu", served_model_name="tiny",
                       extra_args=["--enforce-eager", "--max-model-len", "2048"])
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(cmd, "--model") == "/m" and flag(cmd, "--port") == "9001" and flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--served-model-name") == "tiny"
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert json.loads(flag(cmd, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    events = json.loads(flag(cmd, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["endpoint"] == "tcp://127.0.0.1:11001"
    assert cmd[-3:] == ["--enforce-eager", "--max-model-len", "2048"]
    p_cmd = vllm_command(p, model="/m", python="/py", device="cpu", served_model_name="tiny")
    assert json.loads(flag(p_cmd, "--kv-transfer-config"))["kv_role"] == "kv_producer"
    r_cmd = vllm_command(r, model="/m", python="/py", device="cpu", served_model_name="tiny", kv_events=False)
    assert "--kv-transfer-config" not in r_cmd and "--kv-events-config" not in r_cmd


def test_cpu_environment_pins_threads_uses_loopback_ucx_and_the_nixl_patch() -> None:
    plan = plan_nodes(["P", "pD"], device="cpu", base_port=9000, cpus=[3, 5])[1]
    env = vllm_env(plan, device="cpu", base={"PYTHONPATH": "/mine"}, cpu_kvcache_gib=2)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "10001" and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "5"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["UCX_NET_DEVICES"] == "lo" and "tcp" in env["UCX_TLS"].split(",")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/mine"]
    assert env["PPD_NIXL_PTHR_DELAY_US"] == "1000"
    assert vllm_env(plan, device="cpu", base={"PPD_NIXL_PTHR_DELAY_US": "50"})["PPD_NIXL_PTHR_DELAY_US"] == "50"


def test_cuda_environment_shows_each_node_only_its_gpu() -> None:
    plan = plan_nodes(["P", "pD"], device="cuda", base_port=9000, gpus=["6", "7"])[1]
    env = vllm_env(plan, device="cuda", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "7"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "PYTHONPATH" not in env


# --- the NIXL progress-thread patch ------------------------------------------------------------


def test_site_patch_gives_new_nixl_agents_the_configured_delay(tmp_path: Path) -> None:
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_api.py").write_text(textwrap.dedent("""\
        class _Config:
            pthrDelay = 0
        class nixlBind:
            nixlAgentConfig = _Config
            @staticmethod
            def nixlAgent(name, config):
                return (name, config.pthrDelay)
    """))
    probe = "import nixl._api as a; print(a.nixlBind.nixlAgent('x', a.nixlBind.nixlAgentConfig())[1])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(tmp_path)])}
    patched = subprocess.run([sys.executable, "-c", probe], env={**env, "PPD_NIXL_PTHR_DELAY_US": "750"},
                             capture_output=True, text=True, check=True)
    assert patched.stdout.strip() == "750"
    env.pop("PPD_NIXL_PTHR_DELAY_US", None)
    untouched = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert untouched.stdout.strip() == "0"


# --- running nodes ------------------------------------------------------------------------------


def test_missing_model_or_interpreter_is_a_clear_error(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(LaunchError, match="no such directory"):
        VllmCluster(str(tmp_path / "absent"), ["P", "pD"], python=sys.executable)
    with pytest.raises(LaunchError, match="is not an executable"):
        find_vllm_python(str(tmp_path / "no-python"))


def test_a_node_that_dies_at_start_up_is_reported_with_its_log_tail(
        tmp_path: Path, fake_vllm: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM", "die")
    cluster = VllmCluster(str(model_dir), ["P", "pD"], python=str(fake_vllm), base_port=free_base_port(2),
                          log_dir=str(tmp_path / "logs"))
    with cluster, pytest.raises(LaunchError) as err:
        cluster.wait_healthy(timeout_s=60, progress=False)
    msg = str(err.value)
    assert "exited with code 3" in msg and "boom: fake vLLM could not load the model" in msg


def test_healthy_nodes_are_timed_and_stopping_reaches_their_whole_process_group(
        tmp_path: Path, fake_vllm: Path, model_dir: Path) -> None:
    cluster = VllmCluster(str(model_dir), ["P", "pD", "pD"], python=str(fake_vllm), base_port=free_base_port(3),
                          log_dir=str(tmp_path / "logs"))
    with cluster:
        cluster.wait_healthy(timeout_s=60, progress=False)
        assert all(n.ready_s is not None and n.ready_s > 0 for n in cluster.nodes)
        events = [f"tcp://127.0.0.1:{p.kv_events_port}" for p in cluster.plans[1:]]
        assert cluster.router_nodes() == {"prefill": [cluster.plans[0].url],
                                          "pd_capable": [f"{p.url};kv_events={e}" for p, e in zip(cluster.plans[1:], events)]}
        assert wait_until(lambda: len(recorded_pids(tmp_path)) == 6)
        pids = recorded_pids(tmp_path)
        assert not any(gone(p) for p in pids)
    assert wait_until(lambda: all(gone(p) for p in pids)), "a server or its forked child outlived the cluster"


def test_a_late_node_times_out_with_its_name(tmp_path: Path, model_dir: Path) -> None:
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!{sys.executable}\nimport time\nprint('still loading', flush=True)\ntime.sleep(600)\n")
    slow.chmod(0o755)
    cluster = VllmCluster(str(model_dir), ["P"], python=str(slow), base_port=free_base_port(1),
                          log_dir=str(tmp_path / "logs"))
    with cluster, pytest.raises(LaunchError, match=r"P0 .* not healthy within 2 s(.|\n)*still loading"):
        cluster.wait_healthy(timeout_s=2, progress=False)
    assert not cluster.nodes[0].alive()


# --- the command --------------------------------------------------------------------------------


def launch_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ppd_router.cli", "launch", *args]


def test_launch_serves_through_the_router_and_sigterm_stops_every_child(
        tmp_path: Path, fake_vllm: Path, model_dir: Path) -> None:
    port, base = free_port(), free_base_port(2)
    proc = subprocess.Popen(
        launch_cli("--model", str(model_dir), "--layout", "1P1pD", "--device", "cpu", "--python", str(fake_vllm),
                   "--base-port", str(base), "--port", str(port), "--log-dir", str(tmp_path / "logs"), "--quiet",
                   "--admin-token", "s"),
        stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: len(recorded_pids(tmp_path)) == 4, 60)

        def router_up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(router_up, 60), "router did not come up"
        nodes = httpx.get(f"http://127.0.0.1:{port}/admin/nodes", headers={"authorization": "Bearer s"}).json()
        urls = sorted(n["url"] for n in nodes["nodes"])
        assert urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped every vLLM node" in err
    assert wait_until(lambda: all(gone(p) for p in recorded_pids(tmp_path)))


@pytest.mark.parametrize("args,needle", [
    (["--layout", "2X"], "layout"),
    (["--layout", "1P1pD", "--model", "/nonexistent/model"], "no such directory"),
    (["--layout", "1P1pD", "--w-ttft", "-1"], "w_ttft"),
    (["--layout", "1P1pD", "--", "--enforce-eager"], None),
])
def test_bad_launch_arguments_fail_before_any_node_starts(
        args: list[str], needle: str | None, tmp_path: Path, model_dir: Path) -> None:
    if "--model" not in args:
        args = ["--model", str(model_dir), *args]
    python = tmp_path / "must-not-run"
    python.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\nexit 1\n")
    python.chmod(0o755)
    r = subprocess.run(launch_cli("--python", str(python), "--base-port", str(free_base_port(2)),
                                  "--log-dir", str(tmp_path / "logs"), "--quiet", "--startup-timeout", "5", *args),
                       capture_output=True, text=True, timeout=60)
    if needle is None:
        # Valid arguments: the stand-in runs, fails, and the launcher reports it.
        assert r.returncode != 0 and "exited with code 1" in r.stderr
        assert (tmp_path / "ran").exists()
        return
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert not (tmp_path / "ran").exists()


def test_dry_run_prints_every_node_command_and_the_router_settings(tmp_path: Path, model_dir: Path) -> None:
    r = subprocess.run(launch_cli("--model", str(model_dir), "--layout", "2P_1pD", "--device", "cuda", "--gpus", "4,5,6",
                                  "--python", sys.executable, "--base-port", "9300",
                                  "--dry-run", "--policy", "pd", "--", "--enforce-eager"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [(n["name"], n["gpu"], n["url"]) for n in plan["nodes"]] == [
        ("P0", "4", "http://127.0.0.1:9300"), ("P1", "5", "http://127.0.0.1:9301"), ("pD0", "6", "http://127.0.0.1:9302")]
    assert all(n["command"][-1] == "--enforce-eager" for n in plan["nodes"])
    assert plan["nodes"][2]["env"]["CUDA_VISIBLE_DEVICES"] == "6"
    assert plan["router"]["prefill"] == ["http://127.0.0.1:9300", "http://127.0.0.1:9301"]
    # The router binds where the decoding node publishes its KV events (base + 2000 + i).
    assert plan["router"]["pd_capable"] == ["http://127.0.0.1:9302;kv_events=tcp://127.0.0.1:11302"]
    assert plan["router"]["policy"] == "pd"
    assert not (tmp_path / "logs").exists()


def test_hub_model_names_pass_through_but_missing_local_paths_do_not(model_dir: Path) -> None:
    hub = VllmCluster("meta-llama/Llama-3.1-8B-Instruct", ["P", "pD"], device="cuda", python=sys.executable)
    assert hub.plan_summary()["nodes"][0]["command"][4] == "meta-llama/Llama-3.1-8B-Instruct"
    for missing in ("./no-model", "/abs/no/model", "a/b/c"):
        with pytest.raises(LaunchError, match="no such directory"):
            VllmCluster(missing, ["P", "pD"], device="cuda", python=sys.executable)


def test_several_gpus_per_node_get_consecutive_ids_and_tensor_parallelism(model_dir: Path) -> None:
    plans = plan_nodes(["P", "pD"], device="cuda", base_port=9000, gpus=list("0123"), gpus_per_node=2)
    assert [p.gpu for p in plans] == ["0,1", "2,3"]
    assert vllm_env(plans[1], device="cuda", base={})["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match=r"2 nodes need 4 GPUs \(2 each\)"):
        plan_nodes(["P", "pD"], device="cuda", base_port=9000, gpus=list("012"), gpus_per_node=2)
    with pytest.raises(ValueError, match="--gpus-per-node 0"):
        plan_nodes(["P"], device="cuda", base_port=9000, gpus_per_node=0)
    cmd = VllmCluster(str(model_dir), ["P", "pD"], device="cuda", python=sys.executable, gpus_per_node=2,
                      vllm_args=["--enforce-eager"]).plan_summary()["nodes"][0]["command"]
    assert cmd[-3:] == ["--tensor-parallel-size", "2", "--enforce-eager"]
    one = VllmCluster(str(model_dir), ["P", "pD"], device="cuda", python=sys.executable).plan_summary()
    assert "--tensor-parallel-size" not in one["nodes"][0]["command"]

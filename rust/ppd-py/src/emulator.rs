//! Python bindings of the engine emulator (HTTP nodes) and the virtual-time simulator.
//!
//! Every entry point releases the GIL while Rust runs, and no panic crosses
//! into Python: errors become `ValueError`/`RuntimeError` with the reason.

use pyo3::prelude::*;
use std::sync::Mutex;

use ppd_core::builtin::{load_table, nearest_for};
use ppd_core::catalog;
use ppd_core::layout::{parse_layout, parse_sim_layout};
use ppd_emulator::{ClusterThread, Faults, NodeConfig, Role};
use ppd_model::sim::{self, SimConfig};

use crate::errors;

fn cfg_err(e: impl std::fmt::Display) -> PyErr {
    errors::config(e.to_string())
}

#[allow(clippy::too_many_arguments)]
fn node_config(
    role: &str,
    host: &str,
    port: u16,
    profile: Option<&str>,
    kv_link_gbps: Option<f64>,
    max_num_seqs: Option<u32>,
    max_num_batched_tokens: Option<u32>,
    kv_blocks: Option<u32>,
    seed: u64,
    served_model_name: Option<&str>,
    fault_latency_ms: f64,
    fault_error_rate: f64,
    fault_hang: bool,
    kv_events_endpoint: Option<&str>,
    kv_events_bind: bool,
    kv_connector_extra_config: Option<&str>,
    api_key: Option<&str>,
) -> PyResult<NodeConfig> {
    let mut cfg = NodeConfig::new(Role::parse(role).map_err(cfg_err)?);
    cfg.host = host.to_owned();
    cfg.port = port;
    cfg.api_key = api_key.map(str::to_owned);
    if let Some(p) = profile {
        cfg.profile = ppd_model::load_profile(p).map_err(cfg_err)?;
    }
    cfg.kv_link_gbps = kv_link_gbps;
    cfg.max_num_seqs = max_num_seqs;
    cfg.max_num_batched_tokens = max_num_batched_tokens;
    cfg.kv_blocks = kv_blocks;
    cfg.seed = seed;
    if let Some(n) = served_model_name {
        cfg.served_model_name = n.to_owned();
    }
    cfg.faults = Faults {
        latency_ms: fault_latency_ms,
        error_rate: fault_error_rate,
        hang: fault_hang,
        crash: false,
    };
    if let Some(endpoint) = kv_events_endpoint {
        if !endpoint.starts_with("tcp://") {
            return Err(cfg_err(format!(
                "kv_events_endpoint {endpoint:?}: expected tcp://HOST:PORT"
            )));
        }
        cfg.kv_events = Some(ppd_emulator::KvEventsConfig::new(
            endpoint,
            &format!("kv.{role}"),
            kv_events_bind,
        ));
    }
    if let Some(extra) = kv_connector_extra_config {
        cfg.bidirectional =
            ppd_emulator::Bidirectional::from_extra_config(extra).map_err(cfg_err)?;
    }
    cfg.effective_profile().map_err(cfg_err)?;
    Ok(cfg)
}

/// Runs one emulator node until SIGINT/SIGTERM (returns None) or a failure (raises).
#[pyfunction]
#[pyo3(signature = (role = "R", port = 8000, *, host = "127.0.0.1", profile = None, kv_link_gbps = None,
    max_num_seqs = None, max_num_batched_tokens = None, kv_blocks = None, seed = 0, served_model_name = None,
    fault_latency_ms = 0.0, fault_error_rate = 0.0, fault_hang = false, kv_events_endpoint = None,
    kv_events_bind = false, kv_connector_extra_config = None, api_key = None))]
#[allow(clippy::too_many_arguments)]
fn run_emulator(
    py: Python<'_>,
    role: &str,
    port: u16,
    host: &str,
    profile: Option<&str>,
    kv_link_gbps: Option<f64>,
    max_num_seqs: Option<u32>,
    max_num_batched_tokens: Option<u32>,
    kv_blocks: Option<u32>,
    seed: u64,
    served_model_name: Option<&str>,
    fault_latency_ms: f64,
    fault_error_rate: f64,
    fault_hang: bool,
    kv_events_endpoint: Option<&str>,
    kv_events_bind: bool,
    kv_connector_extra_config: Option<&str>,
    api_key: Option<&str>,
) -> PyResult<()> {
    let cfg = node_config(
        role,
        host,
        port,
        profile,
        kv_link_gbps,
        max_num_seqs,
        max_num_batched_tokens,
        kv_blocks,
        seed,
        served_model_name,
        fault_latency_ms,
        fault_error_rate,
        fault_hang,
        kv_events_endpoint,
        kv_events_bind,
        kv_connector_extra_config,
        api_key,
    )?;
    py.detach(|| ppd_emulator::run_blocking(cfg, ppd_server::shutdown_signal()))
        .map_err(errors::run)
}

/// Emulator nodes running in this process on free 127.0.0.1 ports.
#[pyclass(module = "ppd_router._core")]
struct EmulatedCluster {
    inner: Mutex<Option<ClusterThread>>,
    #[pyo3(get)]
    urls: Vec<String>,
    /// The nodes as router settings name them: `URL;kv_events=tcp://...` for decoding nodes.
    #[pyo3(get)]
    specs: Vec<String>,
    /// Layout roles in order: "P", "D", "pD" or "R".
    #[pyo3(get)]
    roles: Vec<String>,
}

#[pymethods]
impl EmulatedCluster {
    /// Stops every node (graceful) and joins their runtime; idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let c = self
            .inner
            .lock()
            .map_err(|_| errors::run("cluster lock poisoned"))?
            .take();
        if let Some(c) = c {
            py.detach(|| c.shutdown());
        }
        Ok(())
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<Py<PyAny>>,
        _v: Option<Py<PyAny>>,
        _tb: Option<Py<PyAny>>,
    ) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }
    fn __repr__(&self) -> String {
        format!("EmulatedCluster({:?})", self.urls)
    }
}

/// Starts the nodes of `layout` (e.g. "2P2pD", "1P_1D_2pD", "4R") in this process.
#[pyfunction]
#[pyo3(signature = (layout, *, profile = None, kv_link_gbps = None, max_num_seqs = None,
    max_num_batched_tokens = None, kv_blocks = None, seed = 0, served_model_name = None,
    kv_connector_extra_config = None))]
#[allow(clippy::too_many_arguments)]
fn start_emulated_cluster(
    py: Python<'_>,
    layout: &str,
    profile: Option<&str>,
    kv_link_gbps: Option<f64>,
    max_num_seqs: Option<u32>,
    max_num_batched_tokens: Option<u32>,
    kv_blocks: Option<u32>,
    seed: u64,
    served_model_name: Option<&str>,
    kv_connector_extra_config: Option<&str>,
) -> PyResult<EmulatedCluster> {
    let roles = parse_layout(layout).map_err(errors::from_core)?;
    let base = node_config(
        "R",
        "127.0.0.1",
        0,
        profile,
        kv_link_gbps,
        max_num_seqs,
        max_num_batched_tokens,
        kv_blocks,
        seed,
        served_model_name,
        0.0,
        0.0,
        false,
        None,
        false,
        kv_connector_extra_config,
        None,
    )?;
    let c = py
        .detach(|| ClusterThread::start(&roles, &base))
        .map_err(errors::run)?;
    Ok(EmulatedCluster {
        urls: c.urls(),
        specs: c.specs(),
        roles: c.nodes.iter().map(|n| n.role.as_str().to_owned()).collect(),
        inner: Mutex::new(Some(c)),
    })
}

/// A profile (built-in name or TOML path) as JSON.
#[pyfunction]
fn load_profile(name_or_path: &str) -> PyResult<String> {
    let p = ppd_model::load_profile(name_or_path).map_err(cfg_err)?;
    serde_json::to_string(&p).map_err(cfg_err)
}

/// Runs one simulated point. `config_json` holds SimConfig's fields (deployment,
/// policy, workload, qps, duration_s, seed, timeout_s, turns, w_ttft, w_tpot, and
/// optionally conversations: per-turn [n_in, n_out] lists that replace the named workload,
/// routers and view_delay_s: router replicas and the age of their view of load);
/// `table` is a path or `builtin:h100-2P2pD` (default for `ppd`: the shipped table
/// nearest the deployment, [`nearest_for`]).
/// Returns the result as JSON (with `table` naming the table used, if any).
#[pyfunction]
#[pyo3(signature = (config_json, profile = None, table = None))]
fn simulate(
    py: Python<'_>,
    config_json: &str,
    profile: Option<&str>,
    table: Option<&str>,
) -> PyResult<String> {
    let cfg: SimConfig =
        serde_json::from_str(config_json).map_err(|e| cfg_err(format!("simulate config: {e}")))?;
    let prof = ppd_model::load_profile(profile.unwrap_or("default")).map_err(cfg_err)?;
    let wants_table = cfg.policy.trim() == "ppd";
    let spec = match table {
        Some(spec) => Some(spec.to_owned()),
        None if wants_table => {
            let roles = parse_sim_layout(&cfg.deployment).map_err(errors::from_core)?;
            Some(nearest_for(&roles).spec())
        }
        None => None,
    };
    let table = spec
        .as_deref()
        .map(|s| load_table(s).map_err(|e| cfg_err(format!("table {s}: {e}"))))
        .transpose()?;
    let r = py
        .detach(|| sim::simulate(&cfg, &prof, table.as_ref()))
        .map_err(cfg_err)?;
    let mut v = serde_json::to_value(r).map_err(cfg_err)?;
    if let Some(spec) = spec {
        v["table"] = serde_json::Value::String(spec);
    }
    Ok(v.to_string())
}

/// Names the simulator knows: the paper's workloads, configurations and QPS levels.
#[pyfunction]
fn simulator_catalog() -> (Vec<String>, Vec<String>, Vec<f64>) {
    (
        catalog::paper_workload_names(),
        catalog::paper_configs()
            .iter()
            .map(|c| c.0.to_owned())
            .collect(),
        catalog::PAPER_QPS.to_vec(),
    )
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_emulator, m)?)?;
    m.add_function(wrap_pyfunction!(start_emulated_cluster, m)?)?;
    m.add_function(wrap_pyfunction!(load_profile, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(simulator_catalog, m)?)?;
    m.add_class::<EmulatedCluster>()?;
    Ok(())
}

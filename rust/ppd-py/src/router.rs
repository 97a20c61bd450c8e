//! `Router`: the Rust router server, embedded in a Python process (start/stop) or run in the foreground (serve).
//!
//! This is where the router meets emulated nodes: `emulated = "2P2pD"` starts
//! an emulated cluster first and hands its URLs to the router as static nodes,
//! so the router crate itself never links the emulator.

use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::Mutex;

use ppd_core::Role;
use ppd_emulator::{ClusterThread, NodeConfig};
use ppd_server::registry::Source;
use ppd_server::{RouterConfig, RouterHandle, Settings};

use crate::errors;

/// Settings from an optional TOML file, overridden by `settings_json` (the
/// command line's flags, by TOML key), validated once.
fn load_settings(settings_json: &str, config_path: Option<PathBuf>) -> PyResult<Settings> {
    let base = match &config_path {
        Some(path) => RouterConfig::from_toml_file(path),
        None => Ok(RouterConfig::default()),
    };
    base.and_then(|c| c.with_overrides(settings_json))
        .and_then(RouterConfig::validate)
        .map_err(|e| errors::config(e.to_string()))
}

/// Starts the emulated cluster the settings ask for, if any, and turns it into static nodes.
fn with_emulated_nodes(settings: Settings) -> PyResult<(Settings, Option<ClusterThread>)> {
    let Some(roles) = settings.emulated().map(<[Role]>::to_vec) else {
        return Ok((settings, None));
    };
    let mut base = NodeConfig::new(Role::D);
    if let Some(p) = &settings.config().emulator_profile {
        base.profile = ppd_model::load_profile(p)
            .map_err(|e| errors::config(format!("invalid setting `emulator_profile`: {e}")))?;
    }
    // Nodes as `launch` would start them for a router that pulls.
    let cfg = settings.config();
    if cfg.bidirectional_kv_xfer {
        base.bidirectional = Some(ppd_emulator::Bidirectional {
            decoder_kv_blocks_ttl_s: cfg.decoder_kv_blocks_ttl,
            ..ppd_emulator::Bidirectional::default()
        });
    }
    let cluster = ClusterThread::start(&roles, &base)
        .map_err(|e| errors::run(format!("emulated cluster: {e}")))?;
    let settings = settings
        .with_emulated_nodes(&cluster.specs())
        .map_err(|e| errors::config(e.to_string()))?;
    Ok((settings, Some(cluster)))
}

/// A started router and the emulated nodes started for it.
struct Running {
    router: RouterHandle,
    cluster: Option<ClusterThread>,
}

impl Running {
    fn stop(mut self) -> Result<(), ppd_server::ServerError> {
        let stopped = self.router.stop();
        if let Some(c) = self.cluster.take() {
            c.shutdown();
        }
        stopped
    }
}

/// The router. `settings_json` holds settings of `ppd-router serve` by TOML
/// key, over the file at `config_path`. `serve()` blocks until SIGINT/SIGTERM
/// with the GIL released; `start()` runs it on a background thread until `stop()`.
#[pyclass(module = "ppd_router._core")]
pub struct Router {
    settings: Settings,
    running: Mutex<Option<Running>>,
}

impl Router {
    /// Runs `f` on the started router, or says it is not started.
    fn with_started<R>(&self, f: impl FnOnce(&RouterHandle) -> PyResult<R>) -> PyResult<R> {
        let h = self
            .running
            .lock()
            .map_err(|_| errors::run("router lock poisoned"))?;
        f(&h.as_ref()
            .ok_or_else(|| errors::run("the router is not started"))?
            .router)
    }
}

#[pymethods]
impl Router {
    #[new]
    #[pyo3(signature = (settings_json = "{}", *, config_path = None))]
    fn new(settings_json: &str, config_path: Option<PathBuf>) -> PyResult<Self> {
        Ok(Router {
            settings: load_settings(settings_json, config_path)?,
            running: Mutex::new(None),
        })
    }

    /// Runs in the foreground until SIGINT or SIGTERM.
    fn serve(&self, py: Python<'_>) -> PyResult<()> {
        let settings = self.settings.clone();
        py.detach(|| {
            let (settings, cluster) = with_emulated_nodes(settings)?;
            let served = ppd_server::serve_blocking(settings).map_err(errors::run);
            if let Some(c) = cluster {
                c.shutdown();
            }
            served
        })
    }

    /// Starts on a background thread; returns the URL once it accepts connections.
    fn start(&self, py: Python<'_>) -> PyResult<String> {
        let mut running = self
            .running
            .lock()
            .map_err(|_| errors::run("router lock poisoned"))?;
        if let Some(r) = running.as_ref() {
            return Ok(r.router.url());
        }
        let settings = self.settings.clone();
        let started = py.detach(|| {
            let (settings, cluster) = with_emulated_nodes(settings)?;
            let router = RouterHandle::start(settings).map_err(errors::run)?;
            Ok::<_, PyErr>(Running { router, cluster })
        })?;
        let url = started.router.url();
        *running = Some(started);
        Ok(url)
    }

    /// Stops a started router (open streams finish first) and its emulated nodes.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self
            .running
            .lock()
            .map_err(|_| errors::run("router lock poisoned"))?
            .take();
        if let Some(r) = taken {
            py.detach(|| r.stop()).map_err(errors::run)?;
        }
        Ok(())
    }

    #[getter]
    fn url(&self) -> PyResult<Option<String>> {
        Ok(self
            .running
            .lock()
            .map_err(|_| errors::run("router lock poisoned"))?
            .as_ref()
            .map(|r| r.router.url()))
    }

    /// Registers (or refreshes) a node of a started router; `source` is "zmq" or "admin".
    #[pyo3(signature = (url, role, zmq_address = None, source = "zmq"))]
    fn register_node(
        &self,
        url: &str,
        role: &str,
        zmq_address: Option<String>,
        source: &str,
    ) -> PyResult<bool> {
        let role = Role::parse(role).map_err(errors::from_core)?;
        let source = match source {
            "zmq" => Source::Zmq,
            "admin" => Source::Admin,
            other => {
                return Err(errors::invalid(format!(
                    "source {other:?}: expected zmq or admin"
                )))
            }
        };
        let spec = ppd_server::config::parse_node("url", url)
            .map_err(|e| errors::invalid(e.to_string()))?;
        let spec = ppd_server::config::NodeSpec {
            zmq: zmq_address.or(spec.zmq),
            ..spec
        };
        self.with_started(|h| {
            Ok(ppd_server::membership::register_node(&h.state, &spec, role, source).1)
        })
    }

    /// Removes a node; returns how many entries went.
    fn deregister_node(&self, url: &str) -> PyResult<usize> {
        self.with_started(|h| Ok(ppd_server::membership::deregister_node(&h.state, url).len()))
    }

    /// The bearer token the router sends to every node (`upstream_api_key`,
    /// its file, or `PPD_UPSTREAM_API_KEY`), for `launch` to start its nodes
    /// with; `None` when unset.
    #[getter]
    fn upstream_api_key(&self) -> Option<String> {
        self.settings
            .config()
            .upstream_secret
            .get()
            .map(str::to_owned)
    }

    /// Nodes as JSON (what `GET /admin/nodes` returns).
    fn nodes_json(&self) -> PyResult<String> {
        self.with_started(|h| Ok(ppd_server::admin::node_list(&h.state).to_string()))
    }
}

/// The settings (defaults filled in) as JSON, after the same reading and
/// validation as `Router`, or ConfigError naming the bad field.
#[pyfunction]
#[pyo3(signature = (settings_json = "{}", *, config_path = None))]
fn validate_router_config(settings_json: &str, config_path: Option<PathBuf>) -> PyResult<String> {
    let settings = load_settings(settings_json, config_path)?;
    serde_json::to_string(settings.config()).map_err(|e| errors::run(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "ROLE_SETTINGS",
        Role::ALL
            .iter()
            .map(|&r| (r.as_str(), ppd_server::config::node_setting(r)))
            .collect::<std::collections::BTreeMap<_, _>>(),
    )?;
    m.add_class::<Router>()?;
    m.add_function(wrap_pyfunction!(validate_router_config, m)?)?;
    Ok(())
}

//! `Router`: the Rust router server, embedded in a Python process (start/stop) or run in the foreground (serve).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::sync::Mutex;

use ppd_server::registry::{Role, Source};
use ppd_server::{RouterConfig, RouterHandle};

use crate::ConfigError;

fn parse_config(config_json: &str) -> PyResult<RouterConfig> {
    let cfg =
        RouterConfig::from_json(config_json).map_err(|e| ConfigError::new_err(e.to_string()))?;
    cfg.validate()
        .map_err(|e| ConfigError::new_err(e.to_string()))?;
    Ok(cfg)
}

/// The router. `config_json` holds the settings of `ppd-router serve` (the TOML
/// keys). `serve()` blocks until SIGINT/SIGTERM with the GIL released;
/// `start()` runs it on a background thread until `stop()`.
#[pyclass(module = "ppd_router._core")]
pub struct Router {
    cfg: RouterConfig,
    handle: Mutex<Option<RouterHandle>>,
}

impl Router {
    /// Runs `f` on the started router, or says it is not started.
    fn with_started<R>(&self, f: impl FnOnce(&RouterHandle) -> PyResult<R>) -> PyResult<R> {
        let h = self
            .handle
            .lock()
            .map_err(|_| PyRuntimeError::new_err("router lock poisoned"))?;
        f(h.as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the router is not started"))?)
    }
}

#[pymethods]
impl Router {
    #[new]
    fn new(config_json: &str) -> PyResult<Self> {
        Ok(Router {
            cfg: parse_config(config_json)?,
            handle: Mutex::new(None),
        })
    }

    /// Runs in the foreground until SIGINT or SIGTERM.
    fn serve(&self, py: Python<'_>) -> PyResult<()> {
        let cfg = self.cfg.clone();
        py.detach(|| ppd_server::serve_blocking(cfg))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Starts on a background thread; returns the URL once it accepts connections.
    fn start(&self, py: Python<'_>) -> PyResult<String> {
        let mut h = self
            .handle
            .lock()
            .map_err(|_| PyRuntimeError::new_err("router lock poisoned"))?;
        if let Some(h) = h.as_ref() {
            return Ok(h.url());
        }
        let cfg = self.cfg.clone();
        let handle = py
            .detach(|| RouterHandle::start(cfg))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let url = handle.url();
        *h = Some(handle);
        Ok(url)
    }

    /// Stops a started router (open streams finish first).
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self
            .handle
            .lock()
            .map_err(|_| PyRuntimeError::new_err("router lock poisoned"))?
            .take();
        if let Some(mut h) = taken {
            py.detach(|| h.stop())
                .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        }
        Ok(())
    }

    #[getter]
    fn url(&self) -> PyResult<Option<String>> {
        Ok(self
            .handle
            .lock()
            .map_err(|_| PyRuntimeError::new_err("router lock poisoned"))?
            .as_ref()
            .map(RouterHandle::url))
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
        let role = Role::parse(role).ok_or_else(|| {
            PyValueError::new_err(format!("role {role:?}: expected P, D, pD or R"))
        })?;
        let source = match source {
            "zmq" => Source::Zmq,
            "admin" => Source::Admin,
            other => {
                return Err(PyValueError::new_err(format!(
                    "source {other:?}: expected zmq or admin"
                )))
            }
        };
        let spec = ppd_server::config::parse_node("url", url)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.with_started(|h| {
            let now = h.state.now_ms();
            Ok(h.state
                .registry
                .upsert(&spec.url, role, zmq_address.or(spec.zmq), source, now)
                .1)
        })
    }

    /// Removes a node; returns how many entries went.
    fn deregister_node(&self, url: &str) -> PyResult<usize> {
        self.with_started(|h| Ok(h.state.registry.remove(url.trim_end_matches('/')).len()))
    }

    /// Nodes as JSON (what `GET /admin/nodes` returns).
    fn nodes_json(&self) -> PyResult<String> {
        self.with_started(|h| Ok(ppd_server::admin::node_list(&h.state).to_string()))
    }
}

/// The normalized configuration (defaults filled in) as JSON, or ConfigError naming the bad field.
#[pyfunction]
fn validate_router_config(config_json: &str) -> PyResult<String> {
    let cfg = parse_config(config_json)?;
    serde_json::to_string(&cfg).map_err(|e| PyValueError::new_err(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Router>()?;
    m.add_function(wrap_pyfunction!(validate_router_config, m)?)?;
    Ok(())
}

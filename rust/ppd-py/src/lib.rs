//! `ppd_router._core`: thin pyo3 wrappers over ppd-core; every core error becomes a Python exception.

mod catalog;
mod emulator;
mod errors;
mod router;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use ppd_core::identity::{self, CtxSource, OutSource};
use ppd_core::session::{NodeId, Session, SessionConfig, TurnRecord};
use ppd_core::tokens::{TokenCounter as CoreCounter, WordRule};
use ppd_core::{DecisionInput, Path, PolicyKind, Residency, Weights};

use errors::{err, invalid, Kind};

fn to_py(e: ppd_core::Error) -> PyErr {
    errors::from_core(e)
}

fn now_ms(now: Option<f64>) -> PyResult<u64> {
    match now {
        Some(t) if t.is_finite() && t >= 0.0 => Ok((t * 1000.0) as u64),
        Some(t) => Err(invalid(format!(
            "now must be a finite time ≥ 0 in seconds, got {t}"
        ))),
        None => Ok(SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)),
    }
}

fn count_arg(name: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| {
        invalid(format!(
            "{name} must be an integer in [0, 4294967295], got {v}"
        ))
    })
}

/// Text of a body argument given as str or bytes.
fn body_text(body: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = body.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    if let Ok(b) = body.cast::<PyBytes>() {
        return String::from_utf8(b.as_bytes().to_vec())
            .map_err(|e| err(Kind::BadRequest, format!("body is not UTF-8: {e}")));
    }
    Err(invalid("body must be str or bytes (a JSON document)"))
}

/// Counts tokens: the emulator's word rule (default) or a real tokenizer.json.
#[pyclass(frozen, module = "ppd_router._core")]
#[derive(Clone)]
struct TokenCounter {
    inner: Arc<dyn CoreCounter>,
}

#[pymethods]
impl TokenCounter {
    /// The word rule shared with the emulator (exact against it).
    #[staticmethod]
    fn word_rule() -> Self {
        TokenCounter {
            inner: Arc::new(WordRule),
        }
    }

    /// Exact counts from a Hugging Face `tokenizer.json`.
    #[staticmethod]
    fn from_tokenizer_json(path: &str) -> PyResult<Self> {
        let t = ppd_core::tokens::HfTokenizer::from_file(path).map_err(to_py)?;
        Ok(TokenCounter { inner: Arc::new(t) })
    }

    fn count(&self, py: Python<'_>, text: &str) -> u32 {
        let inner = Arc::clone(&self.inner);
        py.detach(|| inner.count(text))
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    fn __repr__(&self) -> String {
        format!("TokenCounter({})", self.inner.name())
    }
}

/// Tokens of `text` under the word rule.
#[pyfunction]
fn count_tokens(text: &str) -> u32 {
    ppd_core::tokens::word_rule_count(text)
}

/// A `ppd-table/1` lookup table of measured x=0 / x=1 cells.
#[pyclass(frozen, module = "ppd_router._core")]
#[derive(Clone)]
struct Table {
    inner: Arc<ppd_core::Table>,
}

fn json_to_py(py: Python<'_>, text: &str) -> PyResult<Py<PyAny>> {
    let json = py.import("json")?;
    Ok(json.call_method1("loads", (text,))?.unbind())
}

fn describe_point(
    py: Python<'_>,
    t: &ppd_core::Table,
    p: ppd_core::grid::GridPoint,
) -> PyResult<Py<PyDict>> {
    let (c, w, q) = t.describe(p);
    let d = PyDict::new(py);
    d.set_item("context", c)?;
    d.set_item("workload", w)?;
    d.set_item("qps", q)?;
    Ok(d.unbind())
}

fn scored_dict(py: Python<'_>, t: &ppd_core::Table, s: &ppd_core::Scored) -> PyResult<Py<PyDict>> {
    let cell = describe_point(py, t, s.cell_at)?;
    let d = cell.bind(py);
    d.set_item("distance", s.distance)?;
    d.set_item("requested", describe_point(py, t, s.point)?)?;
    d.set_item("d_ttft", s.d_ttft)?;
    d.set_item("d_tpot", s.d_tpot)?;
    Ok(cell)
}

#[pymethods]
impl Table {
    /// Loads and validates a table file; errors name the file, the cell and the field.
    #[staticmethod]
    fn load(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| err(Kind::Table, format!("table {name}: cannot read: {e}")))?;
        py.detach(|| ppd_core::Table::from_json(&text, &name))
            .map(|t| Table { inner: Arc::new(t) })
            .map_err(|e| err(Kind::Table, e.to_string()))
    }

    /// Loads `builtin:NAME` (a shipped table) or a file path.
    #[staticmethod]
    fn from_spec(py: Python<'_>, spec: &str) -> PyResult<Self> {
        py.detach(|| ppd_core::builtin::load_table(spec))
            .map(|t| Table { inner: Arc::new(t) })
            .map_err(|e| err(Kind::Table, e.to_string()))
    }

    #[staticmethod]
    #[pyo3(signature = (text, name = "<string>"))]
    fn from_json(text: &str, name: &str) -> PyResult<Self> {
        ppd_core::Table::from_json(text, name)
            .map(|t| Table { inner: Arc::new(t) })
            .map_err(|e| err(Kind::Table, e.to_string()))
    }

    fn to_json(&self) -> String {
        self.inner.to_json_pretty()
    }

    fn save(&self, path: std::path::PathBuf) -> PyResult<()> {
        std::fs::write(&path, self.inner.to_json_pretty() + "\n")
            .map_err(|e| err(Kind::Io, format!("{}: {e}", path.display())))
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }
    #[getter]
    fn deployment(&self) -> String {
        self.inner.doc().deployment.clone()
    }
    #[getter]
    fn model(&self) -> String {
        self.inner.doc().model.clone()
    }
    #[getter]
    fn hardware(&self) -> String {
        self.inner.doc().hardware.clone()
    }
    #[getter]
    fn source(&self) -> String {
        self.inner.doc().source.clone()
    }
    #[getter]
    fn default_n_out(&self) -> u32 {
        self.inner.default_n_out()
    }
    #[getter]
    fn context_classes(&self) -> Vec<String> {
        self.inner.grid().context_names().to_vec()
    }
    #[getter]
    fn context_bins(&self) -> Vec<u32> {
        self.inner.grid().context_bins().to_vec()
    }
    /// Workload types as (name, n_in, n_out).
    #[getter]
    fn workloads(&self) -> Vec<(String, u32, u32)> {
        self.inner
            .grid()
            .workloads()
            .iter()
            .map(|w| (w.name.clone(), w.n_in, w.n_out))
            .collect()
    }
    #[getter]
    fn qps_levels(&self) -> Vec<f64> {
        self.inner.grid().qps_levels().to_vec()
    }
    /// The cells as stored (list of dicts).
    #[getter]
    fn cells(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let text =
            serde_json::to_string(&self.inner.doc().cells).map_err(|e| invalid(e.to_string()))?;
        json_to_py(py, &text)
    }

    /// A context length typical of a class (for showing the grid).
    fn representative_context(&self, class_index: usize) -> PyResult<u32> {
        if class_index >= self.inner.grid().context_names().len() {
            return Err(invalid(format!("no context class {class_index}")));
        }
        Ok(self.inner.grid().representative_context(class_index))
    }

    /// The cell answering for these features: dict with context, workload, qps,
    /// distance (0 unless it fell back), requested (the discretized point), x0, x1.
    fn lookup(
        &self,
        py: Python<'_>,
        n_ctx: i64,
        n_in: i64,
        n_out: i64,
        qps: f64,
    ) -> PyResult<Py<PyDict>> {
        if !qps.is_finite() || qps < 0.0 {
            return Err(invalid(format!(
                "qps must be a finite number ≥ 0, got {qps}"
            )));
        }
        let (p, r) = self.inner.lookup(
            count_arg("n_ctx", n_ctx)?,
            count_arg("n_in", n_in)?,
            count_arg("n_out", n_out)?,
            qps,
        );
        let d = describe_point(py, &self.inner, r.at)?;
        let b = d.bind(py);
        b.set_item("distance", r.distance)?;
        b.set_item("requested", describe_point(py, &self.inner, p)?)?;
        if let Some(c) = self.inner.cell(r.cell) {
            for (key, m) in [("x0", c.x0), ("x1", c.x1)] {
                let md = PyDict::new(py);
                md.set_item("ttft_ms", m.ttft_ms)?;
                md.set_item("tpot_ms", m.tpot_ms)?;
                md.set_item("n", m.n)?;
                b.set_item(key, md)?;
            }
        }
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.inner.doc().cells.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Table({:?}, deployment={:?}, cells={})",
            self.inner.name(),
            self.inner.doc().deployment,
            self.inner.doc().cells.len()
        )
    }
}

/// The outcome of a decision.
#[pyclass(frozen, module = "ppd_router._core")]
struct Route {
    #[pyo3(get)]
    path: &'static str,
    #[pyo3(get)]
    reason: &'static str,
    #[pyo3(get)]
    score: Option<f64>,
    #[pyo3(get)]
    cell: Option<Py<PyDict>>,
    /// The cost model's predictions per path (`ppd-live` with a live view), as JSON.
    forecast: Option<String>,
}

#[pymethods]
impl Route {
    fn to_dict(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        d.set_item("path", self.path)?;
        d.set_item("reason", self.reason)?;
        d.set_item("score", self.score)?;
        d.set_item("cell", self.cell.as_ref().map(|c| c.clone_ref(py)))?;
        d.set_item("forecast", self.forecast(py)?)?;
        Ok(d.unbind())
    }
    /// Per path (`pd`, `local`, `pull`): predicted `ttft_ms`, the
    /// `tpot_added_ms` its prefill adds to each of the `corunners` decoding
    /// on D, D's `base_tpot_ms`, and the `tpot_burden` Equation 1 weighs.
    #[getter]
    fn forecast(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(f) = &self.forecast else {
            return Ok(None);
        };
        let json = py.import("json")?;
        Ok(Some(json.call_method1("loads", (f.as_str(),))?.unbind()))
    }
    fn __repr__(&self) -> String {
        format!(
            "Route(path={:?}, reason={:?}, score={:?})",
            self.path, self.reason, self.score
        )
    }
}

fn forecast_json(f: ppd_core::Forecast) -> String {
    let path = |c: ppd_core::PathCost| {
        serde_json::json!({
            "ttft_ms": c.ttft_ms,
            "tpot_added_ms": c.tpot_added_ms,
            "corunners": c.corunners,
            "base_tpot_ms": c.base_tpot_ms,
            "tpot_burden": c.tpot_burden(),
        })
    };
    serde_json::json!({"pd": path(f.pd), "local": path(f.local), "pull": path(f.pull)}).to_string()
}

/// The decision engine of Algorithm 1: a table, weights and a policy.
#[pyclass(frozen, module = "ppd_router._core")]
struct DecisionEngine {
    inner: Arc<ppd_core::DecisionEngine>,
}

#[pymethods]
impl DecisionEngine {
    #[new]
    #[pyo3(signature = (table, policy = "ppd", w_ttft = 1.0, w_tpot = 1.0, *, profile = "default", slo_ttft_ms = None, slo_tpot_ms = None))]
    fn new(
        table: &Table,
        policy: &str,
        w_ttft: f64,
        w_tpot: f64,
        profile: &str,
        slo_ttft_ms: Option<f64>,
        slo_tpot_ms: Option<f64>,
    ) -> PyResult<Self> {
        let kind = PolicyKind::parse(policy).map_err(to_py)?;
        let w = Weights::new(w_ttft, w_tpot).map_err(to_py)?;
        let engine = ppd_core::DecisionEngine::new((*table.inner).clone(), kind, w);
        let profile = ppd_core::profiles::load_profile(profile).map_err(to_py)?;
        engine.set_cost_model(Arc::new(ppd_core::CostModel::new(profile)));
        let slo = match (slo_ttft_ms, slo_tpot_ms) {
            (None, None) => None,
            (Some(ttft_ms), Some(tpot_ms)) if ttft_ms > 0.0 && tpot_ms > 0.0 => {
                Some(ppd_core::Slo { ttft_ms, tpot_ms })
            }
            _ => {
                return Err(invalid(
                    "SLO mode needs both slo_ttft_ms and slo_tpot_ms, each > 0",
                ))
            }
        };
        engine.set_slo(slo);
        Ok(DecisionEngine {
            inner: Arc::new(engine),
        })
    }

    /// Routes one request. Turn 1 takes pd; Turn 2+ follows the policy unless
    /// the session is unknown, its D unavailable, or (for local) overloaded,
    /// its KV lost (`kv_lost`) or mostly not cached (`cached_tokens`), or
    /// the request's history not the one the last turn ended with
    /// (`prefix_mismatch`); pull needs D's pin named (`pull_ready`).
    #[pyo3(signature = (turn, n_in, n_out, n_ctx, qps, *, conversation_id = None, has_session = true, d_available = true, d_overloaded = false, d_local_capable = true, replica_share = 0.0, session_on_replica = false, kv_lost = false, cached_tokens = None, prefix_mismatch = false, pull_ready = false, live = None))]
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        py: Python<'_>,
        turn: i64,
        n_in: i64,
        n_out: i64,
        n_ctx: i64,
        qps: f64,
        conversation_id: Option<&str>,
        has_session: bool,
        d_available: bool,
        d_overloaded: bool,
        d_local_capable: bool,
        replica_share: f64,
        session_on_replica: bool,
        kv_lost: bool,
        cached_tokens: Option<i64>,
        prefix_mismatch: bool,
        pull_ready: bool,
        live: Option<&str>,
    ) -> PyResult<Route> {
        let live: Option<ppd_core::LiveView> = live
            .map(|j| serde_json::from_str(j).map_err(|e| invalid(format!("live: {e}"))))
            .transpose()?;
        let residency = match (kv_lost, cached_tokens) {
            (true, _) => Residency::Lost,
            (false, Some(t)) => Residency::Cached(count_arg("cached_tokens", t)?),
            (false, None) => Residency::Unknown,
        };
        let input = DecisionInput {
            turn: count_arg("turn", turn)?,
            n_in: count_arg("n_in", n_in)?,
            n_out: count_arg("n_out", n_out)?,
            n_ctx: count_arg("n_ctx", n_ctx)?,
            qps,
            conv_hash: conversation_id.map(identity::hash_id).unwrap_or(0),
            has_session,
            d_available,
            d_overloaded,
            residency,
            prefix_ok: !prefix_mismatch,
            d_local_capable,
            replica_share,
            session_on_replica,
            pull_ready,
            live,
        };
        let route = self.inner.decide(&input).map_err(to_py)?;
        let table = self.inner.table();
        let cell = route
            .scored
            .as_ref()
            .map(|s| scored_dict(py, &table, s))
            .transpose()?;
        Ok(Route {
            path: route.path.as_str(),
            reason: route.reason.as_str(),
            score: route.scored.map(|s| s.score),
            cell,
            forecast: route.forecast.map(forecast_json),
        })
    }

    /// New weights take effect on the next decision.
    fn set_weights(&self, w_ttft: f64, w_tpot: f64) -> PyResult<()> {
        self.inner
            .set_weights(Weights::new(w_ttft, w_tpot).map_err(to_py)?);
        Ok(())
    }

    fn set_table(&self, table: &Table) {
        self.inner.set_table((*table.inner).clone());
    }

    fn set_policy(&self, policy: &str) -> PyResult<()> {
        self.inner
            .set_policy(PolicyKind::parse(policy).map_err(to_py)?);
        Ok(())
    }

    #[getter]
    fn weights(&self) -> (f64, f64) {
        let w = self.inner.weights();
        (w.w_ttft, w.w_tpot)
    }

    #[getter]
    fn policy(&self) -> String {
        self.inner.policy().to_string()
    }

    #[getter]
    fn table(&self) -> Table {
        Table {
            inner: self.inner.table(),
        }
    }
}

/// Node names ↔ ids for the Python session table (ids are never reused).
#[derive(Default)]
struct Names {
    ids: HashMap<String, NodeId>,
    names: Vec<String>,
}

impl Names {
    fn id(&mut self, name: &str) -> PyResult<NodeId> {
        if let Some(&id) = self.ids.get(name) {
            return Ok(id);
        }
        let id = u32::try_from(self.names.len() + 1)
            .ok()
            .and_then(NodeId::new)
            .ok_or_else(|| invalid("too many node names"))?;
        self.names.push(name.to_owned());
        self.ids.insert(name.to_owned(), id);
        Ok(id)
    }
    fn name(&self, id: Option<NodeId>) -> Option<String> {
        id.and_then(|i| self.names.get(i.get() as usize - 1).cloned())
    }
}

/// The router's session table: conversation id → assigned P and D, context, output mean.
#[pyclass(frozen, module = "ppd_router._core")]
struct SessionTable {
    inner: Arc<ppd_core::session::SessionTable>,
    names: Mutex<Names>,
}

impl SessionTable {
    /// The session in the one JSON shape of ppd-core ([`Session::view`]), as a dict.
    fn session_dict(&self, py: Python<'_>, id: &str, s: &Session) -> PyResult<Py<PyAny>> {
        let text = {
            let names = self
                .names
                .lock()
                .map_err(|_| errors::run("session names lock poisoned"))?;
            serde_json::to_string(&s.view(id, |n| names.name(Some(n))))
                .map_err(|e| errors::run(e.to_string()))?
        };
        // Not under the lock: Python code may hand the GIL to a thread that
        // is waiting for the lock while holding the GIL (a deadlock, seen in
        // tests/core/test_sessions.py's concurrent record_turn).
        json_to_py(py, &text)
    }
}

#[pymethods]
impl SessionTable {
    #[new]
    #[pyo3(signature = (ttl_s = 3600.0, capacity = 1_000_000, shards = 64, max_bytes = 268_435_456))]
    fn new(ttl_s: f64, capacity: usize, shards: usize, max_bytes: usize) -> PyResult<Self> {
        if !ttl_s.is_finite() || ttl_s <= 0.0 {
            return Err(errors::config(format!(
                "ttl_s must be a positive number of seconds, got {ttl_s}"
            )));
        }
        let cfg = SessionConfig {
            ttl_ms: (ttl_s * 1000.0).max(1.0) as u64,
            capacity,
            shards,
            max_bytes,
        };
        let inner = ppd_core::session::SessionTable::new(cfg).map_err(to_py)?;
        Ok(SessionTable {
            inner: Arc::new(inner),
            names: Mutex::new(Names::default()),
        })
    }

    /// The session (dict) or None; refreshes it as recently used.
    #[pyo3(signature = (conversation_id, now = None))]
    fn get(
        &self,
        py: Python<'_>,
        conversation_id: &str,
        now: Option<f64>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let t = now_ms(now)?;
        self.inner
            .get(conversation_id, t)
            .map(|s| self.session_dict(py, conversation_id, &s))
            .transpose()
    }

    /// Records a finished turn: which P (if any) and D served it, and its usage.
    #[pyo3(signature = (conversation_id, *, turn, d, p = None, prompt_tokens = None, completion_tokens = None, now = None))]
    #[allow(clippy::too_many_arguments)]
    fn record_turn(
        &self,
        py: Python<'_>,
        conversation_id: &str,
        turn: i64,
        d: &str,
        p: Option<&str>,
        prompt_tokens: Option<i64>,
        completion_tokens: Option<i64>,
        now: Option<f64>,
    ) -> PyResult<Py<PyAny>> {
        let t = now_ms(now)?;
        let turn = count_arg("turn", turn)?;
        let usage = match (prompt_tokens, completion_tokens) {
            (Some(a), Some(b)) => Some((
                count_arg("prompt_tokens", a)?,
                count_arg("completion_tokens", b)?,
            )),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "give both prompt_tokens and completion_tokens, or neither",
                ))
            }
        };
        let (d_id, p_id) = {
            let mut names = self
                .names
                .lock()
                .map_err(|_| errors::run("session names lock poisoned"))?;
            (names.id(d)?, p.map(|p| names.id(p)).transpose()?)
        };
        let record = TurnRecord {
            turn,
            p: p_id,
            d: d_id,
            d_epoch: 0,
            usage,
            expected: Default::default(),
        };
        let (s, _) = self.inner.record_turn(conversation_id, t, &record);
        self.session_dict(py, conversation_id, &s)
    }

    /// Moves sessions off a departed node; returns how many changed.
    #[pyo3(signature = (node, to = None))]
    fn reassign(&self, node: &str, to: Option<&str>) -> PyResult<usize> {
        let mut names = self
            .names
            .lock()
            .map_err(|_| errors::run("session names lock poisoned"))?;
        let from = names.id(node)?;
        let to = to.map(|t| names.id(t)).transpose()?;
        drop(names);
        Ok(self.inner.reassign(from, to))
    }

    #[pyo3(signature = (now = None))]
    fn evict_expired(&self, now: Option<f64>) -> PyResult<usize> {
        Ok(self.inner.evict_expired(now_ms(now)?))
    }

    fn remove(&self, conversation_id: &str) -> bool {
        self.inner.remove(conversation_id).is_some()
    }

    /// A page of (conversation_id, session) pairs.
    #[pyo3(signature = (offset = 0, limit = 100))]
    fn page(&self, py: Python<'_>, offset: usize, limit: usize) -> PyResult<Py<PyList>> {
        let items = self.inner.page(offset, limit);
        let out = PyList::empty(py);
        for (k, s) in items {
            let d = self.session_dict(py, &k, &s)?;
            out.append((k, d))?;
        }
        Ok(out.unbind())
    }

    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let text = serde_json::to_string(&self.inner.stats()).map_err(errors::run)?;
        json_to_py(py, &text)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// Conversation identity and features of a request body (str or bytes of JSON).
/// With `sessions`, a known session gives the exact context and the output mean.
/// `session_header` is an `X-Session-ID` value; `session_from_user` lets the
/// body's `user` field name the conversation, as the router's option does.
#[pyfunction]
#[pyo3(signature = (body, session_header = None, *, counter = None, sessions = None, default_n_out = 128, session_from_user = false))]
fn identify(
    py: Python<'_>,
    body: &Bound<'_, PyAny>,
    session_header: Option<&str>,
    counter: Option<&TokenCounter>,
    sessions: Option<&SessionTable>,
    default_n_out: u32,
    session_from_user: bool,
) -> PyResult<Py<PyDict>> {
    let text = body_text(body)?;
    let counter: Arc<dyn CoreCounter> = counter
        .map(|c| Arc::clone(&c.inner))
        .unwrap_or_else(|| Arc::new(WordRule));
    let view = ppd_core::request::parse_request(&text).map_err(to_py)?;
    let hints = identity::IdHints {
        from_user: session_from_user,
        ..identity::IdHints::session_header(session_header)
    };
    let id = identity::conversation_id(hints, &view).map_err(to_py)?;
    let session = sessions.and_then(|s| s.inner.peek(&id.id));
    let f = identity::features(&view, counter.as_ref(), session.as_ref(), default_n_out)
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("conversation_id", &id.id)?;
    d.set_item("id_source", id.source.as_str())?;
    d.set_item("turn", f.turn)?;
    d.set_item("n_in", f.n_in)?;
    d.set_item("n_ctx", f.n_ctx)?;
    d.set_item("n_out", f.n_out)?;
    d.set_item(
        "ctx_source",
        match f.ctx_source {
            CtxSource::Estimated => "estimated",
            CtxSource::SessionUsage => "session_usage",
        },
    )?;
    d.set_item(
        "out_source",
        match f.out_source {
            OutSource::Request => "request",
            OutSource::SessionMean => "session_mean",
            OutSource::TableDefault => "table_default",
        },
    )?;
    Ok(d.unbind())
}

/// Sliding-window QPS estimator (thread-safe wrapper).
#[pyclass(frozen, module = "ppd_router._core")]
struct QpsEstimator {
    inner: Mutex<ppd_core::qps::QpsEstimator>,
}

#[pymethods]
impl QpsEstimator {
    #[new]
    #[pyo3(signature = (window_s = 10.0, buckets = 100))]
    fn new(window_s: f64, buckets: usize) -> PyResult<Self> {
        if !window_s.is_finite() || window_s <= 0.0 {
            return Err(errors::config(format!(
                "window_s must be positive, got {window_s}"
            )));
        }
        let inner =
            ppd_core::qps::QpsEstimator::new((window_s * 1000.0) as u64, buckets).map_err(to_py)?;
        Ok(QpsEstimator {
            inner: Mutex::new(inner),
        })
    }
    #[pyo3(signature = (now = None))]
    fn record(&self, now: Option<f64>) -> PyResult<()> {
        let t = now_ms(now)?;
        self.inner
            .lock()
            .map_err(|_| errors::run("lock poisoned"))?
            .record(t);
        Ok(())
    }
    #[pyo3(signature = (now = None))]
    fn rate(&self, now: Option<f64>) -> PyResult<f64> {
        let t = now_ms(now)?;
        Ok(self
            .inner
            .lock()
            .map_err(|_| errors::run("lock poisoned"))?
            .rate(t))
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add(
        "PATHS",
        Path::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
    )?;
    m.add(
        "REASONS",
        ppd_core::Reason::ALL
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>(),
    )?;
    m.add_class::<TokenCounter>()?;
    m.add_class::<Table>()?;
    m.add_class::<Route>()?;
    m.add_class::<DecisionEngine>()?;
    m.add_class::<SessionTable>()?;
    m.add_class::<QpsEstimator>()?;
    m.add_function(wrap_pyfunction!(count_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(identify, m)?)?;
    catalog::register(m)?;
    router::register(m)?;
    emulator::register(m)?;
    Ok(())
}

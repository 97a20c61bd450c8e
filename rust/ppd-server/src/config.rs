//! The router's settings: one schema for the TOML file and the command line, read once in Rust and validated once into [`Settings`].

use serde::{Deserialize, Serialize};
use std::fmt;

use ppd_core::layout::{parse_layout, Role};
use ppd_core::profile::Profile;
use ppd_core::{PolicyKind, Slo, Weights};

use crate::kv_subscriber::Endpoint;

/// How the pd path moves KV from P to D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvProtocol {
    /// Current vLLM NixlConnector: `kv_transfer_params` from P's answer go to D.
    Nixl,
    /// Legacy P2pNccl (vLLM ≤ 0.23, the paper's setup): addresses encoded in `X-Request-Id`.
    P2pNccl,
    /// No KV transfer: the pd path sends the request to D alone, which computes it whole.
    None,
}

/// How the router renders a request into the token ids a node computes, to
/// match them against the node's KV events (exact residency).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptRenderer {
    /// The model's chat template and `tokenizer.json` when `tokenizer` is set, else none.
    Auto,
    /// The emulator's template and word rule (what emulated nodes compute).
    WordRule,
    /// No rendering: residency stays approximate even with KV events.
    None,
}

/// Which `x-ppd-*` headers an answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteHeaders {
    /// `x-ppd-path`, `x-ppd-reason`, `x-ppd-session` (and `x-ppd-node` with
    /// `expose_node_header`).
    All,
    /// Only `x-ppd-path`.
    Path,
    /// None of them.
    None,
}

/// How log lines are written to standard error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

/// How the router's I/O threads serve connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// Each I/O thread runs its own single-threaded runtime, accepts its own
    /// connections and keeps its own upstream connection pool, so a request
    /// never changes thread (no cross-thread wake-ups on the hot path).
    ThreadPerCore,
    /// One tokio multi-thread runtime, which evens out uneven connections at
    /// the price of handing requests between threads.
    WorkStealing,
}

/// Where a conversation without a session here lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// The decoding node with the fewest requests in flight, then sessions:
    /// right for one router, which sees every conversation.
    LeastLoaded,
    /// For one of several router replicas: a new conversation goes where
    /// rendezvous hashing of its key with bounded loads puts it (every
    /// replica computes the same node), and a later turn this replica has
    /// no session for is adopted where the nodes' KV events show its
    /// prompt, else where its key places it.
    Rendezvous,
}

/// Every setting, with the defaults of the CLI. Field names are the TOML keys;
/// the flags are the same names with dashes (`session_ttl` ↔ `--session-ttl`).
/// `Debug` prints it as JSON, as `--print-config` does: secrets as `"<set>"`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    pub host: String,
    pub port: u16,
    /// Prefill nodes (P). A node is `URL` or `URL;zmq=HOST:PORT` (P2pNccl address).
    pub prefill: Vec<String>,
    /// Decode-only nodes (D, x ≡ 0).
    pub decode: Vec<String>,
    /// Prefill-capable decode nodes (pD): may append-prefill Turn 2+ locally.
    pub pd_capable: Vec<String>,
    /// Replicas (R).
    pub replica: Vec<String>,
    /// An emulated cluster of this layout (e.g. `2P2pD`), started by the
    /// caller before the router (`ppd-router serve --emulated`).
    pub emulated: Option<String>,
    /// Emulator profile name or path, for `emulated`.
    pub emulator_profile: Option<String>,
    pub policy: PolicyKind,
    /// Lookup table: a path, or `builtin:h100-1P3pD|h100-2P2pD|h100-3P1pD`.
    pub table: Option<String>,
    /// The engine profile `ppd-live`'s cost model predicts with (built-in
    /// name or TOML path; default: `emulator_profile` for an emulated
    /// cluster, else the built-in H100 profile). Observed latencies correct
    /// it online, per node.
    pub engine_profile: Option<String>,
    /// `ppd-live`'s SLO mode: the TTFT objective, ms (with `slo_tpot_ms`).
    pub slo_ttft_ms: Option<f64>,
    /// `ppd-live`'s SLO mode: the TPOT objective, ms (with `slo_ttft_ms`).
    pub slo_tpot_ms: Option<f64>,
    pub w_ttft: f64,
    pub w_tpot: f64,
    pub kv_protocol: KvProtocol,
    /// Bearer token of the admin API; without it the admin API refuses every
    /// call. Shown as `"<set>"` when printed.
    #[serde(serialize_with = "redacted")]
    pub admin_token: Option<String>,
    /// Bearer token clients must send on `/v1/*` (`Authorization: Bearer
    /// …`); unset: the OpenAI endpoints are open. `/health` and `/metrics`
    /// stay open either way. Shown as `"<set>"` when printed.
    #[serde(serialize_with = "redacted")]
    pub api_key: Option<String>,
    /// A file whose content is `api_key` (one trailing newline stripped);
    /// instead of `api_key`, never both.
    pub api_key_file: Option<String>,
    /// Bearer token sent to every node on every call (completions, health
    /// checks, `/metrics` scrapes, `/v1/models`): the nodes' vLLM `--api-key`.
    /// Shown as `"<set>"` when printed.
    #[serde(serialize_with = "redacted")]
    pub upstream_api_key: Option<String>,
    /// A file whose content is `upstream_api_key`; instead of it, never both.
    pub upstream_api_key_file: Option<String>,
    /// PEM file of CA certificates trusted for `https://` nodes, besides the
    /// public web roots (a private CA or a self-signed node certificate).
    pub upstream_ca_file: Option<String>,
    /// Session idle TTL, seconds.
    pub session_ttl: f64,
    pub session_capacity: usize,
    /// Whole-request limit, seconds.
    pub request_timeout: f64,
    /// Limit for P's prefill answer, seconds.
    pub prefill_timeout: f64,
    pub connect_timeout: f64,
    /// Longest silence inside a stream before it is failed, seconds.
    pub stream_idle_timeout: f64,
    pub max_body_bytes: usize,
    /// Seconds between active health checks.
    pub health_interval: f64,
    /// Seconds without a heartbeat after which a registered node is removed.
    pub heartbeat_timeout: f64,
    /// Consecutive failures that open a node's circuit breaker.
    pub breaker_failures: u32,
    /// Seconds an open breaker keeps the node out.
    pub breaker_open: f64,
    /// In-flight requests at which a pD is overloaded and local is vetoed (0: off).
    pub overload_inflight: u32,
    /// Requests the pD itself reports waiting (`vllm:num_requests_waiting`) at
    /// which local is vetoed (0: off).
    pub overload_waiting: u32,
    /// KV-cache usage the pD reports (`vllm:kv_cache_usage_perc`, 0..1) at
    /// which local is vetoed: an append-prefill there would preempt (0: off).
    pub overload_kv_usage: f64,
    /// The nodes run vLLM's NIXL connector with `bidirectional_kv_xfer`: a D
    /// pins what it computed and names it in whole answers, which makes the
    /// pull path possible; local turns then ask D to pin too.
    pub bidirectional_kv_xfer: bool,
    /// Seconds such a D pins a finished turn's blocks (vLLM's
    /// `decoder_kv_blocks_ttl`, default 480); a handle is not used within
    /// vLLM's 5 s safety margin of it.
    pub decoder_kv_blocks_ttl: f64,
    /// Seconds between scrapes of every node's `/metrics` for its live load
    /// and restarts (0: no scraping).
    pub load_interval: f64,
    /// Window of the QPS estimator, seconds.
    pub qps_window: f64,
    /// Hybrid R + P/D: share of new conversations for replicas (default: R nodes / (R + D nodes)).
    pub replica_share: Option<f64>,
    /// KV bytes per token, for the KV-moved metrics (Llama-3.1-8B BF16: 131072).
    pub kv_bytes_per_token: u64,
    /// A tokenizer.json for exact token counts (default: the word rule).
    pub tokenizer: Option<String>,
    /// How requests become token ids for exact residency (`auto`: the
    /// tokenizer's chat template when `tokenizer` is set).
    pub prompt_renderer: PromptRenderer,
    /// Log filter (tracing `EnvFilter` syntax, e.g. `info` or
    /// `warn,ppd_router::request=info`); unset: `RUST_LOG`, else `warn`.
    pub log: Option<String>,
    /// `text` or `json` (one object per line).
    pub log_format: LogFormat,
    /// Export request spans over OTLP/HTTP (JSON) to this URL, a collector's
    /// `/v1/traces` (the name vLLM gives its own setting); unset: no spans.
    pub otlp_traces_endpoint: Option<String>,
    /// Where admin changes are shared with the other replicas of this router
    /// (`redis://HOST[:PORT][/DB]`, or `rediss://` over TLS; shared.rs);
    /// unset: the environment variable [`STATE_ENV`], else nothing is shared
    /// (one router on its own).
    pub state: Option<String>,
    /// PEM file of the CA certificates that a `rediss://` state store's
    /// certificate must chain to, instead of the public web roots (a private
    /// CA, as in-cluster Redis usually has).
    pub state_ca_file: Option<String>,
    /// The namespace of this router's keys and channel in `state`, so that
    /// two clusters can share one Redis.
    pub state_prefix: String,
    /// Router I/O threads (0: one per core).
    pub worker_threads: usize,
    pub runtime: Runtime,
    /// Where conversations without a session here land.
    pub placement: Placement,

    // --- the request path's failure handling ---
    /// Longest wait for a streamed answer's first token (or a node's error
    /// before it), seconds; past it the node counts as failed and the request
    /// is retried once elsewhere, since nothing reached the client yet.
    pub first_token_timeout: f64,
    /// Send each answer's node address in `x-ppd-node` (internal; off by default).
    pub expose_node_header: bool,
    /// Which `x-ppd-*` headers answers carry: `all`, `path` (only
    /// `x-ppd-path`) or `none`.
    pub route_headers: RouteHeaders,
    /// Let OpenAI's `user` body field name the conversation when no header,
    /// `conversation_id` or `session_id` does (off: `user` names an end
    /// user, who may hold several conversations at once).
    pub session_from_user: bool,
    /// Memory the session table may take, bytes (ids included; LRU beyond it).
    pub session_max_bytes: usize,

    // --- admission ---
    /// Requests each node may have in flight from this router (0: unlimited).
    pub max_inflight_per_node: u32,
    /// Prompt tokens each node may have in flight from this router (0: unlimited).
    pub max_inflight_tokens_per_node: u32,
    /// Requests that may wait for room on their node at once; beyond: 503.
    pub queue_size: usize,
    /// Longest wait for room on a node, seconds; past it: 503.
    pub queue_timeout: f64,
    /// Requests per second the router takes (0: no limit); beyond: 429.
    pub rate_limit: u32,
    /// Requests allowed in a burst above the rate (0: the rate itself).
    pub rate_limit_burst: u32,

    // ---- Client connections and the admin listener (listener.rs, connection.rs, admin.rs) ----
    /// Seconds a connection has to send a complete request head: from accept
    /// for its first request, from the request's first byte for later ones.
    /// Past it the connection is closed (with a 408 when part of a head came).
    pub header_read_timeout: f64,
    /// Seconds a request's body has to arrive completely; past it the answer
    /// is a 408 and the connection is closed.
    pub body_read_timeout: f64,
    /// Seconds a kept-alive connection may stay idle between requests.
    pub keep_alive_timeout: f64,
    /// Open client connections at most, over all I/O threads (at least 1).
    /// One more is answered 503 with `Retry-After` and closed. The admin
    /// listener has its own, smaller budget.
    pub max_connections: usize,
    /// Serve `/admin/*` and `/metrics` on this port only; the main port
    /// answers them 404.
    pub admin_port: Option<u16>,
    /// Address of the admin listener (default: `host`); needs `admin_port`.
    pub admin_host: Option<String>,
    /// A file whose content is the admin bearer token (one trailing newline
    /// stripped, nothing else); instead of `admin_token`, never both.
    pub admin_token_file: Option<String>,
    /// The admin token in force, resolved once by [`RouterConfig::validate`]:
    /// `admin_token`, else the content of `admin_token_file`, else the
    /// environment variable [`ADMIN_TOKEN_ENV`]. Never serialized, never printed.
    #[serde(skip)]
    pub admin_secret: AdminSecret,
    /// The client API key in force: `api_key`, else `api_key_file`'s content,
    /// else [`API_KEY_ENV`]. Never serialized, never printed.
    #[serde(skip)]
    pub client_secret: Secret,
    /// The upstream API key in force: `upstream_api_key`, else
    /// `upstream_api_key_file`'s content, else [`UPSTREAM_API_KEY_ENV`].
    /// Never serialized, never printed.
    #[serde(skip)]
    pub upstream_secret: Secret,
    /// The state store in force, resolved once by [`RouterConfig::validate`]:
    /// `state`, else [`STATE_ENV`]. Never serialized (a URL may hold a password).
    #[serde(skip)]
    pub state_url: Option<String>,
}

impl fmt::Debug for RouterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match serde_json::to_string(self) {
            Ok(json) => write!(f, "RouterConfig {json}"),
            Err(e) => write!(f, "RouterConfig <unprintable: {e}>"),
        }
    }
}

/// A secret setting as printed: `"<set>"` or null, never its value.
fn redacted<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(_) => s.serialize_str("<set>"),
        None => s.serialize_none(),
    }
}

/// The environment variable read for the client API key when neither
/// `api_key` nor `api_key_file` is set.
pub const API_KEY_ENV: &str = "PPD_API_KEY";

/// The environment variable read for the upstream API key when neither
/// `upstream_api_key` nor `upstream_api_key_file` is set.
pub const UPSTREAM_API_KEY_ENV: &str = "PPD_UPSTREAM_API_KEY";

/// The environment variable read for the admin token when neither
/// `admin_token` nor `admin_token_file` is set.
pub const ADMIN_TOKEN_ENV: &str = "PPD_ADMIN_TOKEN";

/// The environment variable read for the state store when `state` is not
/// set (a Redis URL with a password stays off the command line).
pub const STATE_ENV: &str = "PPD_STATE";

/// A bearer token in force (admin, client or upstream); its `Debug` never shows it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(Option<String>);

/// The admin token in force.
pub type AdminSecret = Secret;

impl Secret {
    pub fn get(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl fmt::Debug for AdminSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Secret(set)"
        } else {
            "Secret(none)"
        })
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            prefill: vec![],
            decode: vec![],
            pd_capable: vec![],
            replica: vec![],
            emulated: None,
            emulator_profile: None,
            engine_profile: None,
            slo_ttft_ms: None,
            slo_tpot_ms: None,
            policy: PolicyKind::Ppd,
            table: None,
            w_ttft: 1.0,
            w_tpot: 1.0,
            kv_protocol: KvProtocol::Nixl,
            admin_token: None,
            session_ttl: 3600.0,
            session_capacity: 1_000_000,
            request_timeout: 600.0,
            prefill_timeout: 120.0,
            connect_timeout: 5.0,
            stream_idle_timeout: 60.0,
            max_body_bytes: 16 * 1024 * 1024,
            health_interval: 5.0,
            heartbeat_timeout: 30.0,
            breaker_failures: 3,
            breaker_open: 10.0,
            overload_inflight: 0,
            overload_waiting: 0,
            overload_kv_usage: 0.95,
            bidirectional_kv_xfer: false,
            decoder_kv_blocks_ttl: 480.0,
            load_interval: 1.0,
            qps_window: 10.0,
            replica_share: None,
            kv_bytes_per_token: 131_072,
            tokenizer: None,
            prompt_renderer: PromptRenderer::Auto,
            log: None,
            log_format: LogFormat::Text,
            otlp_traces_endpoint: None,
            state: None,
            state_prefix: "ppd".into(),
            state_ca_file: None,
            state_url: None,
            worker_threads: 0,
            runtime: Runtime::ThreadPerCore,
            placement: Placement::LeastLoaded,
            first_token_timeout: 60.0,
            expose_node_header: false,
            route_headers: RouteHeaders::All,
            session_from_user: false,
            session_max_bytes: 256 * 1024 * 1024,
            max_inflight_per_node: 256,
            max_inflight_tokens_per_node: 0,
            queue_size: 1024,
            queue_timeout: 30.0,
            rate_limit: 0,
            rate_limit_burst: 0,

            header_read_timeout: 10.0,
            body_read_timeout: 30.0,
            keep_alive_timeout: 75.0,
            max_connections: 4096,
            admin_port: None,
            admin_host: None,
            admin_token_file: None,
            admin_secret: AdminSecret::default(),
            api_key: None,
            api_key_file: None,
            upstream_api_key: None,
            upstream_api_key_file: None,
            upstream_ca_file: None,
            client_secret: Secret::default(),
            upstream_secret: Secret::default(),
        }
    }
}

/// The setting that lists the static nodes of a role.
pub fn node_setting(role: Role) -> &'static str {
    match role {
        Role::P => "prefill",
        Role::D => "decode",
        Role::PD => "pd_capable",
        Role::R => "replica",
    }
}

/// A rejected setting, by field name, and where it came from when that is a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
    /// `router.toml line 3`, for a value read from a file.
    pub origin: Option<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(o) = &self.origin {
            write!(f, "{o}: ")?;
        }
        write!(f, "invalid setting `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn bad(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
        origin: None,
    }
}

/// The field a deserialization error is about: the path serde reached, or,
/// for an unknown key at the top, the key the message names.
fn field_of(path: &serde_path_to_error::Path, message: &str) -> String {
    let p = path.to_string();
    if p != "." && !p.is_empty() {
        // `prefill[1]` is about `prefill`.
        return p.split(['.', '[']).next().unwrap_or(&p).to_owned();
    }
    message
        .split('`')
        .nth(1)
        .map_or_else(|| "config".into(), str::to_owned)
}

/// 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// A node given on the command line or in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub url: String,
    pub zmq: Option<String>,
    /// Where the router hears the node's KV events.
    pub kv_events: Option<Endpoint>,
}

/// Parses `URL` with options `;zmq=HOST:PORT` (P2pNccl address),
/// `;kv_events=tcp://HOST:PORT` (vLLM's `--kv-events-config` endpoint, which
/// the router binds and the node connects to) or `;kv_events_from=tcp://HOST:PORT`
/// (the node binds, e.g. vLLM given `tcp://*:PORT`, and the router connects,
/// as every replica may); the URL must be http(s) with a host.
pub fn parse_node(field: &str, s: &str) -> Result<NodeSpec, ConfigError> {
    let mut parts = s.split(';');
    let url = parts
        .next()
        .unwrap_or_default()
        .trim()
        .trim_end_matches('/');
    let mut zmq = None;
    let mut kv_events = None;
    for p in parts {
        match p.trim().split_once('=') {
            Some(("zmq", v)) if !v.trim().is_empty() => zmq = Some(v.trim().to_owned()),
            Some(("kv_events", v)) if v.trim().starts_with("tcp://") => {
                kv_events = Some(Endpoint::bind(v.trim()))
            }
            Some(("kv_events_from", v)) if v.trim().starts_with("tcp://") => {
                kv_events = Some(Endpoint::connect(v.trim()))
            }
            _ => {
                return Err(bad(
                    field,
                    format!(
                        "{s:?}: unknown node option {p:?} (expected zmq=HOST:PORT, kv_events=tcp://HOST:PORT or kv_events_from=tcp://HOST:PORT)"
                    ),
                ))
            }
        }
    }
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| {
            bad(
                field,
                format!("{s:?}: node URL must start with http:// or https://"),
            )
        })?;
    if rest.is_empty() || rest.starts_with(':') || rest.contains(char::is_whitespace) {
        return Err(bad(field, format!("{s:?}: node URL has no host")));
    }
    // What the HTTP client will be given: a URL it cannot use is refused now,
    // not at the first request.
    match url::Url::parse(url) {
        Err(e) => {
            return Err(bad(
                field,
                format!("{s:?}: not a URL the router can use: {e}"),
            ))
        }
        Ok(u) if u.query().is_some() || u.fragment().is_some() => {
            return Err(bad(
                field,
                format!("{s:?}: a node URL has no query or fragment"),
            ))
        }
        Ok(u) if u.host_str().is_none_or(str::is_empty) => {
            return Err(bad(field, format!("{s:?}: node URL has no host")))
        }
        Ok(_) => {}
    }
    Ok(NodeSpec {
        url: url.to_owned(),
        zmq,
        kv_events,
    })
}

fn positive(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(
            field,
            format!("must be a positive number of seconds, got {v}"),
        ))
    }
}

impl RouterConfig {
    /// The node URLs given for a role (the list [`node_setting`] names).
    pub fn nodes_of(&self, role: Role) -> &[String] {
        match role {
            Role::P => &self.prefill,
            Role::D => &self.decode,
            Role::PD => &self.pd_capable,
            Role::R => &self.replica,
        }
    }

    fn nodes_of_mut(&mut self, role: Role) -> &mut Vec<String> {
        match role {
            Role::P => &mut self.prefill,
            Role::D => &mut self.decode,
            Role::PD => &mut self.pd_capable,
            Role::R => &mut self.replica,
        }
    }

    /// Reads a TOML document; an unknown key or a wrong type names the field
    /// and its line in `origin` (the file's name).
    pub fn from_toml(text: &str, origin: &str) -> Result<RouterConfig, ConfigError> {
        let locate = |span: Option<std::ops::Range<usize>>| match span {
            Some(s) => format!("{origin} line {}", line_of(text, s.start)),
            None => origin.to_owned(),
        };
        let de = toml::de::Deserializer::parse(text).map_err(|e| ConfigError {
            field: "config".into(),
            message: e.message().to_owned(),
            origin: Some(locate(e.span())),
        })?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let message = e.inner().message().to_owned();
            ConfigError {
                field: field_of(e.path(), &message),
                origin: Some(locate(e.inner().span())),
                message,
            }
        })
    }

    /// Reads a TOML file (see [`RouterConfig::from_toml`]).
    pub fn from_toml_file(path: &std::path::Path) -> Result<RouterConfig, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            field: "config".into(),
            message: format!("cannot read {name}: {e}"),
            origin: None,
        })?;
        RouterConfig::from_toml(&text, &name)
    }

    /// This configuration with `overrides` (a JSON object of TOML keys, the
    /// command line's flags) replacing its values.
    pub fn with_overrides(self, overrides: &str) -> Result<RouterConfig, ConfigError> {
        let top = |e: serde_json::Error| bad("config", e.to_string());
        let extra: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(overrides).map_err(top)?;
        if extra.is_empty() {
            return Ok(self);
        }
        let mut all = match serde_json::to_value(&self).map_err(top)? {
            serde_json::Value::Object(m) => m,
            _ => return Err(bad("config", "settings are not a table")),
        };
        all.extend(extra);
        serde_path_to_error::deserialize(serde_json::Value::Object(all)).map_err(|e| {
            let message = e.inner().to_string();
            bad(&field_of(e.path(), &message), message)
        })
    }

    /// Rejects every bad value once, before anything starts.
    pub fn validate(mut self) -> Result<Settings, ConfigError> {
        if self.host.trim().is_empty() {
            return Err(bad("host", "must not be empty"));
        }
        let weights = Weights::new(self.w_ttft, self.w_tpot).map_err(|e| {
            let field = if e.to_string().contains("w_ttft") {
                "w_ttft"
            } else {
                "w_tpot"
            };
            bad(field, e.to_string())
        })?;
        for (field, v) in [
            ("session_ttl", self.session_ttl),
            ("request_timeout", self.request_timeout),
            ("prefill_timeout", self.prefill_timeout),
            ("connect_timeout", self.connect_timeout),
            ("stream_idle_timeout", self.stream_idle_timeout),
            ("health_interval", self.health_interval),
            ("heartbeat_timeout", self.heartbeat_timeout),
            ("breaker_open", self.breaker_open),
            ("qps_window", self.qps_window),
            ("first_token_timeout", self.first_token_timeout),
            ("queue_timeout", self.queue_timeout),
            ("decoder_kv_blocks_ttl", self.decoder_kv_blocks_ttl),
        ] {
            positive(field, v)?;
        }
        for (field, v) in [
            ("load_interval", self.load_interval),
            ("overload_kv_usage", self.overload_kv_usage),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(bad(field, format!("must be a finite number ≥ 0, got {v}")));
            }
        }
        if self.overload_kv_usage > 1.0 {
            return Err(bad(
                "overload_kv_usage",
                format!(
                    "is a share of the KV cache, 0..1 (0: off), got {}",
                    self.overload_kv_usage
                ),
            ));
        }
        if self.session_capacity == 0 {
            return Err(bad("session_capacity", "must be at least 1"));
        }
        if self.session_max_bytes < 64 << 10 {
            return Err(bad(
                "session_max_bytes",
                format!("must be at least 64 KiB, got {}", self.session_max_bytes),
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(bad("max_body_bytes", "must be at least 1"));
        }
        if self.worker_threads > 1024 {
            return Err(bad(
                "worker_threads",
                format!(
                    "must be at most 1024 (0: one per core), got {}",
                    self.worker_threads
                ),
            ));
        }
        if self.breaker_failures == 0 {
            return Err(bad("breaker_failures", "must be at least 1"));
        }
        if let Some(s) = self.replica_share {
            if !(0.0..=1.0).contains(&s) {
                return Err(bad("replica_share", format!("must be in [0, 1], got {s}")));
            }
        }
        self.validate_connections()?;
        if let Some(url) = &self.otlp_traces_endpoint {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(bad(
                    "otlp_traces_endpoint",
                    format!("{url:?}: must be an http:// or https:// URL (OTLP over HTTP)"),
                ));
            }
        }
        if let Some(filter) = &self.log {
            check_filter(filter).map_err(|e| bad("log", e))?;
        }
        self.state_url = resolve_state(self.state.as_deref(), std::env::var(STATE_ENV).ok())?;
        if let Some(path) = &self.state_ca_file {
            check_state_ca(self.state_url.as_deref(), path).map_err(|e| bad("state_ca_file", e))?;
        }
        check_state_prefix(&self.state_prefix).map_err(|e| bad("state_prefix", e))?;
        self.admin_secret = self.resolve_admin_token(std::env::var(ADMIN_TOKEN_ENV).ok())?;
        self.client_secret = resolve_secret(
            ("api_key", &self.api_key),
            ("api_key_file", &self.api_key_file),
            API_KEY_ENV,
            std::env::var(API_KEY_ENV).ok(),
        )?;
        self.upstream_secret = resolve_secret(
            ("upstream_api_key", &self.upstream_api_key),
            ("upstream_api_key_file", &self.upstream_api_key_file),
            UPSTREAM_API_KEY_ENV,
            std::env::var(UPSTREAM_API_KEY_ENV).ok(),
        )?;
        if let Some(path) = &self.upstream_ca_file {
            read_ca_file(path).map_err(|e| bad("upstream_ca_file", e))?;
        }
        let mut static_nodes = Vec::new();
        for role in Role::ALL {
            for url in self.nodes_of(role) {
                static_nodes.push((role, parse_node(node_setting(role), url)?));
            }
        }
        let emulated = match &self.emulated {
            None => None,
            Some(layout) => {
                if !static_nodes.is_empty() {
                    return Err(bad(
                        "emulated",
                        "give either an emulated layout or node URLs, not both",
                    ));
                }
                Some(parse_layout(layout).map_err(|e| bad("emulated", e.to_string()))?)
            }
        };
        let slo = match (self.slo_ttft_ms, self.slo_tpot_ms) {
            (None, None) => None,
            (Some(ttft_ms), Some(tpot_ms)) => {
                for (field, v) in [("slo_ttft_ms", ttft_ms), ("slo_tpot_ms", tpot_ms)] {
                    positive(field, v)?;
                }
                Some(Slo { ttft_ms, tpot_ms })
            }
            (Some(_), None) => {
                return Err(bad(
                    "slo_tpot_ms",
                    "SLO mode needs both slo_ttft_ms and slo_tpot_ms",
                ))
            }
            (None, Some(_)) => {
                return Err(bad(
                    "slo_ttft_ms",
                    "SLO mode needs both slo_ttft_ms and slo_tpot_ms",
                ))
            }
        };
        let profile_name = self
            .engine_profile
            .as_deref()
            .or(self
                .emulator_profile
                .as_deref()
                .filter(|_| self.emulated.is_some()))
            .unwrap_or("default");
        let profile = ppd_core::profiles::load_profile(profile_name)
            .map_err(|e| bad("engine_profile", e.to_string()))?;
        Ok(Settings {
            cfg: self,
            weights,
            nodes: static_nodes,
            emulated,
            profile,
            slo,
        })
    }
}

/// Whether `filter` is a valid `EnvFilter` directive list (checked with the
/// other settings, so a typo is reported with its field before start-up).
pub(crate) fn check_filter(filter: &str) -> Result<(), String> {
    tracing_subscriber::EnvFilter::builder()
        .parse(filter)
        .map(drop)
        .map_err(|e| format!("{filter:?} is not a log filter: {e}"))
}

/// The largest `max_connections` accepted.
const MAX_CONNECTIONS_LIMIT: usize = 1 << 20;

/// A validated (positive, finite) number of seconds as a `Duration`, at most
/// a year: a longer one is as good as none, and would overflow an `Instant`.
pub(crate) fn seconds(v: f64) -> std::time::Duration {
    const YEAR: std::time::Duration = std::time::Duration::from_secs(365 * 86_400);
    std::time::Duration::try_from_secs_f64(v).map_or(YEAR, |d| d.min(YEAR))
}

// ---- Client connections and the admin listener: validation ----
impl RouterConfig {
    fn validate_connections(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("header_read_timeout", self.header_read_timeout),
            ("body_read_timeout", self.body_read_timeout),
            ("keep_alive_timeout", self.keep_alive_timeout),
        ] {
            positive(field, v)?;
        }
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS_LIMIT {
            return Err(bad(
                "max_connections",
                format!(
                    "must be from 1 to {MAX_CONNECTIONS_LIMIT} (there is no unlimited setting), got {}",
                    self.max_connections
                ),
            ));
        }
        if let Some(h) = &self.admin_host {
            if h.trim().is_empty() {
                return Err(bad("admin_host", "must not be empty when given"));
            }
            if self.admin_port.is_none() {
                return Err(bad("admin_host", "needs admin_port"));
            }
        }
        if let Some(p) = self.admin_port {
            if p == 0 {
                return Err(bad("admin_port", "must be a port from 1 to 65535"));
            }
            let admin_host = self.admin_host.as_deref().unwrap_or(&self.host);
            if p == self.port && admin_host == self.host {
                return Err(bad(
                    "admin_port",
                    format!("must differ from port ({p}) on the same host"),
                ));
            }
        }
        Ok(())
    }

    /// The admin token in force: `admin_token`, else the content of
    /// `admin_token_file` (one trailing newline stripped, nothing else), else
    /// `env` (the value of [`ADMIN_TOKEN_ENV`]; empty counts as unset).
    fn resolve_admin_token(&self, env: Option<String>) -> Result<AdminSecret, ConfigError> {
        resolve_secret(
            ("admin_token", &self.admin_token),
            ("admin_token_file", &self.admin_token_file),
            ADMIN_TOKEN_ENV,
            env,
        )
    }
}

/// A bearer token in force: the setting, else the content of its file
/// setting (one trailing newline stripped, nothing else), else the
/// environment variable `env_name` (whose value is `env`); never both the
/// setting and the file.
fn resolve_secret(
    (setting, value): (&str, &Option<String>),
    (file_setting, file): (&str, &Option<String>),
    env_name: &str,
    env: Option<String>,
) -> Result<Secret, ConfigError> {
    // (the setting a bad token is reported under, where it came from, the token)
    let (field, from, token) = match (value, file) {
        (Some(_), Some(_)) => {
            return Err(bad(
                file_setting,
                format!("give {setting} or {file_setting}, not both"),
            ))
        }
        (Some(t), None) => (setting, String::new(), t.clone()),
        (None, Some(path)) => {
            let mut t = std::fs::read_to_string(path)
                .map_err(|e| bad(file_setting, format!("cannot read {path}: {e}")))?;
            if t.ends_with('\n') {
                t.pop();
                if t.ends_with('\r') {
                    t.pop();
                }
            }
            (file_setting, format!(" (the content of {path})"), t)
        }
        (None, None) => match env.filter(|t| !t.is_empty()) {
            Some(t) => (setting, format!(" (from {env_name})"), t),
            None => return Ok(Secret(None)),
        },
    };
    if token.trim().is_empty() {
        return Err(bad(field, format!("must not be empty when given{from}")));
    }
    // A bearer token travels in a header value: visible ASCII, no spaces.
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad(
            field,
            format!("must be visible ASCII without spaces or control characters{from}"),
        ));
    }
    Ok(Secret(Some(token)))
}

/// The state store in force: `state`, else `env` (the value of
/// [`STATE_ENV`]; empty counts as unset), checked to be a Redis URL the
/// client can use: `redis://`, or `rediss://` over TLS.
fn resolve_state(
    setting: Option<&str>,
    env: Option<String>,
) -> Result<Option<String>, ConfigError> {
    let (url, from) = match (setting, env.filter(|e| !e.trim().is_empty())) {
        (Some(s), _) => (s.trim().to_owned(), String::new()),
        (None, Some(e)) => (e.trim().to_owned(), format!(" (from {STATE_ENV})")),
        (None, None) => return Ok(None),
    };
    // Never the URL itself in the message: it may hold a password.
    let shown = without_password(&url);
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(bad(
            "state",
            format!("{shown:?}{from}: expected redis://HOST[:PORT][/DB] or rediss:// (Redis is the only state store; unix sockets are not supported)"),
        ));
    }
    redis::Client::open(url.as_str())
        .map_err(|e| bad("state", format!("{shown:?}{from}: not a Redis URL: {e}")))?;
    Ok(Some(url))
}

/// `url` with its password, if any, replaced by `REDACTED` (for logs and errors).
pub(crate) fn without_password(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("REDACTED"));
            u.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) => "<not a URL>".to_owned(),
    }
}

/// A key namespace: 1 to 64 visible ASCII characters, no spaces.
fn check_state_prefix(prefix: &str) -> Result<(), String> {
    if prefix.is_empty() || prefix.len() > 64 || !prefix.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{prefix:?}: must be 1 to 64 visible ASCII characters without spaces"
        ));
    }
    Ok(())
}

/// A `state_ca_file` is for a TLS store only, and must hold certificates.
fn check_state_ca(state_url: Option<&str>, path: &str) -> Result<(), String> {
    if !state_url.is_some_and(|u| u.starts_with("rediss://")) {
        return Err("applies to a rediss:// state store only".into());
    }
    read_ca_file(path).map(|_| ())
}

/// The CA certificates of `upstream_ca_file` or `state_ca_file` (PEM, at least one).
pub fn read_ca_file(path: &str) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{path}: no PEM certificate in it"));
    }
    Ok(certs)
}

/// A validated configuration: only [`RouterConfig::validate`] makes one, and
/// the router runs only on one.
#[derive(Debug, Clone)]
pub struct Settings {
    cfg: RouterConfig,
    weights: Weights,
    nodes: Vec<(Role, NodeSpec)>,
    emulated: Option<Vec<Role>>,
    profile: Profile,
    slo: Option<Slo>,
}

impl Settings {
    /// The engine profile of the cost model.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }
    /// `ppd-live`'s SLO objectives, when set.
    pub fn slo(&self) -> Option<Slo> {
        self.slo
    }
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }
    pub fn weights(&self) -> Weights {
        self.weights
    }
    /// The static nodes with their roles, in the order given.
    pub fn nodes(&self) -> &[(Role, NodeSpec)] {
        &self.nodes
    }
    /// The roles of the emulated layout still to be started, if any.
    pub fn emulated(&self) -> Option<&[Role]> {
        self.emulated.as_deref()
    }

    /// Replaces the emulated layout by the nodes started for it, as static
    /// nodes (`urls` in layout order).
    pub fn with_emulated_nodes(mut self, urls: &[String]) -> Result<Settings, ConfigError> {
        let roles = self.emulated.take().unwrap_or_default();
        if roles.len() != urls.len() {
            return Err(bad(
                "emulated",
                format!("{} nodes started for {} roles", urls.len(), roles.len()),
            ));
        }
        for (role, url) in roles.into_iter().zip(urls) {
            let spec = parse_node("emulated", url)?;
            self.cfg.nodes_of_mut(role).push(url.clone());
            self.nodes.push((role, spec));
        }
        // The layout is now a set of static nodes, which render prompts with
        // the emulator's word rule (unless the operator chose otherwise).
        self.cfg.emulated = None;
        if self.cfg.prompt_renderer == PromptRenderer::Auto && self.cfg.tokenizer.is_none() {
            self.cfg.prompt_renderer = PromptRenderer::WordRule;
        }
        Ok(self)
    }

    /// The table to load: the configured one, or the built-in one nearest the deployment.
    pub fn table_spec(&self) -> String {
        self.cfg.table.clone().unwrap_or_else(|| {
            let roles: Vec<Role> = self.nodes.iter().map(|(r, _)| *r).collect();
            ppd_core::builtin::nearest_for(&roles).spec()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let s = RouterConfig::default().validate().unwrap();
        assert_eq!(s.config().kv_protocol, KvProtocol::Nixl);
        assert_eq!(s.config().runtime, Runtime::ThreadPerCore);
        assert_eq!(RouterConfig::default().max_body_bytes, 16 * 1024 * 1024);
        assert_eq!(s.config().route_headers, RouteHeaders::All);
        assert!(!s.config().session_from_user);
    }

    #[test]
    fn the_state_store_is_a_redis_url_from_the_setting_else_the_environment() {
        let c = RouterConfig::from_toml(
            "state = \"redis://cache:6380/2\"\nstate_prefix = \"blue\"\n",
            "r.toml",
        )
        .unwrap();
        assert_eq!(c.state_prefix, "blue");
        let from_env = Some("redis://other:6379".to_owned());
        assert_eq!(
            resolve_state(c.state.as_deref(), from_env.clone()).unwrap(),
            Some("redis://cache:6380/2".into())
        );
        assert_eq!(
            resolve_state(None, from_env).unwrap(),
            Some("redis://other:6379".into())
        );
        assert_eq!(resolve_state(None, Some(String::new())).unwrap(), None);
        assert_eq!(resolve_state(None, None).unwrap(), None);
    }

    #[test]
    fn a_state_url_that_is_not_redis_is_refused_without_showing_its_password() {
        for url in [
            "http://cache:6379",
            "https://:pw-secret@cache:6380",
            "unix:///tmp/redis.sock",
            "redis://:pw-secret@",
        ] {
            let e = resolve_state(Some(url), None).unwrap_err();
            assert_eq!(e.field, "state");
            assert!(!e.message.contains("pw-secret"), "{e}");
        }
        let e = resolve_state(None, Some("http://x".into())).unwrap_err();
        assert!(e.message.contains(STATE_ENV), "{e}");
    }

    #[test]
    fn a_tls_state_store_is_taken_and_only_it_takes_a_ca_file() {
        assert_eq!(
            resolve_state(Some("rediss://:pw@cache:6380/1"), None).unwrap(),
            Some("rediss://:pw@cache:6380/1".into())
        );
        let dir = std::env::temp_dir().join(format!("ppd-state-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let empty = empty.to_str().unwrap();
        let e = check_state_ca(Some("redis://cache"), empty).unwrap_err();
        assert!(e.contains("rediss://"), "{e}");
        assert!(check_state_ca(None, empty).is_err());
        let e = check_state_ca(Some("rediss://cache"), empty).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");
    }

    #[test]
    fn a_state_urls_password_never_shows() {
        assert_eq!(
            without_password("redis://:hunter2@cache:6379/1"),
            "redis://:REDACTED@cache:6379/1"
        );
        assert_eq!(without_password("redis://cache:6379"), "redis://cache:6379");
        assert!(!without_password("redis://u:hunter2@cache").contains("hunter2"));
    }

    #[test]
    fn a_state_prefix_is_short_visible_ascii() {
        for bad_prefix in ["", "a b", &"x".repeat(65)] {
            let c = RouterConfig {
                state_prefix: bad_prefix.to_owned(),
                ..RouterConfig::default()
            };
            assert_eq!(c.validate().unwrap_err().field, "state_prefix");
        }
    }

    #[test]
    fn observability_settings_parse_from_toml_and_bad_values_name_their_field() {
        let c = RouterConfig::from_toml(
            "log = \"info\"\nlog_format = \"json\"\notlp_traces_endpoint = \"http://c:4318/v1/traces\"\n",
            "r.toml",
        )
        .unwrap();
        assert_eq!(c.log_format, LogFormat::Json);
        assert!(c.clone().validate().is_ok());
        let bad_log = RouterConfig {
            log: Some("info,[[[".into()),
            ..c.clone()
        };
        assert_eq!(bad_log.validate().unwrap_err().field, "log");
        let bad_endpoint = RouterConfig {
            otlp_traces_endpoint: Some("c:4317".into()),
            ..c
        };
        assert_eq!(
            bad_endpoint.validate().unwrap_err().field,
            "otlp_traces_endpoint"
        );
        let e = RouterConfig::from_toml("log_format = \"xml\"\n", "r.toml").unwrap_err();
        assert_eq!(e.field, "log_format");
    }

    #[test]
    fn identity_and_header_settings_parse_from_toml() {
        let c = RouterConfig::from_toml(
            "route_headers = \"path\"\nsession_from_user = true\n",
            "r.toml",
        )
        .unwrap();
        assert_eq!(
            (c.route_headers, c.session_from_user),
            (RouteHeaders::Path, true)
        );
    }

    type Mutation = Box<dyn Fn(&mut RouterConfig)>;

    /// Each mutation of the defaults is refused, naming its field.
    fn each_names_its_field(cases: Vec<(&str, Mutation)>) {
        for (field, mutate) in cases {
            let mut c = RouterConfig::default();
            mutate(&mut c);
            let e = c.validate().unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
    }

    #[test]
    fn every_bad_value_names_its_field() {
        let cases: Vec<(&str, Mutation)> = vec![
            ("w_ttft", Box::new(|c| c.w_ttft = f64::NAN)),
            ("w_tpot", Box::new(|c| c.w_tpot = -1.0)),
            ("session_ttl", Box::new(|c| c.session_ttl = 0.0)),
            ("request_timeout", Box::new(|c| c.request_timeout = -3.0)),
            ("max_body_bytes", Box::new(|c| c.max_body_bytes = 0)),
            ("worker_threads", Box::new(|c| c.worker_threads = 5000)),
            (
                "prefill",
                Box::new(|c| c.prefill = vec!["localhost:8000".into()]),
            ),
            ("decode", Box::new(|c| c.decode = vec!["http://".into()])),
            (
                "replica",
                Box::new(|c| c.replica = vec!["http://h:1;foo=bar".into()]),
            ),
            ("replica_share", Box::new(|c| c.replica_share = Some(2.0))),
            (
                "admin_token",
                Box::new(|c| c.admin_token = Some(" ".into())),
            ),
            (
                "emulated",
                Box::new(|c| {
                    c.emulated = Some("2P2pD".into());
                    c.prefill = vec!["http://a:1".into()];
                }),
            ),
            ("emulated", Box::new(|c| c.emulated = Some("2X".into()))),
        ];
        each_names_its_field(cases);
    }

    // ---- Client connections and the admin listener ----

    #[test]
    fn connection_and_admin_settings_name_their_field() {
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "header_read_timeout",
                Box::new(|c| c.header_read_timeout = 0.0),
            ),
            (
                "body_read_timeout",
                Box::new(|c| c.body_read_timeout = f64::NAN),
            ),
            (
                "keep_alive_timeout",
                Box::new(|c| c.keep_alive_timeout = -1.0),
            ),
            ("max_connections", Box::new(|c| c.max_connections = 0)),
            (
                "max_connections",
                Box::new(|c| c.max_connections = usize::MAX),
            ),
            ("admin_port", Box::new(|c| c.admin_port = Some(0))),
            ("admin_port", Box::new(|c| c.admin_port = Some(c.port))),
            (
                "admin_host",
                Box::new(|c| c.admin_host = Some("127.0.0.1".into())),
            ),
            (
                "admin_host",
                Box::new(|c| {
                    c.admin_port = Some(9001);
                    c.admin_host = Some(" ".into());
                }),
            ),
            (
                "admin_token_file",
                Box::new(|c| {
                    c.admin_token = Some("a".into());
                    c.admin_token_file = Some("/dev/null".into());
                }),
            ),
            (
                "admin_token_file",
                Box::new(|c| c.admin_token_file = Some("/nonexistent/ppd-token".into())),
            ),
            (
                "admin_token",
                Box::new(|c| c.admin_token = Some("two words".into())),
            ),
        ];
        each_names_its_field(cases);
    }

    #[test]
    fn node_urls_the_client_cannot_use_are_refused_naming_their_setting() {
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "prefill",
                Box::new(|c| c.prefill = vec!["ftp://h:1".into()]),
            ),
            ("decode", Box::new(|c| c.decode = vec!["https://".into()])),
            (
                "pd_capable",
                Box::new(|c| c.pd_capable = vec!["http://h:99999".into()]),
            ),
            (
                "replica",
                Box::new(|c| c.replica = vec!["http://[::1:8000".into()]),
            ),
            (
                "replica",
                Box::new(|c| c.replica = vec!["http://h:1/?x=1".into()]),
            ),
        ];
        each_names_its_field(cases);
        // https nodes are taken.
        let c = RouterConfig {
            prefill: vec!["https://p.example:8443".into()],
            pd_capable: vec!["https://10.0.0.2:8443/".into()],
            ..RouterConfig::default()
        };
        let s = c.validate().unwrap();
        assert_eq!(s.nodes()[1].1.url, "https://10.0.0.2:8443");
    }

    #[test]
    fn api_keys_come_from_the_setting_the_file_or_the_environment_and_are_never_printed() {
        let dir = std::env::temp_dir().join(format!("ppd-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "from-file\n").unwrap();
        let resolve = |v: Option<&str>, f: Option<&str>, env: Option<&str>| {
            resolve_secret(
                ("upstream_api_key", &v.map(str::to_owned)),
                ("upstream_api_key_file", &f.map(str::to_owned)),
                UPSTREAM_API_KEY_ENV,
                env.map(str::to_owned),
            )
            .map(|s| s.get().map(str::to_owned))
        };
        let path = file.display().to_string();
        assert_eq!(resolve(None, None, None).unwrap(), None);
        assert_eq!(
            resolve(None, None, Some("e")).unwrap().as_deref(),
            Some("e")
        );
        assert_eq!(
            resolve(Some("s"), None, Some("e")).unwrap().as_deref(),
            Some("s")
        );
        assert_eq!(
            resolve(None, Some(&path), Some("e")).unwrap().as_deref(),
            Some("from-file")
        );
        assert_eq!(
            resolve(Some("s"), Some(&path), None).unwrap_err().field,
            "upstream_api_key_file"
        );
        let e = resolve(None, None, Some("two words")).unwrap_err();
        assert_eq!(e.field, "upstream_api_key");
        assert!(e.message.contains("PPD_UPSTREAM_API_KEY"), "{e}");
        for (field, mutate) in [
            (
                "api_key",
                Box::new(|c: &mut RouterConfig| c.api_key = Some(" ".into())) as Mutation,
            ),
            (
                "api_key_file",
                Box::new(|c: &mut RouterConfig| c.api_key_file = Some("/nonexistent/k".into())),
            ),
            (
                "upstream_api_key",
                Box::new(|c: &mut RouterConfig| c.upstream_api_key = Some("a\tb".into())),
            ),
        ] {
            let mut c = RouterConfig::default();
            mutate(&mut c);
            assert_eq!(c.validate().unwrap_err().field, field);
        }
        // In force after validation; printed as "<set>", never as the value.
        let c = RouterConfig {
            api_key: Some("client-secret".into()),
            upstream_api_key_file: Some(path),
            ..RouterConfig::default()
        };
        let s = c.validate().unwrap();
        assert_eq!(s.config().client_secret.get(), Some("client-secret"));
        assert_eq!(s.config().upstream_secret.get(), Some("from-file"));
        let shown = serde_json::to_value(s.config()).unwrap();
        assert_eq!(shown["api_key"], "<set>");
        assert!(shown["upstream_api_key"].is_null());
        // The value in force is in no Debug either (the raw setting is, like admin_token's).
        let mut cleared = s.config().clone();
        cleared.api_key = None;
        let text = format!("{shown} {cleared:?}");
        assert!(
            !text.contains("client-secret") && !text.contains("from-file"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_admin_token_comes_from_the_setting_the_file_or_the_environment() {
        let dir = std::env::temp_dir().join(format!("ppd-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        let resolve = |c: &RouterConfig, env: Option<&str>| {
            c.resolve_admin_token(env.map(str::to_owned))
                .map(|s| s.get().map(str::to_owned))
        };
        let mut c = RouterConfig::default();
        assert_eq!(resolve(&c, None).unwrap(), None);
        assert_eq!(resolve(&c, Some("")).unwrap(), None);
        assert_eq!(resolve(&c, Some("env")).unwrap().as_deref(), Some("env"));
        assert_eq!(
            resolve(&c, Some("bad token")).unwrap_err().message,
            "must be visible ASCII without spaces or control characters (from PPD_ADMIN_TOKEN)"
        );
        for (content, token) in [
            ("tok\n", Some("tok")),
            ("tok", Some("tok")),
            ("tok\r\n", Some("tok")),
        ] {
            std::fs::write(&file, content).unwrap();
            c.admin_token_file = Some(file.display().to_string());
            assert_eq!(resolve(&c, Some("env")).unwrap().as_deref(), token);
        }
        for content in ["", "\n", "tok\n\n", " tok\n", "tok \n"] {
            std::fs::write(&file, content).unwrap();
            let e = resolve(&c, None).unwrap_err();
            assert_eq!(e.field, "admin_token_file", "{content:?}: {e}");
        }
        c.admin_token_file = None;
        c.admin_token = Some("flag".into());
        assert_eq!(resolve(&c, Some("env")).unwrap().as_deref(), Some("flag"));
        // The token in force is never serialized, nor shown by Debug.
        let s = c.validate().unwrap();
        assert_eq!(s.config().admin_secret.get(), Some("flag"));
        let mut shown = s.config().clone();
        shown.admin_token = None;
        assert!(!format!("{shown:?}").contains("flag"));
        assert!(!serde_json::to_string(&shown).unwrap().contains("flag"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn enum_settings_are_refused_by_name_when_parsed() {
        for (key, value) in [
            ("policy", "\"fast\""),
            ("kv_protocol", "\"rdma\""),
            ("runtime", "\"per-request\""),
            ("route_headers", "\"some\""),
        ] {
            let e = RouterConfig::default()
                .with_overrides(&format!("{{\"{key}\": {value}}}"))
                .unwrap_err();
            assert_eq!(e.field, key, "{e}");
        }
    }

    #[test]
    fn toml_errors_name_the_field_and_its_line() {
        let c = RouterConfig::from_toml(
            "port = 9000\nprefill = [\"http://127.0.0.1:8100\"]\npolicy = \"fraction:0.5\"\n",
            "r.toml",
        )
        .unwrap();
        assert_eq!(c.port, 9000);
        assert_eq!(c.prefill, vec!["http://127.0.0.1:8100".to_string()]);
        assert_eq!(c.policy, PolicyKind::Fraction(0.5));
        let e = RouterConfig::from_toml("host = \"h\"\nprot = 1\n", "r.toml").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.origin.as_deref()),
            ("prot", Some("r.toml line 2"))
        );
        let e = RouterConfig::from_toml("\n\nport = \"9000\"\n", "r.toml").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.origin.as_deref()),
            ("port", Some("r.toml line 3"))
        );
        assert!(
            e.to_string()
                .starts_with("r.toml line 3: invalid setting `port`"),
            "{e}"
        );
        let e = RouterConfig::from_toml("policy = \"fast\"\n", "r.toml").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.origin.as_deref()),
            ("policy", Some("r.toml line 1"))
        );
        let e = RouterConfig::from_toml("prefill = [\"a\", 3]\n", "r.toml").unwrap_err();
        assert_eq!(e.field, "prefill", "{e}");
        let e = RouterConfig::from_toml("port = \n", "r.toml").unwrap_err();
        assert_eq!(e.origin.as_deref(), Some("r.toml line 1"), "{e}");
    }

    #[test]
    fn flags_override_the_file() {
        let c = RouterConfig::from_toml("port = 9000\nw_tpot = 3.0\n", "r.toml")
            .unwrap()
            .with_overrides(r#"{"port": 9100, "runtime": "work-stealing"}"#)
            .unwrap();
        assert_eq!(
            (c.port, c.w_tpot, c.runtime),
            (9100, 3.0, Runtime::WorkStealing)
        );
        let e = RouterConfig::default()
            .with_overrides(r#"{"w_ttft": "high"}"#)
            .unwrap_err();
        assert_eq!(e.field, "w_ttft", "{e}");
    }

    #[test]
    fn node_specs_parse_their_zmq_address() {
        let n = parse_node("prefill", "http://10.0.0.1:8100/;zmq=10.0.0.1:21001").unwrap();
        assert_eq!(n.url, "http://10.0.0.1:8100");
        assert_eq!(n.zmq.as_deref(), Some("10.0.0.1:21001"));
    }

    #[test]
    fn no_secret_shows_in_the_debug_print_or_the_printed_settings() {
        let c = RouterConfig::default()
            .with_overrides(
                r#"{"admin_token": "adm-1", "api_key": "cli-2", "upstream_api_key": "up-3"}"#,
            )
            .unwrap();
        let shown = format!("{c:?} {}", serde_json::to_string(&c).unwrap());
        for secret in ["adm-1", "cli-2", "up-3"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("\"admin_token\":\"<set>\""), "{shown}");
        let s = c.validate().unwrap();
        assert!(!format!("{s:?}").contains("adm-1"));
    }

    #[test]
    fn kv_events_bind_here_and_kv_events_from_connect_to_the_node() {
        let bound = parse_node("pd_capable", "http://d:1;kv_events=tcp://127.0.0.1:5557").unwrap();
        assert_eq!(
            bound.kv_events,
            Some(Endpoint::bind("tcp://127.0.0.1:5557"))
        );
        let from = parse_node("pd_capable", "http://d:1;kv_events_from=tcp://d:5557").unwrap();
        assert_eq!(from.kv_events, Some(Endpoint::connect("tcp://d:5557")));
        let e = parse_node("pd_capable", "http://d:1;kv_events_from=d:5557").unwrap_err();
        assert!(e.to_string().contains("kv_events_from=tcp://"), "{e}");
    }

    #[test]
    fn placement_is_least_loaded_unless_set_to_rendezvous() {
        assert_eq!(RouterConfig::default().placement, Placement::LeastLoaded);
        let c = RouterConfig::default()
            .with_overrides(r#"{"placement": "rendezvous"}"#)
            .unwrap();
        assert_eq!(c.placement, Placement::Rendezvous);
        let e = RouterConfig::default()
            .with_overrides(r#"{"placement": "random"}"#)
            .unwrap_err();
        assert_eq!(e.field, "placement", "{e}");
    }

    #[test]
    fn an_emulated_layout_becomes_static_nodes_and_picks_the_nearest_table() {
        let c = RouterConfig {
            emulated: Some("2P1pD".into()),
            ..RouterConfig::default()
        };
        let s = c.validate().unwrap();
        assert_eq!(s.emulated(), Some(&[Role::P, Role::P, Role::PD][..]));
        let urls = ["http://a:1", "http://b:1", "http://c:1"].map(String::from);
        let s = s.with_emulated_nodes(&urls).unwrap();
        assert!(s.emulated().is_none() && s.config().emulated.is_none());
        assert_eq!(s.config().pd_capable, vec!["http://c:1".to_string()]);
        assert_eq!(s.table_spec(), "builtin:h100-3P1pD");
    }
}

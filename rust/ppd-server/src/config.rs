//! The router's settings: one schema for the TOML file and the command line, validated before anything starts.

use serde::{Deserialize, Serialize};
use std::fmt;

use ppd_core::PolicyKind;

/// How the pd path moves KV from P to D.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvProtocol {
    /// Current vLLM NixlConnector: `kv_transfer_params` from P's answer go to D.
    Nixl,
    /// Legacy P2pNccl (vLLM ≤ 0.23, the paper's setup): addresses encoded in `X-Request-Id`.
    P2pNccl,
    /// No KV transfer: the pd path sends the request to D alone, which computes it whole.
    None,
}

impl KvProtocol {
    pub fn parse(s: &str) -> Option<KvProtocol> {
        match s {
            "nixl" => Some(KvProtocol::Nixl),
            "p2pnccl" => Some(KvProtocol::P2pNccl),
            "none" => Some(KvProtocol::None),
            _ => None,
        }
    }
}

/// Every setting, with the defaults of the CLI. Field names are the TOML keys;
/// the flags are the same names with dashes (`session_ttl` ↔ `--session-ttl`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Start an emulated cluster of this layout in-process (e.g. `2P2pD`).
    pub emulated: Option<String>,
    /// Emulator profile name or path, for `emulated`.
    pub emulator_profile: Option<String>,
    pub policy: String,
    /// Lookup table: a path, or `builtin:h100-1P3pD|h100-2P2pD|h100-3P1pD`.
    pub table: Option<String>,
    pub w_ttft: f64,
    pub w_tpot: f64,
    pub kv_protocol: String,
    /// Bearer token of the admin API; without it the admin API refuses every call.
    pub admin_token: Option<String>,
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
    /// Window of the QPS estimator, seconds.
    pub qps_window: f64,
    /// Hybrid R + P/D: share of new conversations for replicas (default: R nodes / (R + D nodes)).
    pub replica_share: Option<f64>,
    /// KV bytes per token, for the KV-moved metrics (Llama-3.1-8B BF16: 131072).
    pub kv_bytes_per_token: u64,
    /// A tokenizer.json for exact token counts (default: the word rule).
    pub tokenizer: Option<String>,
    /// Log filter (tracing `EnvFilter` syntax).
    pub log: String,
    /// Router I/O threads (0: one per core).
    pub worker_threads: usize,
    /// `thread-per-core`: each I/O thread runs its own single-threaded runtime,
    /// accepts its own connections and keeps its own upstream connection pool,
    /// so a request never changes thread (no cross-thread wake-ups on the hot
    /// path). `work-stealing`: one tokio multi-thread runtime, which evens out
    /// uneven connections at the price of handing requests between threads.
    pub runtime: String,
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
            policy: "ppd".into(),
            table: None,
            w_ttft: 1.0,
            w_tpot: 1.0,
            kv_protocol: "nixl".into(),
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
            qps_window: 10.0,
            replica_share: None,
            kv_bytes_per_token: 131_072,
            tokenizer: None,
            log: "warn".into(),
            worker_threads: 0,
            runtime: "thread-per-core".into(),
        }
    }
}

/// A rejected setting, by field name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid setting `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn bad(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// A node given on the command line or in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub url: String,
    pub zmq: Option<String>,
}

/// Parses `URL` or `URL;zmq=HOST:PORT`; the URL must be http(s) with a host.
pub fn parse_node(field: &str, s: &str) -> Result<NodeSpec, ConfigError> {
    let mut parts = s.split(';');
    let url = parts
        .next()
        .unwrap_or_default()
        .trim()
        .trim_end_matches('/');
    let mut zmq = None;
    for p in parts {
        match p.trim().split_once('=') {
            Some(("zmq", v)) if !v.trim().is_empty() => zmq = Some(v.trim().to_owned()),
            _ => {
                return Err(bad(
                    field,
                    format!("{s:?}: unknown node option {p:?} (expected zmq=HOST:PORT)"),
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
    Ok(NodeSpec {
        url: url.to_owned(),
        zmq,
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
    /// Reads a TOML file; unknown keys and wrong types name the field.
    pub fn from_toml(text: &str) -> Result<RouterConfig, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let msg = e.message().to_owned();
            // toml reports unknown keys as "unknown field `x`"; keep its wording.
            let field = msg
                .split('`')
                .nth(1)
                .map(str::to_owned)
                .unwrap_or_else(|| "config".into());
            bad(&field, msg)
        })
    }

    pub fn from_json(text: &str) -> Result<RouterConfig, ConfigError> {
        serde_json::from_str(text).map_err(|e| {
            let msg = e.to_string();
            let field = msg
                .split('`')
                .nth(1)
                .map(str::to_owned)
                .unwrap_or_else(|| "config".into());
            bad(&field, msg)
        })
    }

    /// Rejects every bad value before the server starts.
    pub fn validate(&self) -> Result<Validated, ConfigError> {
        if self.host.trim().is_empty() {
            return Err(bad("host", "must not be empty"));
        }
        let policy = PolicyKind::parse(&self.policy).map_err(|e| bad("policy", e.to_string()))?;
        let weights = ppd_core::Weights::new(self.w_ttft, self.w_tpot).map_err(|e| {
            let field = if e.to_string().contains("w_ttft") {
                "w_ttft"
            } else {
                "w_tpot"
            };
            bad(field, e.to_string())
        })?;
        let kv = KvProtocol::parse(&self.kv_protocol).ok_or_else(|| {
            bad(
                "kv_protocol",
                format!("{:?}: expected nixl, p2pnccl or none", self.kv_protocol),
            )
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
        ] {
            positive(field, v)?;
        }
        if self.session_capacity == 0 {
            return Err(bad("session_capacity", "must be at least 1"));
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
        if !matches!(self.runtime.as_str(), "thread-per-core" | "work-stealing") {
            return Err(bad(
                "runtime",
                format!(
                    "must be `thread-per-core` or `work-stealing`, got `{}`",
                    self.runtime
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
        if let Some(t) = &self.admin_token {
            if t.trim().is_empty() {
                return Err(bad("admin_token", "must not be empty when given"));
            }
        }
        let nodes = |field: &str, list: &[String]| -> Result<Vec<NodeSpec>, ConfigError> {
            list.iter().map(|s| parse_node(field, s)).collect()
        };
        let v = Validated {
            prefill: nodes("prefill", &self.prefill)?,
            decode: nodes("decode", &self.decode)?,
            pd_capable: nodes("pd_capable", &self.pd_capable)?,
            replica: nodes("replica", &self.replica)?,
            policy,
            weights,
            kv,
        };
        if self.emulated.is_some() {
            if !(v.prefill.is_empty()
                && v.decode.is_empty()
                && v.pd_capable.is_empty()
                && v.replica.is_empty())
            {
                return Err(bad(
                    "emulated",
                    "give either an emulated layout or node URLs, not both",
                ));
            }
            return Ok(v);
        }
        Ok(v)
    }
}

/// The parsed forms of a valid configuration.
#[derive(Debug, Clone)]
pub struct Validated {
    pub prefill: Vec<NodeSpec>,
    pub decode: Vec<NodeSpec>,
    pub pd_capable: Vec<NodeSpec>,
    pub replica: Vec<NodeSpec>,
    pub policy: PolicyKind,
    pub weights: ppd_core::Weights,
    pub kv: KvProtocol,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let v = RouterConfig::default().validate().unwrap();
        assert_eq!(v.kv, KvProtocol::Nixl);
        assert_eq!(RouterConfig::default().max_body_bytes, 16 * 1024 * 1024);
    }

    #[test]
    fn every_bad_value_names_its_field() {
        type Mutation = Box<dyn Fn(&mut RouterConfig)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("policy", Box::new(|c| c.policy = "fast".into())),
            ("w_ttft", Box::new(|c| c.w_ttft = f64::NAN)),
            ("w_tpot", Box::new(|c| c.w_tpot = -1.0)),
            ("kv_protocol", Box::new(|c| c.kv_protocol = "rdma".into())),
            ("session_ttl", Box::new(|c| c.session_ttl = 0.0)),
            ("request_timeout", Box::new(|c| c.request_timeout = -3.0)),
            ("max_body_bytes", Box::new(|c| c.max_body_bytes = 0)),
            ("runtime", Box::new(|c| c.runtime = "per-request".into())),
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
        ];
        for (field, mutate) in cases {
            let mut c = RouterConfig::default();
            mutate(&mut c);
            let e = c.validate().unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
    }

    #[test]
    fn toml_and_flags_share_one_schema() {
        let c = RouterConfig::from_toml(
            "port = 9000\nprefill = [\"http://127.0.0.1:8100\"]\npolicy = \"fraction:0.5\"\n",
        )
        .unwrap();
        assert_eq!(c.port, 9000);
        assert_eq!(c.prefill, vec!["http://127.0.0.1:8100".to_string()]);
        assert_eq!(c.validate().unwrap().policy, PolicyKind::Fraction(0.5));
        let e = RouterConfig::from_toml("prot = 1\n").unwrap_err();
        assert_eq!(e.field, "prot");
        let e = RouterConfig::from_toml("port = \"x\"\n").unwrap_err();
        assert!(e.message.contains("port") || e.field == "config", "{e}");
        let e = RouterConfig::from_json("{\"w_ttft\": \"high\"}").unwrap_err();
        assert!(
            e.to_string().contains("w_ttft") || e.message.contains("f64"),
            "{e}"
        );
    }

    #[test]
    fn node_specs_parse_their_zmq_address() {
        let n = parse_node("prefill", "http://10.0.0.1:8100/;zmq=10.0.0.1:21001").unwrap();
        assert_eq!(n.url, "http://10.0.0.1:8100");
        assert_eq!(n.zmq.as_deref(), Some("10.0.0.1:21001"));
    }
}

//! The router's log and traces: a tracing subscriber on standard error (text or JSON lines), filtered by the `log` setting or `RUST_LOG`, and with `otlp_traces_endpoint` the request spans exported over OTLP; installed once per process.

use std::io::IsTerminal;
use std::sync::OnceLock;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::{check_filter, LogFormat, RouterConfig};
use crate::trail::TRACE_TARGET;

/// The exporter of the process's spans, when `otlp_traces_endpoint` set one up.
static TRACES: OnceLock<SdkTracerProvider> = OnceLock::new();

/// The filter used when neither `log` nor `RUST_LOG` gives one: problems only.
const DEFAULT_FILTER: &str = "warn";

/// The filter in force: the `log` setting (flag or TOML), else `RUST_LOG`
/// (when set and valid), else [`DEFAULT_FILTER`].
fn filter_of(setting: Option<&str>, env: Option<&str>) -> String {
    setting
        .or(env.filter(|e| !e.trim().is_empty() && check_filter(e).is_ok()))
        .unwrap_or(DEFAULT_FILTER)
        .to_owned()
}

/// Installs the process's log subscriber (and span exporter). The first
/// router of a process decides (a subscriber is global); returns whether
/// this call installed it, or why the exporter could not be built.
pub fn install(cfg: &RouterConfig) -> Result<bool, String> {
    let env = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    // The request spans are for the exporter, never log lines.
    let filter = EnvFilter::new(filter_of(cfg.log.as_deref(), env.as_deref())).add_directive(
        format!("{TRACE_TARGET}=off")
            .parse()
            .map_err(|e| format!("{e}"))?,
    );
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match cfg.log_format {
        LogFormat::Text => fmt.boxed(),
        // Fields at the top level of each object, no span context: one flat
        // record per event, as log shippers index them.
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .boxed(),
    };
    let logs = tracing_subscriber::registry().with(fmt.with_filter(filter));
    let Some(endpoint) = cfg.otlp_traces_endpoint.clone() else {
        return Ok(logs.try_init().is_ok());
    };
    // The blocking HTTP client must not be built on an async runtime's thread.
    let provider = std::thread::spawn(move || tracer_provider(&endpoint))
        .join()
        .map_err(|_| "the OTLP exporter panicked while starting".to_owned())??;
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("ppd-router"))
        .with_filter(Targets::new().with_target(TRACE_TARGET, tracing::Level::INFO));
    let installed = logs.with(spans).try_init().is_ok();
    if installed {
        let _ = TRACES.set(provider);
    }
    Ok(installed)
}

/// Spans batched and sent as OTLP/HTTP JSON to `endpoint` (a collector's
/// `/v1/traces`), as service `ppd-router` unless `OTEL_SERVICE_NAME` says otherwise.
fn tracer_provider(endpoint: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpJson)
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("otlp_traces_endpoint {endpoint:?}: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(
            std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "ppd-router".to_owned()),
        )
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Sends the spans still batched (a router stopping); the exporter stays
/// for the process's next router.
pub fn flush_traces() {
    if let Some(p) = TRACES.get() {
        let p = p.clone();
        // Blocking: off the runtime's threads.
        let _ = std::thread::spawn(move || p.force_flush()).join();
    }
}

/// The settings as logged at start-up: every value but the admin token and
/// the state store's password.
pub(crate) fn settings_for_log(cfg: &RouterConfig) -> String {
    let mut v = serde_json::to_value(cfg).unwrap_or_default();
    if let Some(t) = v.get_mut("admin_token").filter(|t| !t.is_null()) {
        *t = serde_json::Value::from("<set>");
    }
    if let Some(url) = &cfg.state {
        v["state"] = crate::config::without_password(url).into();
    }
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_wins_over_rust_log_which_wins_over_the_default() {
        assert_eq!(filter_of(Some("debug"), Some("info")), "debug");
        assert_eq!(filter_of(None, Some("info,hyper=warn")), "info,hyper=warn");
        assert_eq!(filter_of(None, None), "warn");
        assert_eq!(filter_of(None, Some("  ")), "warn");
    }

    #[test]
    fn a_bad_rust_log_falls_back_to_the_default() {
        assert_eq!(filter_of(None, Some("info,[[[")), "warn");
    }

    #[test]
    fn the_admin_token_is_never_logged() {
        let cfg = RouterConfig {
            admin_token: Some("s3cret".into()),
            ..RouterConfig::default()
        };
        let line = settings_for_log(&cfg);
        assert!(!line.contains("s3cret"), "{line}");
        assert!(line.contains(r#""admin_token":"<set>""#), "{line}");
    }
}

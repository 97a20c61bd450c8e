//! The router's log: a tracing subscriber on standard error (text or JSON lines), filtered by the `log` setting or `RUST_LOG`, installed once per process.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, RouterConfig};

/// The filter used when neither `log` nor `RUST_LOG` gives one: problems only.
const DEFAULT_FILTER: &str = "warn";

/// Whether `filter` is a valid `EnvFilter` directive list (checked with the
/// other settings, so a typo is reported with its field before start-up).
pub(crate) fn check_filter(filter: &str) -> Result<(), String> {
    EnvFilter::builder()
        .parse(filter)
        .map(drop)
        .map_err(|e| format!("{filter:?} is not a log filter: {e}"))
}

/// The filter in force: the `log` setting (flag or TOML), else `RUST_LOG`
/// (when set and valid), else [`DEFAULT_FILTER`].
fn filter_of(setting: Option<&str>, env: Option<&str>) -> String {
    setting
        .or(env.filter(|e| !e.trim().is_empty() && check_filter(e).is_ok()))
        .unwrap_or(DEFAULT_FILTER)
        .to_owned()
}

/// Installs the process's log subscriber. The first router of a process
/// decides (a subscriber is global); returns whether this call installed it.
pub fn install(cfg: &RouterConfig) -> bool {
    let env = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    let filter = EnvFilter::new(filter_of(cfg.log.as_deref(), env.as_deref()));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let installed = match cfg.log_format {
        LogFormat::Text => fmt.try_init(),
        // Fields at the top level of each object, no span context: one flat
        // record per event, as log shippers index them.
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
    installed.is_ok()
}

/// The settings as logged at start-up: every value but the admin token.
pub(crate) fn settings_for_log(cfg: &RouterConfig) -> String {
    let mut v = serde_json::to_value(cfg).unwrap_or_default();
    if let Some(t) = v.get_mut("admin_token").filter(|t| !t.is_null()) {
        *t = serde_json::Value::from("<set>");
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
    fn bad_filters_are_refused() {
        assert!(check_filter("info,ppd_router::request=debug").is_ok());
        assert!(check_filter("info,[[[").is_err());
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

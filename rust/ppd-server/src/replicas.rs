//! Keeps this replica's admin state in step with the other replicas': the task that talks to the state store (shared.rs holds what is said; this module, when and how), applies the others' changes here and stores this one's.

use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;

use futures_util::StreamExt;
use redis::AsyncCommands;

use crate::metrics::OutcomeLabel;
use crate::shared::{
    backoff, store, Change, Envelope, Outgoing, Shared, Sharing, View, COMMAND_TIMEOUT,
    CONNECT_TIMEOUT, PING_EVERY, STORE,
};
use crate::state::AppState;

/// Shares this router's admin changes while it runs: connects, catches up,
/// applies the others' changes and stores its own; reconnects with backoff.
/// Runs until the router stops it (server.rs aborts it at shutdown).
pub(crate) async fn run(st: Arc<AppState>) {
    let Some(shared) = st.shared.as_ref() else {
        return;
    };
    let Some(mut inbox) = shared.take_inbox() else {
        return;
    };
    let mut view = View::default();
    let mut attempt = 0_u32;
    let mut started = false;
    loop {
        let ended = connected(&st, shared, &mut inbox, &mut view, &mut attempt).await;
        let Err(why) = ended else {
            return; // the router stopped
        };
        if !set_link(&st, shared, false, &why) && !started {
            tracing::warn!(error = %why, "state store unreachable at start: serving with this replica's own settings until it is reachable");
        }
        started = true;
        let pause = tokio::time::sleep(backoff(attempt));
        attempt = attempt.saturating_add(1);
        tokio::pin!(pause);
        loop {
            tokio::select! {
                () = &mut pause => break,
                out = inbox.recv() => match out {
                    Some(out) => hold(shared, &mut view, out),
                    None => return,
                },
            }
        }
    }
}

/// Keeps a change for the next connection and says so.
fn hold(shared: &Shared, view: &mut View, out: Outgoing) {
    view.hold(out.change);
    shared.set_pending(view.pending.len());
    let _ = out.reply.send(Sharing::Pending);
}

/// Marks the link up or down, with the log line and the gauge, on a change
/// only; whether it changed.
fn set_link(st: &AppState, shared: &Shared, up: bool, why: &str) -> bool {
    if !shared.set_connected(up, st.now_ms()) {
        return false;
    }
    st.metrics.state_connected.set(i64::from(up));
    if up {
        tracing::info!("state store connected: admin changes are shared");
    } else {
        tracing::warn!(
            error = %why,
            "state store lost: serving on with the last admin view; changes made here are shared when it is back"
        );
    }
    true
}

fn count(st: &AppState, outcome: &'static str) {
    st.metrics
        .state_updates
        .get_or_create(&OutcomeLabel { outcome })
        .inc();
}

/// One connection's life: subscribe, send what is pending, catch up, then
/// serve messages, outgoing changes and pings until something fails
/// (`Err`, the reason) or the router stops (`Ok`).
async fn connected(
    st: &Arc<AppState>,
    shared: &Shared,
    inbox: &mut mpsc::UnboundedReceiver<Outgoing>,
    view: &mut View,
    attempt: &mut u32,
) -> Result<(), String> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(COMMAND_TIMEOUT));
    let mut conn = shared
        .client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|e| e.to_string())?;
    let pubsub = tokio::time::timeout(CONNECT_TIMEOUT, shared.client.get_async_pubsub())
        .await
        .map_err(|_| "subscribing timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let (mut sink, mut messages) = pubsub.split();
    tokio::time::timeout(COMMAND_TIMEOUT, sink.subscribe(&shared.keys.channel))
        .await
        .map_err(|_| "subscribing timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let script = redis::Script::new(STORE);
    let report = redis::Script::new(crate::fleet_rate::REPORT);

    // What was changed here meanwhile goes first, so it is the newest.
    while let Some((subject, change)) = view.pending.pop_first() {
        match store(&mut conn, &script, shared, &change).await {
            Ok(v) => {
                count(st, "sent");
                view.record(Envelope {
                    v,
                    from: shared.replica.clone(),
                    change,
                });
            }
            Err(e) => {
                count(st, "failed");
                view.pending.insert(subject, change);
                shared.set_pending(view.pending.len());
                return Err(e);
            }
        }
    }
    shared.set_pending(0);
    let stored: HashMap<String, String> = conn
        .hgetall(&shared.keys.hash)
        .await
        .map_err(|e| e.to_string())?;
    let envelopes = stored
        .values()
        .filter_map(|text| decoded(st, text))
        .collect();
    for e in view.catch_up(envelopes) {
        apply(st, shared, view, &e);
    }
    set_link(st, shared, true, "");
    *attempt = 0;

    let mut ping = tokio::time::interval(PING_EVERY);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = messages.next() => {
                let Some(msg) = msg else {
                    return Err("the subscription ended".into());
                };
                let Ok(text) = msg.get_payload::<String>() else {
                    count(st, "failed");
                    continue;
                };
                if let Some(e) = decoded(st, &text) {
                    if view.takes(&shared.replica, &e) {
                        apply(st, shared, view, &e);
                        view.record(e);
                    }
                }
            }
            out = inbox.recv() => {
                let Some(out) = out else {
                    return Ok(());
                };
                match store(&mut conn, &script, shared, &out.change).await {
                    Ok(v) => {
                        count(st, "sent");
                        let _ = out.reply.send(Sharing::Stored(v));
                        if view.overtaken(&out.change.subject(), out.applied_at) {
                            // Stored after the other replica's, so it is in force everywhere: here too.
                            reapply(st, shared, view, &out.change);
                        }
                        view.record(Envelope { v, from: shared.replica.clone(), change: out.change });
                    }
                    Err(e) => {
                        count(st, "failed");
                        hold(shared, view, out);
                        return Err(e);
                    }
                }
            }
            _ = ping.tick() => {
                // The rate report is the liveness check too: it fails as a ping would.
                let own = st.qps.lock().rate(st.now_ms());
                let keys = (shared.keys.rate.as_str(), shared.keys.rate_seen.as_str());
                crate::fleet_rate::report(&mut conn, &report, keys, &shared.replica, own, &shared.fleet)
                    .await?;
            }
        }
    }
}

/// An envelope from the store, or `None` (counted and logged) when it is not one.
fn decoded(st: &AppState, text: &str) -> Option<Envelope> {
    match Envelope::decode(text) {
        Ok(e) => Some(e),
        Err(e) => {
            count(st, "failed");
            tracing::warn!(error = %e, "state store: skipped a malformed admin change");
            None
        }
    }
}

/// Applies another replica's change here through the admin API's own functions.
fn apply(st: &Arc<AppState>, shared: &Shared, view: &mut View, e: &Envelope) {
    let by = format!("replica {}", e.from);
    let (done, at) = shared.in_order(|| crate::admin::apply(st, &e.change, &by));
    view.applied_remote(e.change.subject(), at);
    match done {
        Ok(()) => count(st, "applied"),
        Err(why) => {
            count(st, "failed");
            tracing::warn!(error = %why, subject = %e.change.subject(), by, "state store: a shared admin change does not apply here");
        }
    }
}

/// Applies this replica's own change again, after another's overwrote it here.
fn reapply(st: &Arc<AppState>, shared: &Shared, view: &mut View, change: &Change) {
    let by = "admin API (again: stored after another replica's change)";
    let (done, _) = shared.in_order(|| crate::admin::apply(st, change, by));
    view.reapplied(&change.subject());
    if let Err(why) = done {
        tracing::warn!(error = %why, subject = %change.subject(), "state store: an own admin change did not apply again");
    }
}

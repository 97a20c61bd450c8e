//! Admin state shared between router replicas through Redis (`state`): each admin change is stored there and published, and every replica applies the others'.
//!
//! Layout, under the key namespace `state_prefix` (`P`): the hash `P:admin`
//! holds the latest change of each subject (`weights`, `policy`, `table`,
//! `node:URL`) as an envelope `{"v", "from", "change"}`; `P:admin:version`
//! numbers the changes (one `INCR` each, in the order they reach Redis); the
//! channel `P:admin` carries each envelope as it is stored. One Lua script
//! does the three at once, so versions, the hash and the messages agree.
//!
//! A replica subscribes, then on every (re)connect sends the changes made
//! here while Redis was away, then reads the hash and applies what differs
//! from its own view, so one started later or back from an outage catches
//! up. Its own messages come back on the channel and are skipped (`from`, a
//! random id per router); applying never publishes, so nothing loops.
//! Without Redis the replica serves on with the view it has: a change made
//! through its admin API applies here at once, is answered `"shared":
//! {"stored": false, "pending": true}`, and is sent on reconnect, where it
//! gets the newest version and so wins over what others stored meanwhile.
//! Nothing here runs on the request path.

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// An admin change, as the admin API makes it and applies it: on this
/// replica, and through the state store on the others (`admin::apply`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Change {
    Weights {
        w_ttft: f64,
        w_tpot: f64,
    },
    Policy {
        policy: String,
    },
    /// The table's content, not its path: replicas need not share a file system.
    Table {
        source: String,
        table: String,
    },
    NodeAdded {
        url: String,
        role: String,
        zmq_address: Option<String>,
        /// An address each replica binds for the node's KV events: right
        /// for replicas on hosts of their own only.
        kv_events: Option<String>,
        /// The node's own bound publisher, which every replica connects to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kv_events_from: Option<String>,
    },
    NodeRemoved {
        url: String,
    },
}

impl Change {
    /// What the change sets: a later change of the same subject replaces it
    /// (weights, policy and table are one each; nodes one per URL).
    pub(crate) fn subject(&self) -> String {
        match self {
            Change::Weights { .. } => "weights".into(),
            Change::Policy { .. } => "policy".into(),
            Change::Table { .. } => "table".into(),
            Change::NodeAdded { url, .. } | Change::NodeRemoved { url } => {
                format!("node:{}", url.trim_end_matches('/'))
            }
        }
    }
}

/// One stored change: its version, the replica that made it, the change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Envelope {
    pub v: u64,
    pub from: String,
    pub change: Change,
}

impl Envelope {
    pub(crate) fn decode(text: &str) -> Result<Envelope, String> {
        serde_json::from_str(text).map_err(|e| format!("not a shared admin change: {e}"))
    }
}

/// Stores a change as the latest of its subject under the next version and
/// publishes it. KEYS: the hash, the version counter; ARGV: the subject,
/// the replica id, the change (JSON), the channel. Returns the version.
/// The envelope is written here, not in Rust, because only Redis knows the
/// version; its layout is [`Envelope`]'s (the id is hex, the change JSON).
pub(crate) const STORE: &str = r#"
local v = redis.call('INCR', KEYS[2])
local envelope = '{"v":' .. v .. ',"from":"' .. ARGV[2] .. '","change":' .. ARGV[3] .. '}'
redis.call('HSET', KEYS[1], ARGV[1], envelope)
redis.call('PUBLISH', ARGV[4], envelope)
return v
"#;

/// What became of sharing one admin change, for the admin API's answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Sharing {
    /// In the state store under this version; the other replicas apply it.
    Stored(u64),
    /// Applied here only for now; sent when the store is reachable again.
    Pending,
}

impl Sharing {
    pub(crate) fn to_json(&self) -> serde_json::Value {
        match self {
            Sharing::Stored(v) => serde_json::json!({"stored": true, "version": v}),
            Sharing::Pending => serde_json::json!({
                "stored": false, "pending": true,
                "message": "the state store is unreachable: the change is in force on this replica \
                            and is shared with the others when the store is back",
            }),
        }
    }
}

/// A change for the store, with where to say what became of it.
pub(crate) struct Outgoing {
    pub change: Change,
    /// When it was applied here ([`Shared::in_order`]).
    pub applied_at: u64,
    pub reply: oneshot::Sender<Sharing>,
}

/// Whether the store is reachable, and since when (for `/health`).
struct Link {
    connected: AtomicBool,
    since_ms: AtomicU64,
}

/// The replica's side of the shared state: built with the router, run by [`run`].
pub(crate) struct Shared {
    pub client: redis::Client,
    pub keys: Keys,
    /// This router's id in envelopes (`from`), fresh at every start.
    pub replica: String,
    outbox: mpsc::UnboundedSender<Outgoing>,
    /// Taken by [`run`] (one per router).
    inbox: Mutex<Option<mpsc::UnboundedReceiver<Outgoing>>>,
    link: Link,
    /// Changes made here that the store does not have yet.
    pending: AtomicUsize,
    /// Numbers every change applied here, local or another replica's, in the
    /// order they were applied (see [`Shared::in_order`]).
    order: Mutex<u64>,
    /// The other replicas' conversation rates, as last read from the store.
    pub fleet: crate::fleet_rate::FleetRate,
}

/// The names of this router's keys and channel.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Keys {
    pub hash: String,
    pub version: String,
    pub channel: String,
    /// The replicas' conversation rates and when each last reported (fleet_rate.rs).
    pub rate: String,
    pub rate_seen: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Keys {
        Keys {
            hash: format!("{prefix}:admin"),
            version: format!("{prefix}:admin:version"),
            channel: format!("{prefix}:admin"),
            rate: format!("{prefix}:rate"),
            rate_seen: format!("{prefix}:rate:seen"),
        }
    }
}

/// How long a replica waits to (re)connect, and for each command.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub(crate) const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a connected replica checks that the store still answers (a
/// silent network loss leaves the subscription open but dead); the check is
/// its rate report (fleet_rate.rs).
pub(crate) const PING_EVERY: Duration = Duration::from_secs(1);
/// How long an admin answer waits for the store before saying "pending".
const ANSWER_WAIT: Duration = Duration::from_secs(2);
/// Waits between reconnect attempts: doubling from the first to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The wait before reconnect attempt `attempt` (0-based).
pub(crate) fn backoff(attempt: u32) -> Duration {
    BACKOFF_FIRST
        .saturating_mul(1 << attempt.min(16))
        .min(BACKOFF_MAX)
}

impl Shared {
    /// The shared state of a router with `state_url` (validated with the
    /// settings); a `rediss://` store's certificate chains to `ca_pem`'s CAs
    /// when given, else to the public web roots.
    pub(crate) fn new(
        url: &str,
        ca_pem: Option<Vec<u8>>,
        prefix: &str,
        now_ms: u64,
    ) -> Result<Shared, String> {
        let client = match ca_pem {
            Some(pem) => redis::Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            ),
            None => redis::Client::open(url),
        }
        .map_err(|e| e.to_string())?;
        let (outbox, inbox) = mpsc::unbounded_channel();
        Ok(Shared {
            client,
            keys: Keys::new(prefix),
            replica: uuid::Uuid::new_v4().simple().to_string(),
            outbox,
            inbox: Mutex::new(Some(inbox)),
            link: Link {
                connected: AtomicBool::new(false),
                since_ms: AtomicU64::new(now_ms),
            },
            pending: AtomicUsize::new(0),
            order: Mutex::new(0),
            fleet: crate::fleet_rate::FleetRate::default(),
        })
    }

    /// Applies a change with `apply`, numbered in the order of every change
    /// applied here. Between a change through the admin API and its storing,
    /// another replica's change of the same subject may be applied here; the
    /// numbers tell, and the local one, then stored as the newest, is applied
    /// again so that this replica agrees with the others.
    pub(crate) fn in_order<T>(&self, apply: impl FnOnce() -> T) -> (T, u64) {
        let mut n = self.order.lock();
        let done = apply();
        *n += 1;
        (done, *n)
    }

    /// Hands a change that is in force here to the store; says whether the
    /// store has it (waits for it at most [`ANSWER_WAIT`]). A change the
    /// store cannot take now is kept and sent on reconnect.
    pub(crate) async fn share(&self, change: Change, applied_at: u64) -> Sharing {
        let (reply, answer) = oneshot::channel();
        let out = Outgoing {
            change,
            applied_at,
            reply,
        };
        if self.outbox.send(out).is_err() {
            return Sharing::Pending;
        }
        match tokio::time::timeout(ANSWER_WAIT, answer).await {
            Ok(Ok(sharing)) => sharing,
            _ => Sharing::Pending,
        }
    }

    /// The outgoing changes, for the one task that shares them (once).
    pub(crate) fn take_inbox(&self) -> Option<mpsc::UnboundedReceiver<Outgoing>> {
        self.inbox.lock().take()
    }

    /// Marks the store reachable or not at `now_ms`; whether that changed.
    pub(crate) fn set_connected(&self, up: bool, now_ms: u64) -> bool {
        if self.link.connected.swap(up, Ordering::Relaxed) == up {
            return false;
        }
        self.link.since_ms.store(now_ms, Ordering::Relaxed);
        true
    }

    /// How many changes made here the store lacks.
    pub(crate) fn set_pending(&self, n: usize) {
        self.pending.store(n, Ordering::Relaxed);
    }

    /// `{"backend", "connected", "since_s", "pending", "other_replicas",
    /// "other_replicas_qps"}` for `/health`.
    pub(crate) fn health(&self, now_ms: u64) -> serde_json::Value {
        let since = now_ms.saturating_sub(self.link.since_ms.load(Ordering::Relaxed));
        serde_json::json!({
            "backend": "redis",
            "connected": self.link.connected.load(Ordering::Relaxed),
            "since_s": since as f64 / 1000.0,
            "pending": self.pending.load(Ordering::Relaxed),
            "other_replicas": self.fleet.others(),
            "other_replicas_qps": self.fleet.others_rate(),
        })
    }
}

/// What this replica knows of the store: the envelope it last applied or
/// stored per subject, and the changes made here that the store lacks.
#[derive(Default)]
pub(crate) struct View {
    last: HashMap<String, (u64, Change)>,
    pub pending: BTreeMap<String, Change>,
    /// When another replica's change of each subject was last applied here
    /// ([`Shared::in_order`]).
    remote_at: HashMap<String, u64>,
}

impl View {
    /// Whether a published envelope is to be applied here: not this
    /// replica's own, and newer than what it has of that subject.
    pub(crate) fn takes(&self, replica: &str, e: &Envelope) -> bool {
        e.from != replica
            && self
                .last
                .get(&e.change.subject())
                .is_none_or(|(v, _)| e.v > *v)
    }

    /// Forgets that another replica's change of `subject` was applied here
    /// (this replica's own is in force again).
    pub(crate) fn reapplied(&mut self, subject: &str) {
        self.remote_at.remove(subject);
    }

    /// Records that another replica's change of `subject` was applied here at `at`.
    pub(crate) fn applied_remote(&mut self, subject: String, at: u64) {
        self.remote_at.insert(subject, at);
    }

    /// Whether a change applied here at `applied_at` was overwritten since by
    /// another replica's change of the same subject.
    pub(crate) fn overtaken(&self, subject: &str, applied_at: u64) -> bool {
        self.remote_at
            .get(subject)
            .is_some_and(|at| *at > applied_at)
    }

    /// Records an envelope as applied or stored here.
    pub(crate) fn record(&mut self, e: Envelope) {
        self.last.insert(e.change.subject(), (e.v, e.change));
    }

    /// Keeps a change made here for the store; a later one of the same
    /// subject replaces it.
    pub(crate) fn hold(&mut self, change: Change) {
        self.pending.insert(change.subject(), change);
    }

    /// After a (re)connect, with the whole hash read: the changes to apply
    /// here (those that differ from what this replica has), oldest first.
    /// The view becomes the hash's, so that versions restarted by a store
    /// that lost its data (a restart without persistence) count again.
    pub(crate) fn catch_up(&mut self, stored: Vec<Envelope>) -> Vec<Envelope> {
        let mut stored = stored;
        stored.sort_by_key(|e| e.v);
        let differ: Vec<Envelope> = stored
            .iter()
            .filter(|e| {
                self.last
                    .get(&e.change.subject())
                    .is_none_or(|(_, c)| *c != e.change)
            })
            .cloned()
            .collect();
        self.last = stored
            .into_iter()
            .map(|e| (e.change.subject(), (e.v, e.change)))
            .collect();
        differ
    }
}

/// Runs the store script ([`STORE`], `redis::Script::new(STORE)`) for one change; its version.
pub(crate) async fn store(
    conn: &mut redis::aio::MultiplexedConnection,
    script: &redis::Script,
    shared: &Shared,
    change: &Change,
) -> Result<u64, String> {
    let json = serde_json::to_string(change).map_err(|e| e.to_string())?;
    script
        .key(&shared.keys.hash)
        .key(&shared.keys.version)
        .arg(change.subject())
        .arg(&shared.replica)
        .arg(json)
        .arg(&shared.keys.channel)
        .invoke_async(conn)
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(v: u64, from: &str, w_tpot: f64) -> Envelope {
        Envelope {
            v,
            from: from.into(),
            change: Change::Weights {
                w_ttft: 1.0,
                w_tpot,
            },
        }
    }

    /// The envelope as the Lua script writes it, from the change's JSON.
    fn as_the_script_writes(v: u64, from: &str, change: &Change) -> String {
        let json = serde_json::to_string(change).unwrap();
        format!(r#"{{"v":{v},"from":"{from}","change":{json}}}"#)
    }

    #[test]
    fn an_envelope_written_by_the_script_decodes_to_the_change() {
        let changes = [
            Change::Weights {
                w_ttft: 1.0,
                w_tpot: 3.5,
            },
            Change::Policy {
                policy: "fraction:0.25".into(),
            },
            Change::Table {
                source: "tables/t.json".into(),
                table: "{\"schema\": \"ppd-table/1\"}".into(),
            },
            Change::NodeAdded {
                url: "http://d1:8200".into(),
                role: "pD".into(),
                zmq_address: None,
                kv_events: Some("tcp://d1:7200".into()),
                kv_events_from: None,
            },
            Change::NodeRemoved {
                url: "http://d1:8200".into(),
            },
        ];
        for c in changes {
            let e = Envelope::decode(&as_the_script_writes(7, "abc", &c)).unwrap();
            assert_eq!(
                e,
                Envelope {
                    v: 7,
                    from: "abc".into(),
                    change: c
                }
            );
        }
    }

    #[test]
    fn a_malformed_or_unknown_change_is_refused_with_a_reason() {
        for text in [
            "not json",
            r#"{"v":1,"from":"x","change":{"kind":"teleport"}}"#,
            r#"{"v":1,"from":"x","change":{"kind":"weights","w_ttft":1}}"#,
            r#"{"from":"x","change":{"kind":"policy","policy":"pd"}}"#,
        ] {
            let e = Envelope::decode(text).unwrap_err();
            assert!(e.starts_with("not a shared admin change"), "{e}");
        }
    }

    #[test]
    fn subjects_are_one_per_kind_and_one_per_node_url() {
        let add = Change::NodeAdded {
            url: "http://d1:8200/".into(),
            role: "D".into(),
            zmq_address: None,
            kv_events: None,
            kv_events_from: Some("tcp://d1:7200".into()),
        };
        let remove = Change::NodeRemoved {
            url: "http://d1:8200".into(),
        };
        // Adding and removing the same node replace each other.
        assert_eq!(add.subject(), remove.subject());
        assert_eq!(add.subject(), "node:http://d1:8200");
        let policy = Change::Policy {
            policy: "pd".into(),
        };
        assert_eq!(policy.subject(), "policy");
        assert_eq!(weights(1, "a", 1.0).change.subject(), "weights");
    }

    #[test]
    fn a_replicas_own_echo_is_skipped() {
        let view = View::default();
        assert!(!view.takes("me", &weights(3, "me", 2.0)));
        assert!(view.takes("me", &weights(3, "other", 2.0)));
    }

    #[test]
    fn only_a_newer_version_of_a_subject_is_taken() {
        let mut view = View::default();
        view.record(weights(5, "other", 2.0));
        assert!(!view.takes("me", &weights(5, "other", 2.0)));
        assert!(!view.takes("me", &weights(4, "other", 9.0)));
        assert!(view.takes("me", &weights(6, "other", 9.0)));
        // Another subject has its own versions.
        let policy = Envelope {
            v: 2,
            from: "other".into(),
            change: Change::Policy {
                policy: "pd".into(),
            },
        };
        assert!(view.takes("me", &policy));
    }

    #[test]
    fn catching_up_applies_what_differs_oldest_first_and_adopts_the_stores_versions() {
        let mut view = View::default();
        view.record(weights(9, "me", 2.0));
        let policy = Envelope {
            v: 3,
            from: "other".into(),
            change: Change::Policy {
                policy: "pd".into(),
            },
        };
        // The store restarted empty and got two changes: the same weights
        // (under a lower version) and a policy.
        let todo = view.catch_up(vec![weights(4, "other", 2.0), policy.clone()]);
        assert_eq!(todo, vec![policy]);
        // Versions are the store's now: a weights change at 5 counts.
        assert!(view.takes("me", &weights(5, "other", 3.0)));
    }

    #[test]
    fn catching_up_with_an_empty_store_forgets_old_versions() {
        let mut view = View::default();
        view.record(weights(9, "other", 2.0));
        assert!(view.catch_up(Vec::new()).is_empty());
        assert!(view.takes("me", &weights(1, "other", 4.0)));
    }

    #[test]
    fn a_later_pending_change_of_a_subject_replaces_the_earlier() {
        let mut view = View::default();
        view.hold(weights(0, "me", 2.0).change);
        view.hold(weights(0, "me", 3.0).change);
        view.hold(Change::Policy {
            policy: "pd".into(),
        });
        assert_eq!(view.pending.len(), 2);
        assert_eq!(view.pending["weights"], weights(0, "me", 3.0).change);
    }

    #[test]
    fn a_local_change_overwritten_here_by_another_replicas_is_known_as_overtaken() {
        let mut view = View::default();
        // Applied here at 3; another replica's weights were applied at 5.
        view.applied_remote("weights".into(), 5);
        assert!(view.overtaken("weights", 3));
        // Applied after it, or another subject: not overtaken.
        assert!(!view.overtaken("weights", 6));
        assert!(!view.overtaken("policy", 3));
    }

    #[test]
    fn changes_applied_in_order_are_numbered_in_that_order() {
        let shared = Shared::new("redis://127.0.0.1:1", None, "t", 0).unwrap();
        let (a, first) = shared.in_order(|| "a");
        let (b, second) = shared.in_order(|| "b");
        assert_eq!((a, b), ("a", "b"));
        assert!(second > first);
    }

    #[test]
    fn backoff_doubles_up_to_its_ceiling() {
        assert_eq!(backoff(0), BACKOFF_FIRST);
        assert_eq!(backoff(1), BACKOFF_FIRST * 2);
        assert_eq!(backoff(30), BACKOFF_MAX);
    }

    #[test]
    fn keys_live_under_the_prefix() {
        let k = Keys::new("blue");
        assert_eq!(
            (k.hash.as_str(), k.version.as_str(), k.channel.as_str()),
            ("blue:admin", "blue:admin:version", "blue:admin")
        );
        assert_eq!(
            (k.rate.as_str(), k.rate_seen.as_str()),
            ("blue:rate", "blue:rate:seen")
        );
    }
}

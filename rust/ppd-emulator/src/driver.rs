//! Drives one engine model against the wall clock: virtual ms = ms since start.
//!
//! The task sleeps until the model's next event and then advances the model to
//! that event's *virtual* time, so timer slack never accumulates: events are
//! emitted late by at most one wake-up's jitter, which [`Lag`] measures.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ahash::AHashMap;
use ppd_core::residency::KvEvent;
use ppd_model::engine::Hold;
use ppd_model::{Engine, Event, Finish, Profile, Snapshot, Submit, SubmitError, Usage};
use tokio::sync::{mpsc, oneshot};

/// What a request's handler receives.
#[derive(Debug)]
pub enum Out {
    Rejected(SubmitError),
    /// `t`: the model's time of the event (ms since the node started).
    Token {
        index: u32,
        t: f64,
    },
    /// `held_blocks`: the block ids kept for another node to pull (P's
    /// RemoteDecode prefill, or a bidirectional D's pin), covering `held_tokens`.
    Finished {
        usage: Usage,
        finish: Finish,
        held_blocks: Vec<u32>,
        held_tokens: u32,
        t: f64,
    },
}

pub enum Cmd {
    Submit {
        req: Submit,
        sink: mpsc::UnboundedSender<(u64, Out)>,
    },
    Abort(u64),
    TakeHold {
        id: u64,
        reply: oneshot::Sender<Option<Hold>>,
    },
}

/// How late events reach handlers relative to the model's time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lag {
    pub events: u64,
    pub sum_ms: f64,
    pub max_ms: f64,
}

#[derive(Default)]
pub struct Shared {
    pub snapshot: Mutex<Snapshot>,
    pub lag: Mutex<Lag>,
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Cmd>,
    pub shared: Arc<Shared>,
}

impl EngineHandle {
    /// Starts the engine; with `kv_events`, each step's KV events go there.
    pub fn start(
        profile: &Profile,
        kv_events: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    ) -> EngineHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::default());
        let mut engine = Engine::new(profile, true);
        if kv_events.is_some() {
            engine.enable_kv_events();
        }
        tokio::spawn(run(engine, rx, Arc::clone(&shared), kv_events));
        EngineHandle { tx, shared }
    }

    /// Submits a request's engine requests (one per choice); their events
    /// arrive on one channel, each with its engine request's id.
    pub fn submit_all(&self, reqs: Vec<Submit>) -> mpsc::UnboundedReceiver<(u64, Out)> {
        let (sink, rx) = mpsc::unbounded_channel();
        // A stopped engine drops the sinks: the handler sees a closed channel.
        for req in reqs {
            let _ = self.tx.send(Cmd::Submit {
                req,
                sink: sink.clone(),
            });
        }
        rx
    }

    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Cmd::Abort(id));
    }

    pub async fn take_hold(&self, id: u64) -> Option<Hold> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::TakeHold { id, reply }).ok()?;
        rx.await.ok().flatten()
    }

    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot.lock().map(|s| *s).unwrap_or_default()
    }

    pub fn lag(&self) -> Lag {
        self.shared.lag.lock().map(|s| *s).unwrap_or_default()
    }
}

async fn run(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    shared: Arc<Shared>,
    kv_events: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
) {
    let start = Instant::now();
    let vnow = |at: Instant| at.duration_since(start).as_secs_f64() * 1000.0;
    let mut sinks: AHashMap<u64, mpsc::UnboundedSender<(u64, Out)>> = AHashMap::new();
    let mut ev: Vec<Event> = Vec::with_capacity(1024);
    let mut lag = Lag::default();
    loop {
        let next = engine.next_event_time();
        let wake = next.map(|t| start + Duration::from_secs_f64(t.max(0.0) / 1000.0));
        tokio::select! {
            biased;
            cmd = rx.recv() => {
                let Some(cmd) = cmd else { break };
                let now = vnow(Instant::now()).max(engine.now());
                match cmd {
                    Cmd::Submit { req, sink } => {
                        let id = req.id;
                        match engine.submit(now, req, &mut ev) {
                            Ok(()) => { sinks.insert(id, sink); }
                            Err(e) => { let _ = sink.send((id, Out::Rejected(e))); }
                        }
                    }
                    Cmd::Abort(id) => {
                        engine.abort(now, id, &mut ev);
                        sinks.remove(&id);
                    }
                    Cmd::TakeHold { id, reply } => {
                        let _ = reply.send(engine.take_hold(now, id, &mut ev));
                    }
                }
            }
            _ = sleep_until(wake), if wake.is_some() => {
                if let Some(t) = next {
                    engine.advance(t, &mut ev);
                }
            }
        }
        if !ev.is_empty() {
            dispatch(
                &mut engine,
                &mut ev,
                &mut sinks,
                &mut lag,
                vnow(Instant::now()),
            );
        }
        if let Some(tx) = &kv_events {
            let mut batch = Vec::new();
            engine.take_kv_events(&mut batch);
            if !batch.is_empty() {
                let _ = tx.send(batch);
            }
        }
        if let Ok(mut s) = shared.snapshot.lock() {
            *s = engine.snapshot();
        }
        if let Ok(mut l) = shared.lag.lock() {
            *l = lag;
        }
    }
}

fn dispatch(
    engine: &mut Engine,
    ev: &mut Vec<Event>,
    sinks: &mut AHashMap<u64, mpsc::UnboundedSender<(u64, Out)>>,
    lag: &mut Lag,
    wall: f64,
) {
    for e in ev.drain(..) {
        let (id, t, out) = match e {
            Event::Token { id, index, t } => (id, t, Some(Out::Token { index, t })),
            Event::Finished {
                id,
                t,
                finish,
                usage,
            } => {
                let (held_blocks, held_tokens) = engine
                    .holds(id)
                    .map(|h| (h.blocks.clone(), h.tokens))
                    .unwrap_or_default();
                (
                    id,
                    t,
                    Some(Out::Finished {
                        usage,
                        finish,
                        held_blocks,
                        held_tokens,
                        t,
                    }),
                )
            }
            Event::TransferDone { id, t } | Event::LeaseExpired { id, t } => (id, t, None),
        };
        let late = (wall - t).max(0.0);
        lag.events += 1;
        lag.sum_ms += late;
        lag.max_ms = lag.max_ms.max(late);
        let Some(out) = out else { continue };
        let done = matches!(out, Out::Finished { .. });
        if let Some(s) = sinks.get(&id) {
            if s.send((id, out)).is_err() {
                // The handler is gone: stop computing for it.
                sinks.remove(&id);
                engine.abort(engine.now(), id, &mut Vec::new());
                continue;
            }
        }
        if done {
            sinks.remove(&id);
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

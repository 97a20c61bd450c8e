//! Criterion benches of the per-request core work: decide (alone, and with the residency lookup of a Turn 2
//! prompt in a node's block index), and session lookup + update.

use criterion::{criterion_group, criterion_main, Criterion};
use ppd_core::catalog::{paper_workloads, PAPER_QPS};
use ppd_core::identity::{conversation_id, features, IdHints};
use ppd_core::request::parse_request;
use ppd_core::residency::{BlockIndex, KvEvent};
use ppd_core::session::{NodeId, SessionConfig, SessionTable};
use ppd_core::table::{Cell, Measurement, Table};
use ppd_core::tokens::WordRule;
use ppd_core::{
    CostModel, DecisionEngine, DecisionInput, LiveView, NodeView, PolicyKind, Residency, Weights,
};
use std::hint::black_box;

fn table() -> Table {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tables/h100-llama3.1-8b-2P2pD.json"
    ));
    if let Ok(t) = text {
        if let Ok(t) = Table::from_json(&t, "2P2pD") {
            return t;
        }
    }
    // Fallback when the shipped table is absent: a full synthetic grid.
    let m = |a, b| Measurement {
        ttft_ms: a,
        tpot_ms: b,
        n: 10,
    };
    let mut doc: ppd_core::table::TableDoc = serde_json::from_str(&format!(
        r#"{{"schema":"ppd-table/1","axes":{{"context_bins":[512,4096],"workloads":{},"qps":{:?}}},"cells":[]}}"#,
        serde_json::to_string(&paper_workloads()).unwrap(),
        PAPER_QPS
    ))
    .unwrap();
    for c in ["small", "large"] {
        for w in paper_workloads() {
            for q in PAPER_QPS {
                doc.cells.push(Cell {
                    context: c.into(),
                    workload: w.name.clone(),
                    qps: q,
                    x0: m(100.0, 8.0),
                    x1: m(60.0, 9.0),
                });
            }
        }
    }
    Table::from_doc(doc, "synthetic").unwrap()
}

fn bench(c: &mut Criterion) {
    let engine = DecisionEngine::new(table(), PolicyKind::Ppd, Weights::default());
    let mut i = 0u32;
    c.bench_function("decide_ppd", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let input = DecisionInput {
                conv_hash: u64::from(i),
                ..DecisionInput::turn(
                    2,
                    32 + (i % 900),
                    64 + (i % 500),
                    300 + (i % 8000),
                    f64::from(i % 21),
                )
            };
            black_box(engine.decide(black_box(&input)).unwrap())
        })
    });

    // A node holding 1,000 conversations of 2,048 tokens (128 blocks of 16 each, 128,000 blocks), and the
    // next turn of one of them: 2,048 cached tokens and 64 new ones. One iteration chains the prompt's
    // blocks, finds the resident prefix, and decides with it.
    let (index, prompts) = node_index(1_000, 2_048, 16);
    let mut scratch = Vec::new();
    let mut j = 0usize;
    c.bench_function("decide_with_residency", |b| {
        b.iter(|| {
            j = (j + 7) % prompts.len();
            let tokens = &prompts[j];
            let cached = index.cached_prefix_tokens(black_box(tokens), &mut scratch);
            let input = DecisionInput {
                conv_hash: j as u64,
                residency: Residency::Cached(cached),
                ..DecisionInput::turn(2, 64, 128, 2_048, 4.0)
            };
            black_box(engine.decide(black_box(&input)).unwrap())
        })
    });

    // ppd-live: the same decision with the cost model's three-path forecast
    // (and its corrections looked up) on a busy D and a queued P; by
    // Equation 1, and in SLO mode (goodput, D's TPOT record, the deadlines
    // priced in requests).
    let model = || {
        let model = CostModel::new(ppd_core::profiles::default_profile());
        for node in 0..8 {
            model
                .corrections
                .observe_ttft(node, ppd_core::Path::Local, 64, 50.0, 60.0);
            for k in 0..8 {
                model
                    .corrections
                    .observe_tpot(node, 10.0, 11.0 + f64::from(k));
            }
        }
        std::sync::Arc::new(model)
    };
    let live_engine = DecisionEngine::new(table(), PolicyKind::Live, Weights::default());
    live_engine.set_cost_model(model());
    let slo_engine = DecisionEngine::new(table(), PolicyKind::Live, Weights::default());
    slo_engine.set_cost_model(model());
    slo_engine.set_slo(Some(ppd_core::policy::Slo {
        ttft_ms: 150.0,
        tpot_ms: 15.0,
    }));
    // Four decodes near their deadline: the deadline term weighs each path.
    let mut at_risk = ppd_core::cost::AtRisk::default();
    for i in 0..4u32 {
        at_risk.offer(ppd_core::cost::Deadline {
            time_left_ms: 5_000.0 + f64::from(i) * 100.0,
            remaining_tokens: 400,
        });
    }
    for (name, engine) in [
        ("decide_ppd_live", &live_engine),
        ("decide_ppd_live_slo", &slo_engine),
    ] {
        let mut l = 0u32;
        c.bench_function(name, |b| {
            b.iter(|| {
                l = l.wrapping_add(1);
                black_box(engine.decide(black_box(&live_input(l, at_risk))).unwrap())
            })
        });
    }

    let sessions = SessionTable::new(SessionConfig::default()).unwrap();
    let ids: Vec<String> = (0..100_000).map(|i| format!("{i:032x}")).collect();
    for id in &ids {
        sessions.update(id, 0, |s| s.turns = 1);
    }
    let d = NodeId::new(3).unwrap();
    let mut k = 0usize;
    c.bench_function("session_get_and_update", |b| {
        b.iter(|| {
            k = (k + 7919) % ids.len();
            let id = &ids[k];
            let s = sessions.get(id, 1);
            black_box(s);
            sessions.update(id, 2, |s| {
                s.turns += 1;
                s.d = Some(d);
                s.record_usage(300, 100, 2);
            })
        })
    });

    let body = r#"{"model":"m","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Tell me about the history of the printing press in Europe."},{"role":"assistant","content":"The printing press was developed by Gutenberg around 1440, and it spread quickly across the continent."},{"role":"user","content":"And what happened next?"}],"max_tokens":128,"stream":true}"#;
    c.bench_function("identify_and_features", |b| {
        b.iter(|| {
            let v = parse_request(black_box(body)).unwrap();
            let id = conversation_id(IdHints::default(), &v).unwrap();
            let f = features(&v, &WordRule, None, 128).unwrap();
            black_box((id, f))
        })
    });
}

/// `conversations` stored prompts of `tokens` tokens in one node's index, and each one's next prompt
/// (the same tokens and 64 new ones).
pub fn node_index(conversations: u64, tokens: u64, block_size: u32) -> (BlockIndex, Vec<Vec<u64>>) {
    let mut index = BlockIndex::default();
    let mut prompts = Vec::new();
    for c in 0..conversations {
        let toks: Vec<u64> = (0..tokens).map(|t| (c << 20) | t).collect();
        let blocks = tokens / u64::from(block_size);
        let hashes: Vec<u64> = (0..blocks).map(|b| (c << 32) | (b + 1)).collect();
        index.apply(&KvEvent::Stored {
            hashes,
            parent: None,
            tokens: toks[..(blocks * u64::from(block_size)) as usize].to_vec(),
            block_size,
        });
        let mut next = toks;
        next.extend((0..64).map(|t| (c << 20) | (1 << 19) | t));
        prompts.push(next);
    }
    (index, prompts)
}

/// A Turn 2 with a live view that varies from call to call: D's batch and
/// P's queue, so the forecast cannot be hoisted.
fn live_input(l: u32, at_risk: ppd_core::cost::AtRisk) -> DecisionInput {
    let d = NodeView {
        node: l % 4,
        running: 40 + l % 80,
        decode_ctx_tokens: 200_000,
        queued_prefill_tokens: u64::from(l % 3) * 2_000,
        waiting: l % 3,
        ..NodeView::default()
    };
    let p = NodeView {
        node: 4 + l % 4,
        queued_prefill_tokens: u64::from(l % 5) * 4_000,
        waiting: l % 5,
        ..NodeView::default()
    };
    DecisionInput {
        conv_hash: u64::from(l),
        pull_ready: true,
        live: Some(LiveView {
            d,
            p: Some(p),
            d_cached: 2_048,
            p_cached: 0,
            mean_out_tokens: 200.0,
            pull_asks_pin: false,
            at_risk,
        }),
        ..DecisionInput::turn(2, 32 + (l % 900), 128, 2_048, 4.0)
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

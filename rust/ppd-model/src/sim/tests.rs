use super::*;

pub(super) fn profile() -> Profile {
    let mut p = Profile::test_profile();
    p.kv_blocks = 20_000;
    p.max_num_seqs = 256;
    p.max_num_batched_tokens = 8192;
    p
}

pub(super) fn run(dep: &str, policy: &str, wl: &str, qps: f64) -> SimResult {
    simulate(&SimConfig::new(dep, policy, wl, qps), &profile(), None).unwrap()
}

#[test]
fn every_conversation_completes_both_turns_at_low_load() {
    let r = run("2P2pD", "local", "small_mid_bal", 2.0);
    assert!(r.turn1.count > 5);
    assert_eq!(r.turn1.count, r.turn2plus.count);
    assert_eq!(r.success_rate, 1.0);
    assert_eq!(r.local_share, 1.0);
    assert!(r.turn2plus.avg_tpot_ms > 0.0 && r.turn1.avg_ttft_ms > 0.0);
}

#[test]
fn local_turn2_beats_pd_turn2_ttft_for_decode_heavy_work() {
    // The paper's central finding: x = 1 cuts Turn-2 TTFT (no re-prefill, no transfer).
    let x0 = run("2P_2D", "local", "large_tiny", 4.0);
    let x1 = run("2P_2pD", "local", "large_tiny", 4.0);
    assert_eq!(x0.local_share, 0.0, "decode-only D nodes never go local");
    assert_eq!(x1.local_share, 1.0);
    assert!(
        x1.turn2plus.avg_ttft_ms < x0.turn2plus.avg_ttft_ms,
        "{} vs {}",
        x1.turn2plus.avg_ttft_ms,
        x0.turn2plus.avg_ttft_ms
    );
}

#[test]
fn partial_configurations_route_by_node_capability() {
    let r = run("1P_1D_2pD", "local", "small_tiny", 8.0);
    assert!(
        r.local_share > 0.4 && r.local_share < 0.9,
        "{}",
        r.local_share
    );
    let pd = run("2P2pD", "pd", "small_tiny", 4.0);
    assert_eq!(pd.local_share, 0.0);
    let half = run("2P2pD", "fraction:0.5", "small_tiny", 8.0);
    assert!(
        half.local_share > 0.2 && half.local_share < 0.8,
        "{}",
        half.local_share
    );
}

#[test]
fn replicas_serve_everything_in_4r_and_part_in_hybrids() {
    let r = run("4R", "replica", "small_tiny", 4.0);
    assert_eq!(r.success_rate, 1.0);
    assert_eq!(r.local_share, 0.0);
    let h = run("1R_1P_2D", "local", "small_tiny", 4.0);
    assert_eq!(h.success_rate, 1.0);
    // Without a P/D pipeline any policy falls back to replicas.
    assert_eq!(run("4R", "local", "small_tiny", 2.0).success_rate, 1.0);
}

#[test]
fn the_same_seed_gives_the_same_result_and_another_seed_differs() {
    let mut c = SimConfig::new("2P2pD", "local", "large_mid_paste", 6.0);
    let a = simulate(&c, &profile(), None).unwrap();
    let b = simulate(&c, &profile(), None).unwrap();
    assert_eq!(a, b);
    c.seed = 7;
    let d = simulate(&c, &profile(), None).unwrap();
    assert_ne!(a, d);
}

#[test]
fn a_slower_link_raises_pd_turn2_ttft_but_not_local() {
    let mut fast = profile();
    fast.link.full_prompt_transfer = true;
    let mut slow = fast.clone();
    slow.link.gbps = 1.0;
    let c0 = SimConfig::new("1P_3D", "local", "large_tiny", 1.0);
    let c1 = SimConfig::new("1P_3pD", "local", "large_tiny", 1.0);
    let fast0 = simulate(&c0, &fast, None).unwrap();
    let slow0 = simulate(&c0, &slow, None).unwrap();
    let fast1 = simulate(&c1, &fast, None).unwrap();
    let slow1 = simulate(&c1, &slow, None).unwrap();
    assert!(slow0.turn2plus.avg_ttft_ms > fast0.turn2plus.avg_ttft_ms + 100.0);
    assert!(
        (slow1.turn2plus.avg_ttft_ms - fast1.turn2plus.avg_ttft_ms).abs() < 1.0,
        "local Turn 2 moves no KV"
    );
    // A NIXL-style pull moves only what D lacks: Turn 2 on the same D is nearly unaffected.
    let mut nixl_slow = slow.clone();
    nixl_slow.link.full_prompt_transfer = false;
    let n0 = simulate(&c0, &nixl_slow, None).unwrap();
    assert!(n0.turn2plus.avg_ttft_ms < slow0.turn2plus.avg_ttft_ms - 100.0);
}

#[test]
fn overload_with_a_short_timeout_fails_requests() {
    let mut c = SimConfig::new("3P_1D", "local", "large_very_long_gen", 20.0);
    c.timeout_s = 5.0;
    let r = simulate(&c, &profile(), None).unwrap();
    assert!(r.success_rate < 1.0 && r.failed_requests > 0);
    assert!(r.success_rate >= 0.0);
}

#[test]
fn the_harness_cap_queues_conversations_into_turn1_ttft() {
    let mut p = profile();
    let c = SimConfig::new("4R", "replica", "large_short_gen", 8.0);
    let free = simulate(&c, &p, None).unwrap();
    p.harness.max_conversations = 4;
    let capped = simulate(&c, &p, None).unwrap();
    assert!(capped.turn1.avg_ttft_ms > 2.0 * free.turn1.avg_ttft_ms);
}

#[test]
fn bad_configs_are_errors_not_panics() {
    let p = profile();
    for c in [
        SimConfig::new("2X", "local", "small_tiny", 1.0),
        SimConfig::new("2P2pD", "nope", "small_tiny", 1.0),
        SimConfig::new("2P2pD", "local", "medium_tiny", 1.0),
        SimConfig::new("2P2pD", "local", "small_tiny", 0.0),
        SimConfig::new("2P2pD", "local", "small_tiny", f64::NAN),
        SimConfig::new("2P2pD", "ppd", "small_tiny", 1.0),
        SimConfig::new("2P2pD", "replica", "small_tiny", 1.0),
        SimConfig::new("2D", "local", "small_tiny", 1.0),
        SimConfig {
            routers: 0,
            ..SimConfig::new("2P2pD", "local", "small_tiny", 1.0)
        },
        SimConfig {
            routers: 65,
            ..SimConfig::new("2P2pD", "local", "small_tiny", 1.0)
        },
        SimConfig {
            view_delay_s: -1.0,
            ..SimConfig::new("2P2pD", "local", "small_tiny", 1.0)
        },
    ] {
        assert!(simulate(&c, &p, None).is_err(), "{c:?}");
    }
}

#[test]
fn the_grid_runner_keeps_point_order() {
    let pts: Vec<SimConfig> = [1.0, 2.0, 4.0]
        .iter()
        .map(|&q| SimConfig::new("2P2pD", "local", "small_tiny", q))
        .collect();
    let r = run_grid(&pts, &profile(), None, 2);
    let counts: Vec<u64> = r.iter().map(|x| x.as_ref().unwrap().turn1.count).collect();
    assert!(counts[0] < counts[1] && counts[1] < counts[2], "{counts:?}");
}

#[test]
fn percentiles_interpolate_like_numpy() {
    let v = [1.0, 2.0, 3.0, 4.0];
    assert_eq!(percentile(&v, 50.0), 2.5);
    assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-9);
    assert_eq!(percentile(&[], 50.0), 0.0);
}

#[test]
fn a_client_whose_history_misses_the_cache_pays_for_the_last_answer() {
    let mut p = profile();
    let c = SimConfig::new("4R", "replica", "large_tiny", 1.0);
    let hit = simulate(&c, &p, None).unwrap();
    p.harness.answer_prefix_hit = false;
    let miss = simulate(&c, &p, None).unwrap();
    // 1,024 answer tokens recomputed at 0.05 ms each (+ attention) in Turn 2's prefill.
    assert!(
        miss.turn2plus.avg_ttft_ms > hit.turn2plus.avg_ttft_ms + 40.0,
        "{} vs {}",
        miss.turn2plus.avg_ttft_ms,
        hit.turn2plus.avg_ttft_ms
    );
}

#[test]
fn explicit_conversations_run_their_own_turn_counts() {
    // Three shapes of 1, 2 and 4 turns, replayed in arrival order.
    let mut cfg = SimConfig::new("2P2pD", "local", "custom", 2.0);
    cfg.conversations = Some(vec![
        vec![[100, 20]],
        vec![[50, 10], [20, 30]],
        vec![[64, 16], [8, 8], [300, 40], [5, 5]],
    ]);
    let r = simulate(&cfg, &profile(), None).unwrap();
    let n = r.conversations as usize;
    assert!(n > 5);
    let turns: usize = (0..n).map(|i| [1, 2, 4][i % 3]).sum();
    assert_eq!(r.success_rate, 1.0);
    assert_eq!(r.total_requests as usize, turns);
    assert_eq!(r.turn1.count as usize, n);
    assert_eq!((r.turn1.count + r.turn2plus.count) as usize, turns);
}

#[test]
fn bad_conversation_lists_are_clear_errors() {
    let mut cfg = SimConfig::new("2P2pD", "local", "custom", 2.0);
    for (list, needle) in [
        (vec![], "empty"),
        (vec![vec![]], "1–1024 turns"),
        (vec![vec![[0, 5]]], "must be ≥ 1"),
        (vec![vec![[10_000, 10], [10_000, 10]]], "max_model_len"),
    ] {
        cfg.conversations = Some(list);
        let e = simulate(&cfg, &profile(), None).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn a_missed_answer_is_recomputed_but_the_rest_of_the_history_hits() {
    // 4R, answer_prefix_hit = false: Turn 2 of large_tiny recomputes the 1,024-token
    // answer (+16 new) over a cached 1,024-token Turn-1 prompt, not all 2,064 tokens.
    let mut p = profile();
    p.harness.answer_prefix_hit = false;
    let c = SimConfig::new("4R", "replica", "large_tiny", 0.5);
    let miss = simulate(&c, &p, None).unwrap();
    let mut full = SimConfig::new("4R", "replica", "custom", 0.5);
    // The same Turn 2 computed from scratch: a 2,064-token Turn-1 prompt.
    full.conversations = Some(vec![vec![[2064, 32]]]);
    let scratch = simulate(&full, &p, None).unwrap();
    assert!(
        miss.turn2plus.avg_ttft_ms < scratch.turn1.avg_ttft_ms - 20.0,
        "{} vs {}",
        miss.turn2plus.avg_ttft_ms,
        scratch.turn1.avg_ttft_ms
    );
}

#[test]
fn a_push_inside_ps_step_makes_one_p_a_bottleneck_under_load() {
    // P2pNccl: P's step waits for the KV sends of the prefills it finishes. Each
    // conversation of 1P_3D puts two pushes on the one P; with 45 ms each at 12
    // conversations/s the P is over-busy and queues, while 3P (a third each) is not.
    let mut p = profile();
    p.link.full_prompt_transfer = true;
    let t2 = |dep: &str, p: &Profile| {
        simulate(&SimConfig::new(dep, "local", "small_tiny", 12.0), p, None)
            .unwrap()
            .turn2plus
            .avg_ttft_ms
    };
    let (base1, base3) = (t2("1P_3D", &p), t2("3P_1D", &p));
    p.link.push_ms = 45.0;
    let (slow1, slow3) = (t2("1P_3D", &p), t2("3P_1D", &p));
    assert!(slow1 > base1 + 200.0, "1P: {base1} -> {slow1}");
    assert!(
        slow3 - base3 < (slow1 - base1) / 4.0,
        "3P: {base3} -> {slow3}"
    );
    // No push cost leaves the model as it was.
    p.link.push_ms = 0.0;
    assert_eq!(t2("1P_3D", &p), base1);
}

#[test]
fn the_cost_model_finds_out_nodes_twice_as_slow_as_its_profile() {
    let mut cfg = SimConfig::new("1P3pD", "ppd-live", "large_mid_bal", 4.0);
    cfg.duration_s = 30.0;
    cfg.node_slowdown = 2.0;
    let r = simulate(&cfg, &profile(), None).unwrap();
    // Uncorrected, every prediction would be about half the truth: |ln| ≈ 0.69.
    assert!(
        r.ttft_prediction_error < 0.15,
        "median error {}",
        r.ttft_prediction_error
    );
    // Turn 1s teach P, the first Turn 2 on each pD teaches it (those in
    // flight together are all still off): within 25 % for good after 10.
    assert!(
        r.predictions_until_settled <= 10,
        "settled after {}",
        r.predictions_until_settled
    );
    assert!(r.turn2plus.count > 80);
}

#[test]
fn ppd_live_appends_on_an_idle_cluster_and_moves_prefills_off_a_crowded_d() {
    let quiet = run("1P3pD", "ppd-live", "large_tiny", 0.5);
    assert!(quiet.local_share > 0.95, "{}", quiet.local_share);
    // One pD decoding everything with big pastes arriving: local would stall
    // it, so a share goes through P (pull reads D's context back).
    let mut cfg = SimConfig::new("3P1pD", "ppd-live", "large_huge_paste", 8.0);
    cfg.w_tpot = 3.0;
    cfg.whole_answers = true;
    let busy = simulate(&cfg, &profile(), None).unwrap();
    assert!(busy.local_share < 0.9, "{}", busy.local_share);
    assert!(busy.pull_share > 0.0, "{}", busy.pull_share);
}

#[test]
fn a_turn_is_pulled_only_on_a_link_that_can_pull_after_asking_for_a_pin_if_the_answer_streamed() {
    // The busy point above, where ppd-live pulls. P2pNccl cannot read D's
    // KV at all; vLLM names D's pin only in a whole answer, so after a
    // streamed one the router asks D for it first (one more request on D).
    let busy = |whole_answers: bool, pull: bool| {
        let mut cfg = SimConfig::new("3P1pD", "ppd-live", "large_huge_paste", 8.0);
        cfg.w_tpot = 3.0;
        cfg.whole_answers = whole_answers;
        let mut p = profile();
        p.link.pull = pull;
        simulate(&cfg, &p, None).unwrap()
    };
    let whole = busy(true, true);
    assert!(whole.pull_share > 0.0);
    assert_eq!(whole.pins_asked, 0);
    let streamed = busy(false, true);
    assert!(streamed.pull_share > 0.0);
    let pulls = (streamed.pull_share * streamed.turn2plus.count as f64).round() as u64;
    assert!(
        streamed.pins_asked >= pulls.saturating_sub(2) && streamed.pins_asked > 0,
        "{} pins for about {pulls} pulls",
        streamed.pins_asked
    );
    let p2p = busy(true, false);
    assert_eq!((p2p.pull_share, p2p.pins_asked), (0.0, 0));
    assert!(p2p.local_share < 0.9, "{}", p2p.local_share);
}

#[test]
fn the_anchors_rules_run_in_the_simulator() {
    for policy in ["dynamo-isl", "dynamo-load", "llmd-threshold"] {
        let r = run("2P2pD", policy, "small_mid_bal", 2.0);
        assert_eq!(r.success_rate, 1.0, "{policy}");
        assert_eq!(r.turn1.count, r.turn2plus.count, "{policy}");
    }
    // Dynamo's ISL bound: a 32-token follow-up over a 1,024-token context is
    // short and a minor share of the prompt; a 1,024-token paste is not.
    assert_eq!(
        run("2P2pD", "dynamo-isl", "large_tiny", 2.0).local_share,
        1.0
    );
    assert_eq!(
        run("2P2pD", "llmd-threshold", "large_tiny", 2.0).local_share,
        0.0
    );
}

#[test]
fn slo_mode_reports_the_share_that_met_both_objectives() {
    let mut cfg = SimConfig::new("2P2pD", "ppd-live", "small_mid_bal", 2.0);
    cfg.slo = Some(ppd_core::Slo {
        ttft_ms: 10_000.0,
        tpot_ms: 1_000.0,
    });
    let r = simulate(&cfg, &profile(), None).unwrap();
    assert_eq!(r.slo_attainment, 1.0);
    cfg.slo = Some(ppd_core::Slo {
        ttft_ms: 0.001,
        tpot_ms: 1_000.0,
    });
    assert_eq!(
        simulate(&cfg, &profile(), None).unwrap().slo_attainment,
        0.0
    );
}

#[test]
fn a_turn2_the_proxy_rekeyed_goes_through_p_even_on_a_pd() {
    let mut p = profile();
    let c = SimConfig::new("1P_3pD", "local", "large_tiny", 2.0);
    let kept = simulate(&c, &p, None).unwrap();
    p.harness.new_conversation_share = 1.0;
    let rekeyed = simulate(&c, &p, None).unwrap();
    assert_eq!(kept.local_share, 1.0);
    assert_eq!(
        rekeyed.local_share, 0.0,
        "every Turn 2 was a new conversation"
    );
    // A full prefill of the whole history on P plus the push, instead of an append on pD.
    assert!(
        rekeyed.turn2plus.avg_ttft_ms > kept.turn2plus.avg_ttft_ms,
        "{} vs {}",
        rekeyed.turn2plus.avg_ttft_ms,
        kept.turn2plus.avg_ttft_ms
    );
}

#[test]
fn a_new_conversation_share_outside_0_1_is_refused() {
    let mut p = profile();
    p.harness.new_conversation_share = 1.5;
    let c = SimConfig::new("1P_3pD", "local", "small_tiny", 1.0);
    assert!(simulate(&c, &p, None).is_err());
}

/// A point routed by `routers` replicas whose view of load is `delay_s` old.
fn replicated(dep: &str, qps: f64, routers: u32, delay_s: f64) -> SimConfig {
    SimConfig {
        routers,
        view_delay_s: delay_s,
        duration_s: 20.0,
        ..SimConfig::new(dep, "local", "small_mid_bal", qps)
    }
}

#[test]
fn with_three_routers_and_exact_views_every_turn2_goes_to_its_conversations_d() {
    let r = simulate(&replicated("2P6pD", 30.0, 3, 0.0), &profile(), None).unwrap();
    assert!(r.turn2plus.count > 300, "{}", r.turn2plus.count);
    assert_eq!(r.turn2_on_own_d, 1.0);
    assert_eq!(r.local_share, 1.0);
    assert!(r.turn2_kv_found > 0.99, "{}", r.turn2_kv_found);
}

#[test]
fn exact_views_keep_every_placement_within_the_load_bound() {
    let r = simulate(&replicated("2P6pD", 30.0, 3, 0.0), &profile(), None).unwrap();
    assert_eq!(r.placements_over_bound, 0.0);
    // Over the run each node's share of conversations stays near the mean.
    assert!(
        (1.0..=DEFAULT_LOAD_BOUND).contains(&r.placement_max_over_mean),
        "{}",
        r.placement_max_over_mean
    );
}

#[test]
fn stale_views_place_over_the_bound_that_exact_views_keep() {
    // Hot enough that loads move within a view's age.
    let fresh = simulate(&replicated("1P3pD", 40.0, 8, 0.0), &profile(), None).unwrap();
    let stale = simulate(&replicated("1P3pD", 40.0, 8, 5.0), &profile(), None).unwrap();
    assert_eq!(fresh.placements_over_bound, 0.0);
    assert!(stale.placements_over_bound > 0.0);
}

#[test]
fn placement_brings_a_conversation_that_lost_its_key_back_to_its_d() {
    // The measured proxy re-keyed some Turn 2s; round-robin sends them
    // anywhere, placement by the conversation's stable key home unless the
    // load bound turns it away (often, with a handful in flight per node).
    let mut p = profile();
    p.harness.new_conversation_share = 0.5;
    let one = simulate(&replicated("2P6pD", 10.0, 1, 1.0), &p, None).unwrap();
    let three = simulate(&replicated("2P6pD", 10.0, 3, 1.0), &p, None).unwrap();
    assert!(one.turn2_on_own_d < 0.7, "{}", one.turn2_on_own_d);
    assert!(
        three.turn2_on_own_d > one.turn2_on_own_d + 0.15,
        "{} vs {}",
        three.turn2_on_own_d,
        one.turn2_on_own_d
    );
}

#[test]
fn a_cluster_past_the_live_layout_limit_simulates() {
    let c = SimConfig {
        routers: 8,
        duration_s: 1.0,
        ..SimConfig::new("100P300pD", "local", "small_tiny", 200.0)
    };
    let r = simulate(&c, &profile(), None).unwrap();
    assert_eq!(r.success_rate, 1.0);
    assert!(r.conversations > 150, "{}", r.conversations);
}

#[test]
fn a_config_without_the_replica_fields_is_one_router_with_a_1s_view() {
    let c: SimConfig = serde_json::from_str(
        r#"{"deployment": "2P2pD", "policy": "local", "workload": "small_tiny", "qps": 1}"#,
    )
    .unwrap();
    assert_eq!(c, SimConfig::new("2P2pD", "local", "small_tiny", 1.0));
    assert_eq!((c.routers, c.view_delay_s), (1, 1.0));
}

/// A table whose rule turns at 8 conversations a second: local (x = 1)
/// below, pd (x = 0) above.
fn turning_table() -> Table {
    let cell = |qps: u32, x1_ttft: u32| {
        format!(
            r#"{{"context":"small","workload":"tiny","qps":{qps},
              "x0":{{"ttft_ms":100,"tpot_ms":10,"n":9}},"x1":{{"ttft_ms":{x1_ttft},"tpot_ms":10,"n":9}}}}"#
        )
    };
    let doc = format!(
        r#"{{"schema":"ppd-table/1","source":"test","axes":{{"context_bins":[512,4096],
          "workloads":[{{"name":"tiny","n_in":16,"n_out":32}}],"qps":[1,16]}},
          "cells":[{},{}]}}"#,
        cell(1, 50),
        cell(16, 200)
    );
    Table::from_json(&doc, "<test>").unwrap()
}

#[test]
fn replicas_look_the_table_up_at_the_fleets_rate_not_at_their_share_of_it() {
    let table = turning_table();
    let at = |routers: u32, qps: f64| {
        let c = SimConfig {
            routers,
            view_delay_s: 0.25,
            duration_s: 20.0,
            ..SimConfig::new("2P6pD", "ppd", "small_tiny", qps)
        };
        simulate(&c, &profile(), Some(&table)).unwrap().local_share
    };
    // One router at 16/s goes pd; so do four replicas, each seeing 4/s of its
    // own (which alone would say local) plus the others' 12.
    assert!(at(1, 2.0) > 0.9, "{}", at(1, 2.0));
    let one = at(1, 16.0);
    let four = at(4, 16.0);
    assert!(one < 0.1, "{one}");
    assert!(four < 0.1, "{four}");
}

#[test]
fn the_measured_proxys_hashed_placement_is_sticky_but_uneven() {
    let c = SimConfig {
        duration_s: 20.0,
        ..SimConfig::new("2P6pD", "local", "small_mid_bal", 12.0)
    };
    let mut p = profile();
    let rr = simulate(&c, &p, None).unwrap();
    p.harness.hashed_placement = true;
    let hashed = simulate(&c, &p, None).unwrap();
    for r in [&rr, &hashed] {
        assert_eq!(r.turn2_on_own_d, 1.0);
        assert_eq!(r.local_share, 1.0);
    }
    // Round-robin deals conversations out evenly; a draw per conversation does not.
    assert!(
        rr.placement_max_over_mean < 1.02,
        "{}",
        rr.placement_max_over_mean
    );
    assert!(
        hashed.placement_max_over_mean > 1.05,
        "{}",
        hashed.placement_max_over_mean
    );
}

#[test]
fn kv_pulls_into_a_nearly_full_pool_wait_for_their_blocks() {
    // A small pool: a pull's cached blocks leave the free list as it is
    // admitted, so admission counts them (a pull once started short of
    // blocks and its commit ran past them).
    let mut p = crate::load_profile(crate::NIXL_PROFILE_NAME).unwrap();
    p.kv_blocks = 1500;
    p.max_num_seqs = 64;
    for (dep, wl) in [
        ("2P2pD", "large_huge_paste"),
        ("3P1pD", "large_big_paste"),
        ("3P1pD", "small_huge_paste"),
    ] {
        let c = SimConfig {
            duration_s: 20.0,
            turns: 4,
            whole_answers: true,
            ..SimConfig::new(dep, "ppd-live", wl, 20.0)
        };
        let r = simulate(&c, &p, None).unwrap();
        assert!(r.pull_share > 0.0, "{dep} {wl}: no pull taken");
        assert!(r.turn2plus.count > 0, "{dep} {wl}");
    }
}

//! The single router's results from before router replicas existed, kept
//! verbatim: `routers = 1` (the default) must reproduce them to the last bit.

use super::*;

/// The results were recorded when the simulator let every later turn be
/// pulled: whole answers, on a link that can pull.
fn pullable(mut cfg: SimConfig) -> SimConfig {
    cfg.whole_answers = true;
    cfg
}

fn run(dep: &str, policy: &str, wl: &str, qps: f64) -> SimResult {
    let cfg = pullable(SimConfig::new(dep, policy, wl, qps));
    simulate(&cfg, &super::tests::profile(), None).unwrap()
}

/// `expected` as printed by the simulator before replicas, with the fields
/// added since taken from `actual`.
fn same_as_before(actual: SimResult, expected: impl Fn(SimResult) -> SimResult) {
    assert_eq!(actual, expected(actual));
}

#[test]
fn one_router_reproduces_the_results_from_before_replicas() {
    same_as_before(run("2P2pD", "local", "large_mid_paste", 6.0), |actual| {
        SimResult {
            turn1: TurnStats {
                count: 56,
                avg_ttft_ms: 90.45414551407183,
                p50_ttft_ms: 89.75151206812916,
                p99_ttft_ms: 102.46841738319327,
                avg_tpot_ms: 6.586902317501041,
                p50_tpot_ms: 6.767483467741931,
                p99_tpot_ms: 6.912945892473096,
                avg_e2e_ms: 6828.855216317636,
                p99_e2e_ms: 7161.366272938629,
            },
            turn2plus: TurnStats {
                count: 56,
                avg_ttft_ms: 28.927877499999827,
                p50_ttft_ms: 29.17681999999968,
                p99_ttft_ms: 30.341173999998865,
                avg_tpot_ms: 6.511666994047625,
                p50_tpot_ms: 6.617256349206285,
                p99_tpot_ms: 7.252743920634923,
                avg_e2e_ms: 439.1628981250002,
                p99_e2e_ms: 487.22268499999984,
            },
            throughput: Throughput {
                requests_per_sec: 6.537565665719877,
                tokens_per_sec: 3556.4357221516134,
            },
            success_rate: 1.0,
            local_share: 1.0,
            total_requests: 112,
            failed_requests: 0,
            conversations: 56,
            duration_s: 17.131759086914997,
            slo_attainment: 0.0,
            slo_attainment_t2: 0.0,
            pull_share: 0.0,
            ttft_prediction_error: 0.0,
            predictions_until_settled: 0,
            preemptions: 0,
            ..actual
        }
    });
    same_as_before(
        run("1P_1D_2pD", "ppd-live", "small_mid_bal", 8.0),
        |actual| SimResult {
            turn1: TurnStats {
                count: 83,
                avg_ttft_ms: 28.022625157579636,
                p50_ttft_ms: 27.976241639651562,
                p99_ttft_ms: 33.991103293455,
                avg_tpot_ms: 5.33131421212409,
                p50_tpot_ms: 5.338937145669303,
                p99_tpot_ms: 5.529069976377983,
                avg_e2e_ms: 705.0995300973397,
                p99_e2e_ms: 731.1220727261772,
            },
            turn2plus: TurnStats {
                count: 83,
                avg_ttft_ms: 22.473681957831207,
                p50_ttft_ms: 17.964640000000145,
                p99_ttft_ms: 33.91610345000024,
                avg_tpot_ms: 5.334230810169812,
                p50_tpot_ms: 5.350450118110272,
                p99_tpot_ms: 5.534164710236253,
                avg_e2e_ms: 699.9209948493976,
                p99_e2e_ms: 720.938749250004,
            },
            throughput: Throughput {
                requests_per_sec: 14.684941437963206,
                tokens_per_sec: 1879.6725040592903,
            },
            success_rate: 1.0,
            local_share: 0.6626506024096386,
            total_requests: 166,
            failed_requests: 0,
            conversations: 83,
            duration_s: 11.304096832886255,
            slo_attainment: 0.0,
            slo_attainment_t2: 0.0,
            pull_share: 0.3373493975903614,
            ttft_prediction_error: 0.0028837491072424225,
            predictions_until_settled: 0,
            preemptions: 0,
            ..actual
        },
    );
    same_as_before(run("1R_1P_2D", "local", "small_tiny", 4.0), |actual| {
        SimResult {
            turn1: TurnStats {
                count: 29,
                avg_ttft_ms: 23.32613216341384,
                p50_ttft_ms: 24.1762119,
                p99_ttft_ms: 30.458742089819534,
                avg_tpot_ms: 5.102775720200923,
                p50_tpot_ms: 5.098698562992138,
                p99_tpot_ms: 5.193486532283478,
                avg_e2e_ms: 671.378648628931,
                p99_e2e_ms: 681.3216801757427,
            },
            turn2plus: TurnStats {
                count: 29,
                avg_ttft_ms: 23.67286143448288,
                p50_ttft_ms: 23.821680700000115,
                p99_ttft_ms: 37.91533410000075,
                avg_tpot_ms: 5.109005500556179,
                p50_tpot_ms: 5.096007661290331,
                p99_tpot_ms: 5.331737109677502,
                avg_e2e_ms: 182.05203195172436,
                p99_e2e_ms: 198.33868370000243,
            },
            throughput: Throughput {
                requests_per_sec: 5.3450838869612305,
                tokens_per_sec: 427.60671095689844,
            },
            success_rate: 1.0,
            local_share: 0.0,
            total_requests: 58,
            failed_requests: 0,
            conversations: 29,
            duration_s: 10.851092560302916,
            slo_attainment: 0.0,
            slo_attainment_t2: 0.0,
            pull_share: 0.0,
            ttft_prediction_error: 0.0,
            predictions_until_settled: 0,
            preemptions: 0,
            ..actual
        }
    });
    // Under KV pressure: changed on 7 December, when admission began to count
    // the cached blocks a request takes out of the free list (before, such a
    // request was admitted short of blocks: 167 preemptions and 144 failed
    // requests here, and a KV pull short of blocks panicked).
    same_as_before(
        run("3P_1D", "local", "large_very_long_gen", 20.0),
        |actual| SimResult {
            turn1: TurnStats {
                count: 208,
                avg_ttft_ms: 108.33514130759883,
                p50_ttft_ms: 107.59041816579338,
                p99_ttft_ms: 153.1229872328628,
                avg_tpot_ms: 22.028403144855808,
                p50_tpot_ms: 22.890709982893448,
                p99_tpot_ms: 25.573525821114373,
                avg_e2e_ms: 22643.391558495085,
                p99_e2e_ms: 26301.94062640287,
            },
            turn2plus: TurnStats {
                count: 206,
                avg_ttft_ms: 2296.969441310679,
                p50_ttft_ms: 197.8106537499989,
                p99_ttft_ms: 18773.480289124986,
                avg_tpot_ms: 24.950442653662346,
                p50_tpot_ms: 26.43456338220917,
                p99_tpot_ms: 28.00710670869993,
                avg_e2e_ms: 27821.272276007272,
                p99_e2e_ms: 29741.982258374974,
            },
            throughput: Throughput {
                requests_per_sec: 6.309463956440435,
                tokens_per_sec: 6460.891091395006,
            },
            success_rate: 0.9951923076923077,
            local_share: 0.0,
            total_requests: 416,
            failed_requests: 2,
            conversations: 208,
            duration_s: 65.6157167800929,
            slo_attainment: 0.0,
            slo_attainment_t2: 0.0,
            pull_share: 0.0,
            ttft_prediction_error: 0.0,
            predictions_until_settled: 0,
            preemptions: 77,
            ..actual
        },
    );
}

#[test]
fn one_router_reproduces_the_results_from_before_replicas_on_the_h100_profile() {
    // The fitted profile: the paper's client cap queues conversations, and a
    // re-rendered history misses the cache for the last answer.
    let mut p = crate::load_profile("default").unwrap();
    p.link.pull = true;
    let run = |d: &str, pol: &str, w: &str, q: f64| {
        simulate(&pullable(SimConfig::new(d, pol, w, q)), &p, None).unwrap()
    };
    same_as_before(run("2P2pD", "ppd-live", "large_mid_paste", 8.0), |actual| {
        SimResult {
            turn1: TurnStats {
                count: 83,
                avg_ttft_ms: 2570.399403028629,
                p50_ttft_ms: 146.36344920512965,
                p99_ttft_ms: 8319.477407253813,
                avg_tpot_ms: 11.210030907014964,
                p50_tpot_ms: 11.193321391444945,
                p99_tpot_ms: 12.004518451635857,
                avg_e2e_ms: 14038.26102090493,
                p99_e2e_ms: 18966.22880542925,
            },
            turn2plus: TurnStats {
                count: 83,
                avg_ttft_ms: 107.35059037221497,
                p50_ttft_ms: 98.46605249497588,
                p99_ttft_ms: 156.16802198791913,
                avg_tpot_ms: 10.973753565619813,
                p50_tpot_ms: 10.929868275057137,
                p99_tpot_ms: 13.61155369219296,
                avg_e2e_ms: 798.6970650062632,
                p99_e2e_ms: 951.4059906383966,
            },
            throughput: Throughput {
                requests_per_sec: 5.607144129659046,
                tokens_per_sec: 3050.286406534521,
            },
            success_rate: 1.0,
            local_share: 0.6024096385542169,
            total_requests: 166,
            failed_requests: 0,
            conversations: 83,
            duration_s: 29.60508882265774,
            slo_attainment: 0.0,
            slo_attainment_t2: 0.0,
            pull_share: 0.3614457831325301,
            ttft_prediction_error: 0.020863630376829714,
            predictions_until_settled: 0,
            preemptions: 0,
            ..actual
        }
    });
    same_as_before(run("1P_3pD", "local", "small_big_paste", 16.0), |actual| {
        SimResult {
            turn1: TurnStats {
                count: 174,
                avg_ttft_ms: 179.30023297866924,
                p50_ttft_ms: 163.47065140197105,
                p99_ttft_ms: 390.74963149136323,
                avg_tpot_ms: 10.565292394651326,
                p50_tpot_ms: 10.83319408910707,
                p99_tpot_ms: 11.459058074219394,
                avg_e2e_ms: 1521.0923670993884,
                p99_e2e_ms: 1810.8275754159638,
            },
            turn2plus: TurnStats {
                count: 174,
                avg_ttft_ms: 72.03083437230892,
                p50_ttft_ms: 70.09526633033511,
                p99_ttft_ms: 94.56937683068028,
                avg_tpot_ms: 10.528234785898842,
                p50_tpot_ms: 10.764242828275446,
                p99_tpot_ms: 11.636489259532146,
                avg_e2e_ms: 735.3096258839367,
                p99_e2e_ms: 811.4237129621678,
            },
            throughput: Throughput {
                requests_per_sec: 28.687080796521027,
                tokens_per_sec: 2753.9597564660185,
            },
            success_rate: 1.0,
            local_share: 1.0,
            total_requests: 348,
            failed_requests: 0,
            conversations: 174,
            duration_s: 12.130896220092323,
            slo_attainment: 0.0,
            slo_attainment_t2: 0.0,
            pull_share: 0.0,
            ttft_prediction_error: 0.0,
            predictions_until_settled: 0,
            preemptions: 0,
            ..actual
        }
    });
}

//! The ppd-sim-grid command line (clap): a chosen slice of the grid as CSV, and clear refusals.

use std::process::{Command, Output};

fn sim_grid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ppd-sim-grid"))
        .args(args)
        .output()
        .expect("ppd-sim-grid runs")
}

#[test]
fn one_grid_point_is_one_csv_row_under_the_sweep_header() {
    let out = sim_grid(&[
        "--configs",
        "1P_1pD",
        "--workloads",
        "small_tiny",
        "--qps",
        "1",
        "--set",
        "step.overhead_ms=7.5",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("config,t1_context,t2_workload,qps,"));
    assert!(lines[1].starts_with("1P_1pD,small,tiny,1,"), "{}", lines[1]);
}

#[test]
fn comma_lists_and_repeated_flags_multiply_the_points() {
    let out = sim_grid(&[
        "--configs",
        "1P_1pD,2R",
        "--workloads",
        "small_tiny",
        "--qps",
        "1,2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().lines().count(),
        1 + 4
    );
}

#[test]
fn bad_values_unknown_fields_and_flag_prefixes_exit_2_naming_them() {
    for (args, needle) in [
        (&["--qps", "x"][..], "--qps"),
        (
            &[
                "--set",
                "nope=1",
                "--configs",
                "1P_1pD",
                "--workloads",
                "small_tiny",
                "--qps",
                "1",
            ][..],
            "nope",
        ),
        (&["--set", "no-equals-sign"][..], "KEY=VALUE"),
        (&["--thread", "1"][..], "--thread"),
    ] {
        let out = sim_grid(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

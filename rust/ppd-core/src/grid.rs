//! The lookup grid of Appendix B.1: context class × workload type × QPS level, and distances on it.

use serde::{Deserialize, Serialize};

/// A Turn-2 workload type: its new input and output tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadType {
    pub name: String,
    pub n_in: u32,
    pub n_out: u32,
}

/// Weight of one workload step in [`Grid::distance`], per unit of log2 distance.
pub const WORKLOAD_DISTANCE_WEIGHT: f64 = 0.5;

/// A point of the grid, by axis indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GridPoint {
    pub context: u8,
    pub workload: u8,
    pub qps: u8,
}

/// The three axes with what discretizing a request needs precomputed.
#[derive(Debug, Clone)]
pub struct Grid {
    context_bins: Vec<u32>,
    context_names: Vec<String>,
    workloads: Vec<WorkloadType>,
    workload_log2: Vec<(f64, f64)>,
    qps: Vec<f64>,
}

fn log2_tokens(n: u32) -> f64 {
    f64::from(n.max(1)).log2()
}

impl Grid {
    /// Axes are validated by the table loader; this only precomputes.
    pub(crate) fn new(
        context_bins: Vec<u32>,
        context_names: Vec<String>,
        workloads: Vec<WorkloadType>,
        qps: Vec<f64>,
    ) -> Self {
        let workload_log2 = workloads
            .iter()
            .map(|w| (log2_tokens(w.n_in), log2_tokens(w.n_out)))
            .collect();
        Grid {
            context_bins,
            context_names,
            workloads,
            workload_log2,
            qps,
        }
    }

    pub fn context_names(&self) -> &[String] {
        &self.context_names
    }
    pub fn context_bins(&self) -> &[u32] {
        &self.context_bins
    }
    pub fn workloads(&self) -> &[WorkloadType] {
        &self.workloads
    }
    pub fn qps_levels(&self) -> &[f64] {
        &self.qps
    }
    pub fn len(&self) -> usize {
        self.context_names.len() * self.workloads.len() * self.qps.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Context class: the first bin the context fits under (≤), else the last class.
    pub fn context_class(&self, n_ctx: u32) -> usize {
        self.context_bins
            .iter()
            .position(|&b| n_ctx <= b)
            .unwrap_or(self.context_bins.len())
    }

    /// Workload type: nearest in (log2 n_in, log2 n_out). The difference of the
    /// logs is the n_in/n_out ratio, their sum the size, so both count.
    pub fn workload_type(&self, n_in: u32, n_out: u32) -> usize {
        let (x, y) = (log2_tokens(n_in), log2_tokens(n_out));
        let mut best = (0, f64::INFINITY);
        for (i, &(wx, wy)) in self.workload_log2.iter().enumerate() {
            let d = (x - wx).powi(2) + (y - wy).powi(2);
            if d < best.1 {
                best = (i, d);
            }
        }
        best.0
    }

    /// Nearest QPS level; a tie goes to the lower level.
    pub fn qps_level(&self, qps: f64) -> usize {
        let mut best = (0, f64::INFINITY);
        for (i, &l) in self.qps.iter().enumerate() {
            let d = (qps - l).abs();
            if d < best.1 {
                best = (i, d);
            }
        }
        best.0
    }

    pub fn point(&self, n_ctx: u32, n_in: u32, n_out: u32, qps: f64) -> GridPoint {
        GridPoint {
            context: self.context_class(n_ctx) as u8,
            workload: self.workload_type(n_in, n_out) as u8,
            qps: self.qps_level(qps) as u8,
        }
    }

    pub fn index(&self, p: GridPoint) -> usize {
        (usize::from(p.context) * self.workloads.len() + usize::from(p.workload)) * self.qps.len()
            + usize::from(p.qps)
    }

    pub fn points(&self) -> impl Iterator<Item = GridPoint> + '_ {
        let (c, w, q) = (
            self.context_names.len(),
            self.workloads.len(),
            self.qps.len(),
        );
        (0..c).flat_map(move |ci| {
            (0..w).flat_map(move |wi| {
                (0..q).map(move |qi| GridPoint {
                    context: ci as u8,
                    workload: wi as u8,
                    qps: qi as u8,
                })
            })
        })
    }

    /// Distance between grid points, used to pick a fallback for a missing cell:
    /// one per context class step, plus [`WORKLOAD_DISTANCE_WEIGHT`] per unit of
    /// log2 distance between workload types, plus |ln(qps_a / qps_b)|.
    pub fn distance(&self, a: GridPoint, b: GridPoint) -> f64 {
        let dc = f64::from(a.context.abs_diff(b.context));
        let (ax, ay) = self.workload_log2[usize::from(a.workload)];
        let (bx, by) = self.workload_log2[usize::from(b.workload)];
        let dw = ((ax - bx).powi(2) + (ay - by).powi(2)).sqrt();
        let dq = (self.qps[usize::from(a.qps)] / self.qps[usize::from(b.qps)])
            .ln()
            .abs();
        dc + WORKLOAD_DISTANCE_WEIGHT * dw + dq
    }

    /// A context length typical of a class (the middle of its bin; twice the
    /// last bound for the open top class), for showing the grid.
    pub fn representative_context(&self, class: usize) -> u32 {
        let lo = if class == 0 {
            0
        } else {
            self.context_bins[class - 1]
        };
        match self.context_bins.get(class) {
            Some(&hi) => lo + (hi - lo) / 2,
            None => lo.saturating_mul(2),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{paper_workloads, PAPER_CONTEXT_BINS, PAPER_CONTEXT_NAMES, PAPER_QPS};
    use proptest::prelude::*;

    fn paper() -> Grid {
        Grid::new(
            PAPER_CONTEXT_BINS.to_vec(),
            PAPER_CONTEXT_NAMES.iter().map(|s| s.to_string()).collect(),
            paper_workloads(),
            PAPER_QPS.to_vec(),
        )
    }

    #[test]
    fn context_bins_are_inclusive_upper_bounds() {
        let g = paper();
        assert_eq!(g.context_class(0), 0);
        assert_eq!(g.context_class(512), 0);
        assert_eq!(g.context_class(513), 1);
        assert_eq!(g.context_class(4096), 1);
        assert_eq!(g.context_class(4097), 2);
        assert_eq!(g.context_class(u32::MAX), 2);
    }

    #[test]
    fn every_workload_type_classifies_as_itself() {
        let g = paper();
        for (i, w) in g.workloads().iter().enumerate() {
            assert_eq!(g.workload_type(w.n_in, w.n_out), i, "{}", w.name);
        }
    }

    #[test]
    fn ratio_and_size_both_matter() {
        let g = paper();
        let name = |n_in, n_out| g.workloads()[g.workload_type(n_in, n_out)].name.clone();
        assert_eq!(name(2000, 20), "huge_paste");
        assert_eq!(name(20, 2000), "very_long_gen");
        assert_eq!(name(100, 100), "mid_bal");
        assert_eq!(name(50, 50), "small_bal");
        assert_eq!(name(0, 0), "tiny");
        assert_eq!(name(600, 70), "big_paste");
    }

    #[test]
    fn qps_snaps_to_the_nearest_level() {
        let g = paper();
        let lvl = |q| g.qps_levels()[g.qps_level(q)];
        assert_eq!(lvl(0.0), 0.5);
        assert_eq!(lvl(0.74), 0.5);
        assert_eq!(lvl(0.76), 1.0);
        assert_eq!(lvl(3.0), 2.0); // tie between 2 and 4 goes lower
        assert_eq!(lvl(14.1), 16.0);
        assert_eq!(lvl(1e9), 20.0);
    }

    #[test]
    fn distance_is_zero_only_on_the_same_point() {
        let g = paper();
        let a = GridPoint {
            context: 1,
            workload: 7,
            qps: 3,
        };
        assert_eq!(g.distance(a, a), 0.0);
        let b = GridPoint { context: 2, ..a };
        assert_eq!(g.distance(a, b), 1.0);
        let c = GridPoint { qps: 4, ..a }; // 4 → 6
        assert!((g.distance(a, c) - (1.5f64).ln()).abs() < 1e-12);
    }

    proptest! {
        #[test]
        fn discretization_is_total_and_in_range(ctx in any::<u32>(), n_in in any::<u32>(), n_out in any::<u32>(), q in 0.0f64..1e6) {
            let g = paper();
            let p = g.point(ctx, n_in, n_out, q);
            prop_assert!(usize::from(p.context) < 3);
            prop_assert!(usize::from(p.workload) < 9);
            prop_assert!(usize::from(p.qps) < 10);
            prop_assert!(g.index(p) < g.len());
        }

        #[test]
        fn context_class_is_monotone(a in any::<u32>(), b in any::<u32>()) {
            let g = paper();
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(g.context_class(lo) <= g.context_class(hi));
        }

        #[test]
        fn distance_is_symmetric(c1 in 0u8..3, w1 in 0u8..9, q1 in 0u8..10, c2 in 0u8..3, w2 in 0u8..9, q2 in 0u8..10) {
            let g = paper();
            let a = GridPoint { context: c1, workload: w1, qps: q1 };
            let b = GridPoint { context: c2, workload: w2, qps: q2 };
            prop_assert!((g.distance(a, b) - g.distance(b, a)).abs() < 1e-12);
            prop_assert!(g.distance(a, b) >= 0.0);
        }
    }
}

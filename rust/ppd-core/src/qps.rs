//! Conversation arrival rate over a sliding window, O(1) per arrival.
//!
//! The window is a ring of fixed-width buckets; an arrival adds to the current
//! bucket, and moving forward clears only the buckets that fell out, so the
//! cost per call is constant (amortized over elapsed buckets, bounded by the ring).

pub struct QpsEstimator {
    buckets: Vec<u32>,
    bucket_ms: u64,
    /// Index of the bucket holding `head_epoch` (absolute bucket number).
    head_epoch: u64,
    sum: u64,
    started_ms: Option<u64>,
}

impl QpsEstimator {
    /// `window_ms` split into `buckets` (default use: 10 s in 100 buckets).
    pub fn new(window_ms: u64, buckets: usize) -> Result<Self, crate::error::Error> {
        if window_ms == 0 || buckets == 0 || window_ms < buckets as u64 {
            return Err(crate::error::Error::Config(format!(
                "QPS window {window_ms} ms must be positive and at least one ms per bucket ({buckets} buckets)"
            )));
        }
        Ok(QpsEstimator {
            buckets: vec![0; buckets],
            bucket_ms: window_ms / buckets as u64,
            head_epoch: 0,
            sum: 0,
            started_ms: None,
        })
    }

    pub fn window_ms(&self) -> u64 {
        self.bucket_ms * self.buckets.len() as u64
    }

    fn advance(&mut self, now_ms: u64) {
        let epoch = now_ms / self.bucket_ms;
        if epoch <= self.head_epoch {
            return; // same bucket, or a clock that stepped back: count it here
        }
        let n = self.buckets.len() as u64;
        let steps = (epoch - self.head_epoch).min(n);
        for k in 1..=steps {
            let i = ((self.head_epoch + k) % n) as usize;
            self.sum -= u64::from(self.buckets[i]);
            self.buckets[i] = 0;
        }
        self.head_epoch = epoch;
    }

    pub fn record(&mut self, now_ms: u64) {
        if self.started_ms.is_none() {
            self.started_ms = Some(now_ms);
            self.head_epoch = now_ms / self.bucket_ms;
        }
        self.advance(now_ms);
        let i = (self.head_epoch % self.buckets.len() as u64) as usize;
        self.buckets[i] = self.buckets[i].saturating_add(1);
        self.sum += 1;
    }

    /// Arrivals per second over the window (over the time since the first
    /// arrival while that is shorter than the window, so start-up is not diluted).
    pub fn rate(&mut self, now_ms: u64) -> f64 {
        let Some(start) = self.started_ms else {
            return 0.0;
        };
        self.advance(now_ms);
        let span = now_ms
            .saturating_sub(start)
            .max(self.bucket_ms)
            .min(self.window_ms());
        self.sum as f64 * 1000.0 / span as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn steady_arrivals_give_their_rate() {
        let mut q = QpsEstimator::new(10_000, 100).unwrap();
        // 5 per second for 30 s.
        for i in 0..150u64 {
            q.record(i * 200);
        }
        let r = q.rate(30_000);
        assert!((r - 5.0).abs() < 0.2, "{r}");
    }

    #[test]
    fn old_arrivals_leave_the_window() {
        let mut q = QpsEstimator::new(10_000, 100).unwrap();
        for i in 0..100u64 {
            q.record(i * 10);
        }
        assert!(q.rate(5_000) > 9.0);
        assert_eq!(q.rate(11_100), 0.0);
        assert_eq!(q.rate(1_000_000), 0.0);
    }

    #[test]
    fn no_arrivals_is_zero() {
        let mut q = QpsEstimator::new(10_000, 100).unwrap();
        assert_eq!(q.rate(123), 0.0);
    }

    #[test]
    fn bad_windows_are_rejected() {
        assert!(QpsEstimator::new(0, 10).is_err());
        assert!(QpsEstimator::new(10, 0).is_err());
        assert!(QpsEstimator::new(5, 10).is_err());
    }

    proptest! {
        #[test]
        fn window_sum_matches_a_brute_force_count(gaps in proptest::collection::vec(0u64..700, 1..300), probe in 0u64..20_000) {
            let mut q = QpsEstimator::new(10_000, 100).unwrap();
            let mut t = 0;
            let mut times = Vec::new();
            for g in gaps { t += g; q.record(t); times.push(t); }
            let now = t + probe;
            q.rate(now);
            // Buckets of 100 ms: the window holds arrivals in the last 100 buckets.
            let epoch = now / 100;
            let brute = times.iter().filter(|&&x| x / 100 + 100 > epoch).count() as u64;
            prop_assert_eq!(q.sum, brute);
        }
    }
}

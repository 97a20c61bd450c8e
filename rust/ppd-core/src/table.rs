//! The `ppd-table/1` lookup table: measured x=0 and x=1 cells, validated, with every grid point resolved to a cell.
//!
//! The table keeps the raw measurements, not the decision, so weights can
//! change at run time. At load every grid point is resolved once to itself or
//! to its nearest populated cell (with the distance), so a lookup is an index.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

use crate::catalog::PAPER_CONTEXT_NAMES;
pub use crate::error::TableError;
use crate::grid::{Grid, GridPoint, WorkloadType};

pub const SCHEMA: &str = "ppd-table/1";
/// n_out assumed when neither the request nor the session says (B.1 features).
pub const DEFAULT_N_OUT: u32 = 128;

/// One path's measurement in a cell: Turn-2 mean TTFT and TPOT over `n` requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measurement {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub n: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cell {
    pub context: String,
    pub workload: String,
    pub qps: f64,
    pub x0: Measurement,
    pub x1: Measurement,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Axes {
    pub context_bins: Vec<u32>,
    /// Names of the len(context_bins)+1 classes; defaults to small/large/huge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_classes: Option<Vec<String>>,
    pub workloads: Vec<WorkloadType>,
    pub qps: Vec<f64>,
}

/// The document as stored on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableDoc {
    pub schema: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub hardware: String,
    #[serde(default)]
    pub deployment: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub created: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_n_out: Option<u32>,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub provenance: serde_json::Value,
    pub axes: Axes,
    pub cells: Vec<Cell>,
}

/// Where a grid point's numbers come from, and the precomputed relative deltas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resolved {
    /// Index into the document's cells.
    pub cell: u32,
    /// The populated cell's own grid point.
    pub at: GridPoint,
    /// [`Grid::distance`] from the requested point (0 when the cell is there).
    pub distance: f64,
    /// Relative TTFT improvement of x=1 over x=0: (ttft0 − ttft1) / ttft0.
    pub d_ttft: f64,
    /// Relative TPOT degradation of x=1 over x=0: (tpot1 − tpot0) / tpot0.
    pub d_tpot: f64,
}

#[derive(Debug, Clone)]
pub struct Table {
    doc: TableDoc,
    grid: Grid,
    resolved: Vec<Resolved>,
    name: String,
}

fn err(
    file: &str,
    location: impl Into<String>,
    field: impl Into<String>,
    message: impl Into<String>,
) -> TableError {
    TableError {
        file: file.to_owned(),
        location: location.into(),
        field: field.into(),
        message: message.into(),
    }
}

fn positive_finite(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

impl Table {
    /// Parses and validates a table; `name` (usually the path) appears in errors.
    pub fn from_json(text: &str, name: &str) -> Result<Table, TableError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let doc: TableDoc = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let (location, field) = split_path(&path);
            let inner = e.into_inner();
            err(name, location, field, format!("{inner}"))
        })?;
        Table::from_doc(doc, name)
    }

    /// Validates a document and resolves every grid point.
    pub fn from_doc(doc: TableDoc, name: &str) -> Result<Table, TableError> {
        if doc.schema != SCHEMA {
            return Err(err(
                name,
                "",
                "schema",
                format!("expected \"{SCHEMA}\", found {:?}", doc.schema),
            ));
        }
        let grid = validate_axes(&doc.axes, name)?;
        if let Some(0) = doc.default_n_out {
            return Err(err(name, "", "default_n_out", "must be at least 1"));
        }
        let mut seen: HashMap<GridPoint, usize> = HashMap::new();
        let mut at = Vec::with_capacity(doc.cells.len());
        for (i, c) in doc.cells.iter().enumerate() {
            let loc = format!(
                "cells[{i}] (context={}, workload={}, qps={})",
                c.context, c.workload, c.qps
            );
            let context = grid
                .context_names()
                .iter()
                .position(|n| *n == c.context)
                .ok_or_else(|| {
                    err(
                        name,
                        &loc,
                        "context",
                        format!("unknown class; the axes have {:?}", grid.context_names()),
                    )
                })?;
            let workload = grid
                .workloads()
                .iter()
                .position(|w| w.name == c.workload)
                .ok_or_else(|| err(name, &loc, "workload", "not one of axes.workloads"))?;
            let qps = grid
                .qps_levels()
                .iter()
                .position(|&q| (q - c.qps).abs() <= 1e-9 * q.max(1.0))
                .ok_or_else(|| {
                    err(
                        name,
                        &loc,
                        "qps",
                        format!("not one of axes.qps {:?}", grid.qps_levels()),
                    )
                })?;
            for (m, label) in [(&c.x0, "x0"), (&c.x1, "x1")] {
                if !positive_finite(m.ttft_ms) {
                    return Err(err(
                        name,
                        &loc,
                        format!("{label}.ttft_ms"),
                        format!("must be a positive finite number, found {}", m.ttft_ms),
                    ));
                }
                if !positive_finite(m.tpot_ms) {
                    return Err(err(
                        name,
                        &loc,
                        format!("{label}.tpot_ms"),
                        format!("must be a positive finite number, found {}", m.tpot_ms),
                    ));
                }
                if m.n == 0 {
                    return Err(err(
                        name,
                        &loc,
                        format!("{label}.n"),
                        "must be at least 1 sample",
                    ));
                }
            }
            let p = GridPoint {
                context: context as u8,
                workload: workload as u8,
                qps: qps as u8,
            };
            if let Some(prev) = seen.insert(p, i) {
                return Err(err(name, &loc, "", format!("duplicates cells[{prev}]")));
            }
            at.push(p);
        }
        if doc.cells.is_empty() {
            return Err(err(name, "", "cells", "the table has no cells"));
        }
        let resolved = grid
            .points()
            .map(|target| {
                // Nearest populated cell; ties go to the earliest cell in the file.
                let (i, distance) = at
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| (i, grid.distance(target, p)))
                    .fold(
                        (0, f64::INFINITY),
                        |best, cur| if cur.1 < best.1 { cur } else { best },
                    );
                let c = &doc.cells[i];
                Resolved {
                    cell: i as u32,
                    at: at[i],
                    distance,
                    d_ttft: (c.x0.ttft_ms - c.x1.ttft_ms) / c.x0.ttft_ms,
                    d_tpot: (c.x1.tpot_ms - c.x0.tpot_ms) / c.x0.tpot_ms,
                }
            })
            .collect();
        Ok(Table {
            doc,
            grid,
            resolved,
            name: name.to_owned(),
        })
    }

    pub fn grid(&self) -> &Grid {
        &self.grid
    }
    pub fn doc(&self) -> &TableDoc {
        &self.doc
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn default_n_out(&self) -> u32 {
        self.doc.default_n_out.unwrap_or(DEFAULT_N_OUT)
    }
    pub fn cell(&self, index: u32) -> Option<&Cell> {
        self.doc.cells.get(index as usize)
    }

    /// The cell serving a grid point (itself, or its nearest populated cell).
    pub fn resolve(&self, p: GridPoint) -> &Resolved {
        &self.resolved[self.grid.index(p)]
    }

    /// Discretizes the features and returns the requested point and its cell.
    pub fn lookup(&self, n_ctx: u32, n_in: u32, n_out: u32, qps: f64) -> (GridPoint, &Resolved) {
        let p = self.grid.point(n_ctx, n_in, n_out, qps);
        (p, self.resolve(p))
    }

    /// Names of a grid point's axes: (context class, workload type, QPS level).
    pub fn describe(&self, p: GridPoint) -> (&str, &str, f64) {
        (
            &self.grid.context_names()[usize::from(p.context)],
            &self.grid.workloads()[usize::from(p.workload)].name,
            self.grid.qps_levels()[usize::from(p.qps)],
        )
    }

    pub fn to_json_pretty(&self) -> String {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_string_pretty(&self.doc).unwrap_or_default()
    }
}

/// `cells[3].x0.ttft_ms` → ("cells[3]", "x0.ttft_ms"); top-level fields have no location.
fn split_path(path: &str) -> (String, String) {
    if let Some(rest) = path.strip_prefix("cells[") {
        if let Some(end) = rest.find(']') {
            let loc = format!("cells[{}]", &rest[..end]);
            let field = rest[end + 1..].trim_start_matches('.').to_owned();
            return (loc, field);
        }
    }
    (
        String::new(),
        if path == "." {
            String::new()
        } else {
            path.to_owned()
        },
    )
}

fn validate_axes(axes: &Axes, name: &str) -> Result<Grid, TableError> {
    let bins = &axes.context_bins;
    if bins.windows(2).any(|w| w[0] >= w[1]) {
        return Err(err(
            name,
            "axes",
            "context_bins",
            "must be strictly increasing",
        ));
    }
    let names: Vec<String> = match &axes.context_classes {
        Some(n) => n.clone(),
        None if bins.len() == 2 => PAPER_CONTEXT_NAMES.iter().map(|s| s.to_string()).collect(),
        None => (0..=bins.len()).map(|i| format!("c{i}")).collect(),
    };
    if names.len() != bins.len() + 1 {
        return Err(err(
            name,
            "axes",
            "context_classes",
            format!(
                "needs {} names (one more than context_bins)",
                bins.len() + 1
            ),
        ));
    }
    if names.len() > 255 {
        return Err(err(name, "axes", "context_bins", "at most 254 bins"));
    }
    let ws = &axes.workloads;
    if ws.is_empty() || ws.len() > 255 {
        return Err(err(
            name,
            "axes",
            "workloads",
            "needs 1 to 255 workload types",
        ));
    }
    for (i, w) in ws.iter().enumerate() {
        if w.n_in == 0 || w.n_out == 0 {
            return Err(err(
                name,
                format!("axes.workloads[{i}] ({})", w.name),
                "n_in/n_out",
                "must be at least 1",
            ));
        }
        if ws[..i].iter().any(|o| o.name == w.name) {
            return Err(err(
                name,
                format!("axes.workloads[{i}]"),
                "name",
                format!("duplicate workload {:?}", w.name),
            ));
        }
    }
    let qs = &axes.qps;
    if qs.is_empty() || qs.len() > 255 {
        return Err(err(name, "axes", "qps", "needs 1 to 255 levels"));
    }
    if let Some(q) = qs.iter().find(|q| !positive_finite(**q)) {
        return Err(err(
            name,
            "axes",
            "qps",
            format!("levels must be positive finite numbers, found {q}"),
        ));
    }
    if qs.windows(2).any(|w| w[0] >= w[1]) {
        return Err(err(
            name,
            "axes",
            "qps",
            "levels must be strictly increasing",
        ));
    }
    Ok(Grid::new(bins.clone(), names, ws.clone(), qs.clone()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::catalog::{paper_workloads, PAPER_CONTEXT_BINS, PAPER_QPS};
    use proptest::prelude::*;

    pub fn m(ttft: f64, tpot: f64) -> Measurement {
        Measurement {
            ttft_ms: ttft,
            tpot_ms: tpot,
            n: 10,
        }
    }

    pub fn doc_with(cells: Vec<Cell>) -> TableDoc {
        TableDoc {
            schema: SCHEMA.into(),
            model: "m".into(),
            hardware: "h".into(),
            deployment: "2P2pD".into(),
            source: "test".into(),
            created: String::new(),
            default_n_out: None,
            provenance: serde_json::Value::Null,
            axes: Axes {
                context_bins: PAPER_CONTEXT_BINS.to_vec(),
                context_classes: None,
                workloads: paper_workloads(),
                qps: PAPER_QPS.to_vec(),
            },
            cells,
        }
    }

    pub fn cell(context: &str, workload: &str, qps: f64, x0: Measurement, x1: Measurement) -> Cell {
        Cell {
            context: context.into(),
            workload: workload.into(),
            qps,
            x0,
            x1,
        }
    }

    #[test]
    fn a_full_cell_resolves_to_itself_with_deltas() {
        let t = Table::from_doc(
            doc_with(vec![cell(
                "large",
                "big_paste",
                4.0,
                m(159.5, 8.98),
                m(108.7, 10.2),
            )]),
            "t",
        )
        .unwrap();
        let (p, r) = t.lookup(2048, 512, 64, 4.2);
        assert_eq!(t.describe(p), ("large", "big_paste", 4.0));
        assert_eq!(r.distance, 0.0);
        assert!((r.d_ttft - (159.5 - 108.7) / 159.5).abs() < 1e-12);
        assert!((r.d_tpot - (10.2 - 8.98) / 8.98).abs() < 1e-12);
    }

    #[test]
    fn missing_cell_falls_back_to_the_nearest_with_its_distance() {
        let t = Table::from_doc(
            doc_with(vec![
                cell("large", "big_paste", 4.0, m(100.0, 8.0), m(50.0, 9.0)),
                cell("small", "tiny", 20.0, m(100.0, 8.0), m(150.0, 7.0)),
            ]),
            "t",
        )
        .unwrap();
        // huge context, big_paste, qps 4: one context step from cells[0].
        let (p, r) = t.lookup(10_000, 512, 64, 4.0);
        assert_eq!(t.describe(p), ("huge", "big_paste", 4.0));
        assert_eq!(r.cell, 0);
        assert_eq!(t.describe(r.at), ("large", "big_paste", 4.0));
        assert!((r.distance - 1.0).abs() < 1e-12);
        // small context, tiny, qps 16 → cells[1] at qps 20, distance ln(20/16).
        let (_, r) = t.lookup(100, 16, 32, 16.0);
        assert_eq!(r.cell, 1);
        assert!((r.distance - (20.0f64 / 16.0).ln()).abs() < 1e-12);
    }

    #[test]
    fn json_round_trips() {
        let t = Table::from_doc(
            doc_with(vec![cell("small", "tiny", 1.0, m(1.0, 2.0), m(3.0, 4.0))]),
            "t",
        )
        .unwrap();
        let again = Table::from_json(&t.to_json_pretty(), "again").unwrap();
        assert_eq!(again.doc(), t.doc());
    }

    fn load_err(text: &str) -> TableError {
        Table::from_json(text, "bad.json").unwrap_err()
    }

    #[test]
    fn errors_name_the_file_the_cell_and_the_field() {
        let good = Table::from_doc(
            doc_with(vec![cell("small", "tiny", 1.0, m(1.0, 2.0), m(3.0, 4.0))]),
            "t",
        )
        .unwrap()
        .to_json_pretty();
        let e = load_err(&good.replace("\"ttft_ms\": 1.0", "\"ttft_ms\": \"fast\""));
        assert_eq!(
            (e.file.as_str(), e.location.as_str(), e.field.as_str()),
            ("bad.json", "cells[0]", "x0.ttft_ms")
        );
        let e = load_err(&good.replace("\"ttft_ms\": 1.0", "\"ttft_ms\": -1.0"));
        assert!(e.location.starts_with("cells[0]"), "{e}");
        assert_eq!(e.field, "x0.ttft_ms");
        let e = load_err(&good.replace("\"tpot_ms\": 4.0,", ""));
        assert_eq!(e.location, "cells[0]");
        assert!(e.message.contains("tpot_ms"), "{e}");
        let e = load_err(&good.replace("\"workload\": \"tiny\"", "\"workload\": \"huge\""));
        assert_eq!(e.field, "workload");
        let e = load_err(&good.replace("ppd-table/1", "ppd-table/9"));
        assert_eq!(e.field, "schema");
        let e = load_err("{\"schema\": ");
        assert_eq!(e.file, "bad.json");
        let s = e.to_string();
        assert!(s.starts_with("table bad.json"), "{s}");
    }

    #[test]
    fn structural_mistakes_are_rejected() {
        let base = || doc_with(vec![cell("small", "tiny", 1.0, m(1.0, 2.0), m(3.0, 4.0))]);
        let mut d = base();
        d.cells.push(d.cells[0].clone());
        assert!(Table::from_doc(d, "t")
            .unwrap_err()
            .message
            .contains("duplicates"));
        let mut d = base();
        d.cells.clear();
        assert_eq!(Table::from_doc(d, "t").unwrap_err().field, "cells");
        let mut d = base();
        d.axes.qps = vec![2.0, 1.0];
        assert_eq!(Table::from_doc(d, "t").unwrap_err().field, "qps");
        let mut d = base();
        d.axes.qps = vec![f64::NAN];
        assert_eq!(Table::from_doc(d, "t").unwrap_err().field, "qps");
        let mut d = base();
        d.cells[0].x1.n = 0;
        assert_eq!(Table::from_doc(d, "t").unwrap_err().field, "x1.n");
        let mut d = base();
        d.axes.context_bins = vec![10, 10];
        assert!(Table::from_doc(d, "t").is_err());
        let mut d = base();
        d.cells[0].qps = 3.0;
        assert_eq!(Table::from_doc(d, "t").unwrap_err().field, "qps");
    }

    proptest! {
        #[test]
        fn every_point_resolves_to_a_populated_cell_at_minimal_distance(
            picks in proptest::collection::btree_set((0usize..3, 0usize..9, 0usize..10), 1..12)
        ) {
            let names = ["small", "large", "huge"];
            let wl = paper_workloads();
            let cells: Vec<Cell> = picks.iter().map(|&(c, w, q)| cell(names[c], &wl[w].name, PAPER_QPS[q], m(10.0, 1.0), m(5.0, 2.0))).collect();
            let t = Table::from_doc(doc_with(cells), "t").unwrap();
            let populated: Vec<GridPoint> = picks.iter().map(|&(c, w, q)| GridPoint { context: c as u8, workload: w as u8, qps: q as u8 }).collect();
            for p in t.grid().points() {
                let r = t.resolve(p);
                let best = populated.iter().map(|&c| t.grid().distance(p, c)).fold(f64::INFINITY, f64::min);
                prop_assert!((r.distance - best).abs() < 1e-12);
                prop_assert_eq!(populated.contains(&p), r.distance == 0.0);
            }
        }
    }
}

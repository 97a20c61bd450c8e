//! The package's exception classes: every error raised from Rust is a `PpdError`, and also the builtin exception a caller would expect.
//!
//! Each class has two bases (`ConfigError(PpdError, ValueError)`), which
//! `create_exception!` cannot express, so the classes are made once at import
//! with `type(name, bases, namespace)`.

use pyo3::exceptions::{PyException, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use ppd_core::Error as CoreError;

/// The concrete classes, in [`CLASSES`] order.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Config = 0,
    Table = 1,
    BadRequest = 2,
    InvalidArgument = 3,
    Run = 4,
    Tokenizer = 5,
    Io = 6,
}

/// The builtin exception a class also derives from.
type Builtin = fn(Python<'_>) -> Bound<'_, PyType>;

/// (name, builtin base, doc) of each [`Kind`].
const CLASSES: [(&str, Builtin, &str); 7] = [
    (
        "ConfigError",
        |py| py.get_type::<PyValueError>(),
        "An invalid setting or name.",
    ),
    (
        "TableError",
        |py| py.get_type::<PyValueError>(),
        "A lookup table failed to load or validate.",
    ),
    (
        "BadRequest",
        |py| py.get_type::<PyValueError>(),
        "A request body cannot be routed.",
    ),
    (
        "InvalidArgument",
        |py| py.get_type::<PyValueError>(),
        "An argument out of its range (a count, a rate, a time).",
    ),
    (
        "RunError",
        |py| py.get_type::<PyRuntimeError>(),
        "A router, emulator or cluster failed to start, run or stop.",
    ),
    (
        "TokenizerError",
        |py| py.get_type::<PyOSError>(),
        "A tokenizer file could not be read or loaded.",
    ),
    (
        "FileError",
        |py| py.get_type::<PyOSError>(),
        "A file could not be written.",
    ),
];

/// `PpdError`, then the classes of [`CLASSES`].
static TYPES: PyOnceLock<(Py<PyType>, Vec<Py<PyType>>)> = PyOnceLock::new();

/// `type(name, bases, {"__module__": "ppd_router._core", "__doc__": doc})`.
fn new_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: &[Bound<'py, PyType>],
    doc: &str,
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "ppd_router._core")?;
    namespace.set_item("__doc__", doc)?;
    Ok(py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, namespace))?
        .cast_into::<PyType>()?
        .unbind())
}

fn make_types(py: Python<'_>) -> PyResult<(Py<PyType>, Vec<Py<PyType>>)> {
    let base = new_class(
        py,
        "PpdError",
        &[py.get_type::<PyException>()],
        "Base class of every error ppd_router raises.",
    )?;
    let classes = CLASSES
        .iter()
        .map(|(name, builtin, doc)| new_class(py, name, &[base.bind(py).clone(), builtin(py)], doc))
        .collect::<PyResult<_>>()?;
    Ok((base, classes))
}

/// Adds `PpdError` and its subclasses to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let (base, classes) = TYPES.get_or_try_init(py, || make_types(py))?;
    m.add("PpdError", base.bind(py))?;
    for ((name, _, _), t) in CLASSES.iter().zip(classes) {
        m.add(*name, t.bind(py))?;
    }
    Ok(())
}

/// An error of `kind` with `message`.
pub(crate) fn err(kind: Kind, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match TYPES.get(py) {
        Some((_, classes)) => PyErr::from_type(classes[kind as usize].bind(py).clone(), message),
        // Only before the module finished importing.
        None => PyRuntimeError::new_err(message),
    })
}

pub(crate) fn config(message: impl Into<String>) -> PyErr {
    err(Kind::Config, message)
}

pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    err(Kind::InvalidArgument, message)
}

pub(crate) fn run(message: impl std::fmt::Display) -> PyErr {
    err(Kind::Run, message.to_string())
}

/// A core error as the matching class.
pub(crate) fn from_core(e: CoreError) -> PyErr {
    let kind = match &e {
        CoreError::Table(_) => Kind::Table,
        CoreError::BadRequest(_) => Kind::BadRequest,
        CoreError::Config(_) => Kind::Config,
        CoreError::InvalidInput(_) => Kind::InvalidArgument,
        CoreError::Tokenizer(_) => Kind::Tokenizer,
    };
    let message = match e {
        CoreError::BadRequest(m)
        | CoreError::InvalidInput(m)
        | CoreError::Config(m)
        | CoreError::Tokenizer(m) => m,
        CoreError::Table(t) => t.to_string(),
    };
    err(kind, message)
}

//! Conformance vectors: cases a vendor ships beside a module (`NAME.vectors.json` beside
//! `NAME.wasm`) that the module must answer as expected before it serves.
//!
//! The file is a JSON array of cases:
//!
//! ```json
//! [{"name": "spreads two across nodes", "hook": "allocate",
//!   "event": {"resource": "vendor.com/gpu", "available": [{"id": "a", "numa": [0]}], "count": 1},
//!   "expect": {"result": "allocated", "devices": ["a"]}}]
//! ```
//!
//! `event` is what `pluglet handler test --event` takes for the hook ([`Event`]); `expect` is an
//! [`Outcome`] as `pluglet handler test -o json` prints it, where a left-out `version` or `kind`
//! is not compared and `message` never is. Cases run one after the other on the module as it is
//! loaded (its settings and limits), with the node name [`VECTORS_NODE_NAME`]. `pluglet handler
//! test --vectors` runs them all and reports each; the daemon runs them when it applies a module
//! and refuses the module at the first case that fails.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pluglet_handler_runtime::{CallContext, Handler, Hook};

use crate::event::{Event, Outcome, run_hook};

/// What a vectors file beside a module is called: `NAME.vectors.json` for `NAME.wasm`.
pub const VECTORS_SUFFIX: &str = ".vectors.json";

/// The node name the `node-name` import answers while the daemon runs vectors (and the default
/// of `pluglet handler test`), so cases do not depend on the node.
pub const VECTORS_NODE_NAME: &str = "test-node";

/// The vectors file of a module: `NAME.vectors.json` beside it, NAME being the module's file
/// stem.
pub fn vectors_path(module: &Path) -> PathBuf {
    let stem = module
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    module.with_file_name(format!("{stem}{VECTORS_SUFFIX}"))
}

/// One case of a vectors file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Case {
    /// Its name, unique in the file.
    pub name: String,
    /// The hook it runs.
    pub hook: Hook,
    /// The event given to the hook.
    pub event: Event,
    /// What the hook must answer.
    pub expect: Outcome,
}

/// A parsed vectors file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vectors {
    /// The file.
    pub path: PathBuf,
    /// Its cases, in order.
    pub cases: Vec<Case>,
}

/// What is wrong with a vectors file.
#[derive(Debug, thiserror::Error)]
pub enum VectorsError {
    /// The file could not be read.
    #[error("cannot read the vectors file {path}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("vectors file {path} is not valid JSON")]
    NotJson {
        /// The file.
        path: PathBuf,
        /// Where the parser stopped.
        #[source]
        source: serde_json::Error,
    },
    /// The JSON is not an array of cases.
    #[error(
        "vectors file {path} is not a JSON array of cases {{\"name\", \"hook\", \"event\", \"expect\"}}"
    )]
    NotCases {
        /// The file.
        path: PathBuf,
    },
    /// One case is wrong.
    #[error("vectors file {path}: case {case}: {what}")]
    BadCase {
        /// The file.
        path: PathBuf,
        /// The case: its name, quoted, or its position when it has none.
        case: String,
        /// What is wrong and what to do.
        what: String,
    },
}

const CASE_KEYS: [&str; 4] = ["name", "hook", "event", "expect"];

impl Vectors {
    /// Reads and parses the vectors file at `path`.
    pub fn read(path: &Path) -> Result<Vectors, VectorsError> {
        let text = std::fs::read_to_string(path).map_err(|source| VectorsError::Unreadable {
            path: path.to_owned(),
            source,
        })?;
        Vectors::parse(path, &text)
    }

    /// Parses `text` as the vectors file at `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Vectors, VectorsError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| VectorsError::NotJson {
                path: path.to_owned(),
                source,
            })?;
        let serde_json::Value::Array(items) = value else {
            return Err(VectorsError::NotCases {
                path: path.to_owned(),
            });
        };
        let mut cases: Vec<Case> = Vec::with_capacity(items.len());
        for (index, item) in items.into_iter().enumerate() {
            let case =
                Vectors::case(index, item).map_err(|(case, what)| VectorsError::BadCase {
                    path: path.to_owned(),
                    case,
                    what,
                })?;
            if cases.iter().any(|c| c.name == case.name) {
                return Err(VectorsError::BadCase {
                    path: path.to_owned(),
                    case: format!("{:?}", case.name),
                    what: "another case has the same name; give each case its own".to_owned(),
                });
            }
            cases.push(case);
        }
        Ok(Vectors {
            path: path.to_owned(),
            cases,
        })
    }

    /// One case; the error is the case's label and what is wrong.
    fn case(index: usize, item: serde_json::Value) -> Result<Case, (String, String)> {
        let position = format!("#{}", index + 1);
        let serde_json::Value::Object(mut fields) = item else {
            return Err((position, "is not an object".to_owned()));
        };
        let name = match fields.remove("name") {
            Some(serde_json::Value::String(name)) if !name.is_empty() => name,
            _ => return Err((position, "has no \"name\" (a non-empty string)".to_owned())),
        };
        let label = format!("{name:?}");
        let bad = |what: String| (label.clone(), what);
        if let Some(key) = fields.keys().find(|k| !CASE_KEYS.contains(&k.as_str())) {
            return Err(bad(format!(
                "unknown key {key:?}; a case has \"name\", \"hook\", \"event\" and \"expect\""
            )));
        }
        let hook = fields
            .remove("hook")
            .ok_or_else(|| bad("has no \"hook\"".to_owned()))?;
        let hook: Hook = serde_json::from_value(hook.clone()).map_err(|_| {
            bad(format!(
                "unknown hook {hook}; hooks are validate, register, deregister and allocate"
            ))
        })?;
        let event = fields
            .remove("event")
            .ok_or_else(|| bad("has no \"event\"".to_owned()))?;
        let event = Event::from_value(hook, event).map_err(|e| {
            bad(format!(
                "event is not what hook {hook} takes ({e}); expected {}",
                Event::shape(hook)
            ))
        })?;
        let expect = fields
            .remove("expect")
            .ok_or_else(|| bad("has no \"expect\"".to_owned()))?;
        let expect: Outcome = serde_json::from_value(expect).map_err(|e| {
            bad(format!(
                "expect is not an outcome ({e}); expected {{\"result\": \"accepted\"|\"refused\"|\
                 \"allocated\"|\"ok\"|\"error\", ..}} as `pluglet handler test -o json` prints it"
            ))
        })?;
        if !expect.fits(hook) {
            return Err(bad(format!(
                "expect {:?} is not something hook {hook} answers",
                expect.result()
            )));
        }
        Ok(Case {
            name,
            hook,
            event,
            expect,
        })
    }
}

/// What one case did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaseResult {
    /// The case's name.
    pub name: String,
    /// Its hook.
    pub hook: Hook,
    /// What it expected.
    pub expected: Outcome,
    /// What came.
    pub got: Outcome,
    /// Whether `got` is what was expected.
    pub passed: bool,
    /// Wall time of the call.
    pub elapsed: Duration,
    /// Fuel the call used (`None` when it failed).
    pub fuel_used: Option<u64>,
}

impl std::fmt::Display for CaseResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "case {:?} ({}) expected {}, got {}",
            self.name, self.hook, self.expected, self.got
        )
    }
}

/// Runs one case on `handler`.
pub fn run_case(handler: &Handler, cx: &CallContext, case: &Case) -> CaseResult {
    let (got, elapsed, fuel_used) = match run_hook(handler, cx, case.hook, &case.event) {
        Ok(call) => (call.value, call.elapsed, Some(call.fuel_used)),
        Err(e) => (
            Outcome::Error {
                message: Some(pluglet_core::error_chain(&e.fault)),
            },
            Duration::ZERO,
            None,
        ),
    };
    CaseResult {
        name: case.name.clone(),
        hook: case.hook,
        passed: case.expect.matches(&got),
        expected: case.expect.clone(),
        got,
        elapsed,
        fuel_used,
    }
}

/// Runs every case on `handler`, in order.
pub fn run_all(handler: &Handler, cx: &CallContext, vectors: &Vectors) -> Vec<CaseResult> {
    vectors
        .cases
        .iter()
        .map(|case| run_case(handler, cx, case))
        .collect()
}

/// Why a module being applied fails the check of the vectors beside it; its text is the
/// refusal's reason.
#[derive(Debug, thiserror::Error)]
pub enum ModuleVectorsError {
    /// The vectors file is there but cannot be used.
    #[error("{}; fix the vectors file or remove it", pluglet_core::error_chain(.0))]
    Unusable(#[source] VectorsError),
    /// A case fails: what was expected and what came.
    #[error("fails its vectors {}: {result}; fix the module or the case", path.display())]
    CaseFails {
        /// The vectors file.
        path: PathBuf,
        /// The first failing case.
        result: Box<CaseResult>,
    },
}

/// The daemon's check of a module being applied from `module`: if a vectors file lies beside
/// it, every case must pass. The error is the refusal's reason: the vectors file's error, or
/// the first failing case with what was expected and what came.
pub fn check_module(handler: &Handler, module: &Path) -> Result<(), ModuleVectorsError> {
    let path = vectors_path(module);
    let vectors = match Vectors::read(&path) {
        Ok(vectors) => vectors,
        Err(VectorsError::Unreadable { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(());
        }
        Err(e) => return Err(ModuleVectorsError::Unusable(e)),
    };
    let cx = CallContext {
        node_name: VECTORS_NODE_NAME.to_owned(),
    };
    for case in &vectors.cases {
        let result = run_case(handler, &cx, case);
        if !result.passed {
            return Err(ModuleVectorsError::CaseFails {
                path,
                result: Box::new(result),
            });
        }
    }
    tracing::debug!(module = %module.display(), vectors = %path.display(), cases = vectors.cases.len(), "vectors passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vectors, VectorsError> {
        Vectors::parse(Path::new("/h/p.vectors.json"), text)
    }

    fn err(text: &str) -> String {
        pluglet_core::error_chain(&parse(text).unwrap_err())
    }

    const ALLOC_EVENT: &str =
        r#"{"resource": "vendor.com/gpu", "available": [{"id": "a", "numa": [0]}], "count": 1}"#;

    #[test]
    fn the_vectors_file_is_named_after_the_module() {
        assert_eq!(
            vectors_path(Path::new("/h/spread-policy.wasm")),
            Path::new("/h/spread-policy.vectors.json")
        );
        assert_eq!(
            vectors_path(Path::new("/h/policy")),
            Path::new("/h/policy.vectors.json")
        );
    }

    #[test]
    fn cases_parse_with_their_hook_event_and_expectation() {
        let v = parse(&format!(
            r#"[{{"name": "one", "hook": "allocate", "event": {ALLOC_EVENT},
                 "expect": {{"result": "allocated", "devices": ["a"]}}}},
                {{"name": "two", "hook": "validate",
                 "event": {{"name": "x", "type": "CSIPlugin", "versions": ["1.0.0"]}},
                 "expect": {{"result": "refused", "kind": "invalid-name"}}}}]"#
        ))
        .unwrap();
        assert_eq!(v.cases.len(), 2);
        assert_eq!(v.cases[0].hook, Hook::Allocate);
        assert!(matches!(v.cases[0].event, Event::Allocate(_)));
        assert_eq!(
            v.cases[1].expect,
            Outcome::Refused {
                kind: Some("invalid-name".into()),
                message: None
            }
        );
        assert!(parse("[]").unwrap().cases.is_empty());
    }

    #[test]
    fn bad_files_name_the_file_and_the_case() {
        let e = err("[{");
        assert!(
            e.starts_with("vectors file /h/p.vectors.json is not valid JSON"),
            "{e}"
        );
        let e = err(r#"{"name": "x"}"#);
        assert!(e.contains("is not a JSON array of cases"), "{e}");
        let e = err(r#"[{"hook": "allocate"}]"#);
        assert!(e.contains("case #1: has no \"name\""), "{e}");
        let e = err(&format!(
            r#"[{{"name": "n", "hook": "allocat", "event": {ALLOC_EVENT}, "expect": {{"result": "ok"}}}}]"#
        ));
        assert!(e.contains("case \"n\": unknown hook \"allocat\""), "{e}");
        let e = err(&format!(
            r#"[{{"name": "n", "hook": "validate", "event": {ALLOC_EVENT}, "expect": {{"result": "ok"}}}}]"#
        ));
        assert!(
            e.contains("case \"n\": event is not what hook validate takes (missing field `name`)"),
            "{e}"
        );
        let e = err(&format!(
            r#"[{{"name": "n", "hook": "allocate", "event": {ALLOC_EVENT}, "expect": {{"result": "ok"}}}}]"#
        ));
        assert!(
            e.contains("case \"n\": expect \"ok\" is not something hook allocate answers"),
            "{e}"
        );
        let e = err(&format!(
            r#"[{{"name": "n", "hook": "allocate", "event": {ALLOC_EVENT}, "expect": {{"result": "yes"}}}}]"#
        ));
        assert!(e.contains("case \"n\": expect is not an outcome"), "{e}");
        let e = err(&format!(
            r#"[{{"name": "n", "hook": "allocate", "event": {ALLOC_EVENT}, "expected": {{}}}}]"#
        ));
        assert!(e.contains("case \"n\": unknown key \"expected\""), "{e}");
        let case = format!(
            r#"{{"name": "n", "hook": "allocate", "event": {ALLOC_EVENT}, "expect": {{"result": "error"}}}}"#
        );
        let e = err(&format!("[{case}, {case}]"));
        assert!(
            e.contains("case \"n\": another case has the same name"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_file_is_unreadable() {
        let e = Vectors::read(Path::new("/nonexistent/p.vectors.json")).unwrap_err();
        assert!(matches!(e, VectorsError::Unreadable { .. }), "{e}");
    }
}

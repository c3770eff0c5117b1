//! Bounds on what the host accepts from a guest, so that a handler's answer can never make the
//! daemon allocate without limit.
//!
//! Two layers:
//! - every copy out of the guest (a hook's answer, the arguments of one host import call) is
//!   metered by wasmtime's hostcall fuel, set to [`MAX_TRANSFER_BYTES`]: the copy stops with an
//!   error once it would make the host allocate more, whatever the guest's memory holds (a
//!   list may name one string many times, so the host side can be far larger than the guest's
//!   memory);
//! - once copied (so at most [`MAX_TRANSFER_BYTES`]), the answer is checked against the bounds
//!   on its parts: [`MAX_ANSWER_IDS`] ids, [`MAX_ANSWER_STRING_BYTES`] per string.

use crate::error::HandlerFault;
use crate::types::{Accepted, Refusal};

/// Most bytes the host copies out of a guest in one transfer: a hook's answer, or the
/// arguments of one host import call (a log line). Counted as wasmtime allocates them: a
/// string's bytes, plus 24 bytes per list element.
pub const MAX_TRANSFER_BYTES: usize = 4 << 20;

/// Most ids an allocation policy may answer.
pub const MAX_ANSWER_IDS: usize = 65_536;

/// Longest string of an answer, in bytes: each id, a refusal's message, an accepted version.
pub const MAX_ANSWER_STRING_BYTES: usize = 64 << 10;

/// What wasmtime 48 says when its hostcall fuel runs out (its error type is private, so the
/// text is what there is to recognise; a test fails if a wasmtime upgrade changes it).
const HOSTCALL_FUEL_EXHAUSTED: &str = "fuel allocated for hostcalls has been exhausted";

/// Whether `error` is a copy out of the guest stopped at [`MAX_TRANSFER_BYTES`].
pub(crate) fn is_transfer_bound(error: &wasmtime::Error) -> bool {
    error
        .chain()
        .any(|cause| cause.to_string().contains(HOSTCALL_FUEL_EXHAUSTED))
}

/// The fault of a transfer stopped at [`MAX_TRANSFER_BYTES`].
pub(crate) fn transfer_too_large() -> HandlerFault {
    HandlerFault::AnswerTooLarge {
        detail: format!(
            "the guest passed more than {} to the host at once (MAX_TRANSFER_BYTES: an answer, \
             or one log line, counted as the host would hold it)",
            mib(MAX_TRANSFER_BYTES)
        ),
    }
}

fn mib(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} bytes")
    }
}

fn string(what: &str, s: &str) -> Result<(), HandlerFault> {
    string_named(|| what.to_owned(), s)
}

/// Like [`string`], with the string's name made only when it is too long (an answer's ids are
/// checked one by one, and naming each would cost more than the check).
fn string_named(what: impl FnOnce() -> String, s: &str) -> Result<(), HandlerFault> {
    if s.len() > MAX_ANSWER_STRING_BYTES {
        return Err(HandlerFault::AnswerTooLarge {
            detail: format!(
                "{} is {} bytes, more than the {} a string may have \
                 (MAX_ANSWER_STRING_BYTES)",
                what(),
                s.len(),
                mib(MAX_ANSWER_STRING_BYTES)
            ),
        });
    }
    Ok(())
}

fn refusal(refusal: &Refusal) -> Result<(), HandlerFault> {
    string("the refusal's message", &refusal.message)
}

/// Checks `validate`'s answer.
pub(crate) fn check_validate(answer: &Result<Accepted, Refusal>) -> Result<(), HandlerFault> {
    match answer {
        Ok(accepted) => match &accepted.version {
            Some(version) => string("the accepted version", version),
            None => Ok(()),
        },
        Err(r) => refusal(r),
    }
}

/// Checks `register`'s answer.
pub(crate) fn check_register(answer: &Result<(), Refusal>) -> Result<(), HandlerFault> {
    match answer {
        Ok(()) => Ok(()),
        Err(r) => refusal(r),
    }
}

/// Checks `allocate`'s answer.
pub(crate) fn check_allocate(answer: &Result<Vec<String>, Refusal>) -> Result<(), HandlerFault> {
    let ids = match answer {
        Ok(ids) => ids,
        Err(r) => return refusal(r),
    };
    if ids.len() > MAX_ANSWER_IDS {
        return Err(HandlerFault::AnswerTooLarge {
            detail: format!(
                "{} ids, more than the {MAX_ANSWER_IDS} an allocation policy may answer \
                 (MAX_ANSWER_IDS)",
                ids.len()
            ),
        });
    }
    for (i, id) in ids.iter().enumerate() {
        string_named(|| format!("id #{i}"), id)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RefusalKind;

    fn detail(fault: HandlerFault) -> String {
        fault.to_string()
    }

    #[test]
    fn answers_within_the_bounds_pass() {
        let ids = vec!["dev-0".to_string(); MAX_ANSWER_IDS];
        assert!(check_allocate(&Ok(ids)).is_ok());
        let version = Some("v".repeat(MAX_ANSWER_STRING_BYTES));
        assert!(check_validate(&Ok(Accepted { version })).is_ok());
    }

    #[test]
    fn each_bound_is_named() {
        let ids = vec![String::new(); MAX_ANSWER_IDS + 1];
        let err = detail(check_allocate(&Ok(ids)).unwrap_err());
        assert!(
            err.contains("65537 ids") && err.contains("MAX_ANSWER_IDS"),
            "{err}"
        );

        let ids = vec!["a".into(), "b".repeat(MAX_ANSWER_STRING_BYTES + 1)];
        let err = detail(check_allocate(&Ok(ids)).unwrap_err());
        assert!(err.contains("id #1") && err.contains("64 KiB"), "{err}");

        let huge = Refusal {
            kind: RefusalKind::Other,
            message: "m".repeat(MAX_ANSWER_STRING_BYTES + 1),
        };
        let err = detail(check_register(&Err(huge)).unwrap_err());
        assert!(
            err.contains("refusal's message") && err.contains("MAX_ANSWER_STRING_BYTES"),
            "{err}"
        );

        let err = detail(transfer_too_large());
        assert!(
            err.contains("4 MiB") && err.contains("MAX_TRANSFER_BYTES"),
            "{err}"
        );
    }
}

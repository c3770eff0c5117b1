//! [`PluginKind`]: what one plugin type does natively around the handler hooks. One
//! implementation per type lives with that type (CSI in `pluglet-csi`, device plugins in the
//! device manager's `kind` module), each with its own facts type; the pipeline carries those
//! facts without knowing them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use pluglet_handler_runtime::RegistrationFacts;

use crate::pipeline::{Candidate, Registration};

/// A native step that failed: the plugin type's own error, kept whole as the source.
pub type KindError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What the host learned natively before the register hook.
#[derive(Clone, Default)]
pub struct Facts {
    /// What the register hook is shown.
    pub hook: RegistrationFacts,
    /// The plugin type's own record of what it learned (for CSI, the `NodeGetInfo` answer),
    /// read back with [`Facts::detail`].
    detail: Option<Arc<dyn Any + Send + Sync>>,
}

impl Facts {
    /// Facts with a type-specific record.
    pub fn with_detail<T: Any + Send + Sync>(hook: RegistrationFacts, detail: T) -> Facts {
        Facts {
            hook,
            detail: Some(Arc::new(detail)),
        }
    }

    /// The type-specific record, if it is a `T`.
    pub fn detail<T: Any>(&self) -> Option<&T> {
        self.detail.as_deref()?.downcast_ref()
    }
}

impl fmt::Debug for Facts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Facts")
            .field("hook", &self.hook)
            .field("detail", &self.detail.is_some())
            .finish()
    }
}

/// The native steps of one plugin type. Every method may take as long as the plugin takes to
/// answer; the pipeline holds the type-and-name lock meanwhile, so a second registration of
/// the same name waits.
#[async_trait::async_trait]
pub trait PluginKind: Send + Sync + 'static {
    /// Gathers what the register hook is shown. An error refuses the registration.
    async fn gather_facts(&self, candidate: &Candidate) -> Result<Facts, KindError>;

    /// Whether [`PluginKind::gather_facts`] may run while the validate hook does (it needs
    /// nothing the hook decides). Then its first request goes out before the hook is called,
    /// so a plugin the hook refuses may have been asked for its facts; they are dropped and the
    /// refusal stands. Default: no, facts are gathered only for a validated plugin.
    fn facts_alongside_validate(&self) -> bool {
        false
    }

    /// Starts what follows an accepted registration (a device plugin's endpoint is dialed and
    /// its devices watched). An error refuses the registration; the pipeline then runs the
    /// deregister hook, so the handler sees every register it accepted undone.
    async fn activate(&self, registration: &Arc<Registration>) -> Result<(), KindError>;

    /// Stops what [`PluginKind::activate`] started; called once per registration, before its
    /// deregister hook. Must do nothing to a newer registration of the same name.
    async fn deactivate(&self, registration: &Registration);
}

/// The kind of plugin types with no native steps (DRA, types only `handlers.toml` knows):
/// no facts, nothing to start or stop.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoNativeSteps;

#[async_trait::async_trait]
impl PluginKind for NoNativeSteps {
    async fn gather_facts(&self, _candidate: &Candidate) -> Result<Facts, KindError> {
        Ok(Facts::default())
    }

    async fn activate(&self, _registration: &Arc<Registration>) -> Result<(), KindError> {
        Ok(())
    }

    async fn deactivate(&self, _registration: &Registration) {}
}

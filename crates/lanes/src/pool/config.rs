//! What both pool builders configure the same way: name, registry, throttle and hooks.

use std::sync::Arc;

use super::handle::Hooks;
use crate::BoxError;
use crate::config::ConfigError;
use crate::limit::Throttle;
use crate::observe::Registration;
use crate::util::PanicPayload;

/// What both pool builders configure the same way.
pub(crate) struct Common<T> {
    pub(crate) name: Option<String>,
    pub(crate) registry: Option<Registration>,
    pub(crate) limit: Option<Throttle>,
    pub(crate) hooks: Hooks<T>,
    pub(crate) on_error: Option<Arc<dyn Fn(BoxError) + Send + Sync>>,
}

impl<T> Default for Common<T> {
    fn default() -> Self {
        Self { name: None, registry: None, limit: None, hooks: Hooks::default(), on_error: None }
    }
}

impl<T: Send + 'static> Common<T> {
    pub(crate) fn on_error(&mut self, on_error: impl Fn(BoxError) + Send + Sync + 'static) {
        let shared: Arc<dyn Fn(BoxError) + Send + Sync> = Arc::new(on_error);
        let for_engine = shared.clone();
        self.hooks.on_error = Some(Box::new(move |err| for_engine(err)));
        self.on_error = Some(shared);
    }

    pub(crate) fn on_panic(&mut self, on_panic: impl Fn(T, PanicPayload) + Send + Sync + 'static)
    where
        T: Clone,
    {
        self.hooks.on_panic = Some((Box::new(T::clone), Box::new(on_panic)));
    }

    pub(crate) fn throttle(&mut self, throttle: Throttle) {
        self.limit = Some(throttle);
    }

    /// Refuses a registry name already taken, before anything starts.
    pub(crate) fn check_registry(&self) -> Result<(), ConfigError> {
        self.registry.as_ref().map_or(Ok(()), Registration::check)
    }

    /// The metrics label: the explicit name, else the registry name, else "unnamed".
    pub(crate) fn label(&self) -> String {
        self.name
            .clone()
            .or_else(|| self.registry.as_ref().map(|r| r.name.clone()))
            .unwrap_or_else(|| "unnamed".to_owned())
    }
}

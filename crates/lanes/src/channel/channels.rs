//! Channels by name: configured and dynamic, owners, and a budget shared by the dynamic ones.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use super::config::ChannelConfig;
use super::error::ChannelError;
use super::handle::{Budget, ChannelShared};
use super::producer::Channel;
use super::snapshot::{BudgetSnapshot, ChannelSnapshot, ChannelsSnapshot};
use crate::config::{ConfigError, ConfigRule};
use crate::observe::{Observe, Registration, Registry, Snapshot};
use crate::util::lock;

/// What the registry needs of a channel whatever its record type.
trait AnyChannel: Send + Sync {
    fn snapshot(&self) -> ChannelSnapshot;
    fn close(&self);
    fn owner(&self) -> Option<&str>;
}

impl<T: Send + 'static> AnyChannel for ChannelShared<T> {
    fn snapshot(&self) -> ChannelSnapshot {
        ChannelShared::snapshot(self)
    }

    fn close(&self) {
        self.close_with(false);
    }

    fn owner(&self) -> Option<&str> {
        self.config.owner.as_deref()
    }
}

struct Slot {
    any: Arc<dyn Any + Send + Sync>,
    channel: Arc<dyn AnyChannel>,
}

pub(crate) struct ChannelsInner {
    map: Mutex<BTreeMap<Arc<str>, Slot>>,
    budget: Option<Arc<Budget>>,
}

impl ChannelsInner {
    /// Removes `name` if it is still the channel at `ptr` (a closed channel frees its name).
    pub(crate) fn forget(&self, name: &str, ptr: *const ()) {
        let mut map = lock(&self.map);
        if map.get(name).is_some_and(|slot| std::ptr::eq(Arc::as_ptr(&slot.any).cast::<()>(), ptr))
        {
            map.remove(name);
        }
    }
}

/// A registry of channels by name.
///
/// *Configured* channels ([`configure`](Self::configure)) are declared up front with their own
/// capacity. *Dynamic* channels ([`create`](Self::create), [`get_or_create`](Self::get_or_create))
/// come and go at run time and share the registry's `total_budget` of queued records (and of
/// records handed to a waiting read and not yet taken by it): when the
/// budget is used up, each applies its own overflow policy as if it were full. A channel leaves
/// the registry when it is closed (its name is free again); closing an owner closes all of its
/// channels.
///
/// # Examples
///
/// ```
/// use lanes::channel::{ChannelConfig, ChannelError, Channels};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let channels = Channels::with_budget(10_000)?;
/// let config = ChannelConfig::default().owner("session-7");
/// let a = channels.get_or_create::<String>("session-7/events", config.clone())?;
/// let b = channels.get_or_create::<String>("session-7/events", config)?;
/// a.emit("hello".to_owned()).await?;
/// assert_eq!(b.len(), 1); // the same channel
///
/// // Same name, another configuration: a typed error, not a silent mix-up.
/// let err = channels
///     .get_or_create::<String>("session-7/events", ChannelConfig::new(8))
///     .unwrap_err();
/// assert!(matches!(err, ChannelError::ConfigMismatch { field: "capacity", .. }));
///
/// assert_eq!(channels.close_owner("session-7"), 1);
/// assert!(a.is_closed());
/// assert!(channels.names().is_empty());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Channels {
    inner: Arc<ChannelsInner>,
}

impl Channels {
    /// A registry without a budget: dynamic channels are bounded only by their capacities.
    pub fn new() -> Self {
        Self { inner: Arc::new(ChannelsInner { map: Mutex::new(BTreeMap::new()), budget: None }) }
    }

    /// A registry whose dynamic channels together hold at most `total_budget` records.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for a zero budget.
    pub fn with_budget(total_budget: usize) -> Result<Self, ConfigError> {
        Self::builder().total_budget(total_budget).build()
    }

    /// A builder: the shared budget and where the registry reports.
    ///
    /// # Examples
    ///
    /// ```
    /// use lanes::{ChannelConfig, Channels, Registry};
    ///
    /// let registry = Registry::new();
    /// let channels = Channels::builder().total_budget(1024).registry(&registry, "pipeline").build()?;
    /// let _events = channels.create::<String>("events", ChannelConfig::new(64))?;
    /// let snapshot = registry.snapshot().channels("pipeline").expect("reported");
    /// assert_eq!(snapshot.channels[0].name, "events");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn builder() -> ChannelsBuilder {
        ChannelsBuilder::default()
    }

    /// Declares a configured channel (outside the budget).
    ///
    /// # Errors
    ///
    /// [`ChannelError::Duplicate`] if the name is taken, [`ChannelError::Config`] for an
    /// invalid configuration.
    pub fn configure<T: Send + 'static>(
        &self,
        name: &str,
        config: ChannelConfig<T>,
    ) -> Result<Channel<T>, ChannelError> {
        self.insert(name, config, false, true)
    }

    /// Creates a dynamic channel.
    ///
    /// # Errors
    ///
    /// [`ChannelError::Duplicate`] if the name is taken, [`ChannelError::Config`] for an
    /// invalid configuration.
    pub fn create<T: Send + 'static>(
        &self,
        name: &str,
        config: ChannelConfig<T>,
    ) -> Result<Channel<T>, ChannelError> {
        self.insert(name, config, true, true)
    }

    /// The channel `name`, created (dynamic) if it does not exist. Concurrent callers with the
    /// same name get the same channel.
    ///
    /// # Errors
    ///
    /// [`ChannelError::ConfigMismatch`] if it exists with another configuration,
    /// [`ChannelError::TypeMismatch`] if with another record type, [`ChannelError::Config`]
    /// for an invalid configuration.
    pub fn get_or_create<T: Send + 'static>(
        &self,
        name: &str,
        config: ChannelConfig<T>,
    ) -> Result<Channel<T>, ChannelError> {
        self.insert(name, config, true, false)
    }

    fn insert<T: Send + 'static>(
        &self,
        name: &str,
        config: ChannelConfig<T>,
        dynamic: bool,
        must_be_new: bool,
    ) -> Result<Channel<T>, ChannelError> {
        config.validate(name)?;
        if config.registry.is_some() {
            // Its `Channels` reports it; a second entry would count it twice.
            return Err(ConfigError::new(
                format!("channels.{name}.registry"),
                ConfigRule::Unsupported,
            )
            .into());
        }
        // Before the map's lock: a recorder (user code) may create a channel here from its
        // `describe_*`.
        crate::observe::describe_once();
        if let Some(slot) = lock(&self.inner.map).get(name) {
            return Self::existing(name, slot, &config, must_be_new);
        }
        // Built before the map's lock too: registering its metrics calls the recorder, which
        // may call back into this registry. A channel built here that loses the name to
        // another caller meanwhile (the recorder among them) is dropped unused, after the
        // lock: it was never in the map, holds no budget, and its drop calls no recorder.
        let budget = if dynamic { self.inner.budget.clone() } else { None };
        let name: Arc<str> = Arc::from(name);
        let shared = Arc::new(ChannelShared::new(
            name.clone(),
            config,
            dynamic,
            budget,
            Arc::downgrade(&self.inner),
        ));
        let mut map = lock(&self.inner.map);
        if let Some(slot) = map.get(&name) {
            let existing = Self::existing(&name, slot, &shared.config, must_be_new);
            drop(map);
            return existing;
        }
        map.insert(name, Slot { any: shared.clone(), channel: shared.clone() });
        Ok(Channel::from_shared(shared))
    }

    /// The channel already named `name`, if it is of `config` and a new one was not required.
    fn existing<T: Send + 'static>(
        name: &str,
        slot: &Slot,
        config: &ChannelConfig<T>,
        must_be_new: bool,
    ) -> Result<Channel<T>, ChannelError> {
        if must_be_new {
            return Err(ChannelError::Duplicate(name.to_owned()));
        }
        let shared = downcast::<T>(name, slot)?;
        if let Some(field) = shared.config.difference(config) {
            return Err(ChannelError::ConfigMismatch { name: name.to_owned(), field });
        }
        Ok(Channel::from_shared(shared))
    }

    /// The channel `name`.
    ///
    /// # Errors
    ///
    /// [`ChannelError::NotFound`], or [`ChannelError::TypeMismatch`] if its records are of
    /// another type.
    pub fn get<T: Send + 'static>(&self, name: &str) -> Result<Channel<T>, ChannelError> {
        let map = lock(&self.inner.map);
        let slot = map.get(name).ok_or_else(|| ChannelError::NotFound(name.to_owned()))?;
        Ok(Channel::from_shared(downcast::<T>(name, slot)?))
    }

    /// Closes the channel `name` (see [`Channel::close`]); whether it was there.
    pub fn close(&self, name: &str) -> bool {
        let slot = lock(&self.inner.map).remove(name);
        slot.map(|slot| slot.channel.close()).is_some()
    }

    /// Closes every channel `owner` owns; how many.
    pub fn close_owner(&self, owner: &str) -> usize {
        let owned: Vec<Slot> = {
            let mut map = lock(&self.inner.map);
            let names: Vec<Arc<str>> = map
                .iter()
                .filter(|(_, slot)| slot.channel.owner() == Some(owner))
                .map(|(name, _)| name.clone())
                .collect();
            names.iter().filter_map(|name| map.remove(name)).collect()
        };
        for slot in &owned {
            slot.channel.close();
        }
        owned.len()
    }

    /// The names of the open channels, in order.
    pub fn names(&self) -> Vec<String> {
        lock(&self.inner.map).keys().map(|name| name.to_string()).collect()
    }

    /// Records queued now across the dynamic channels, if there is a budget.
    pub fn budget_used(&self) -> Option<usize> {
        self.inner.budget.as_ref().map(|budget| budget.used())
    }

    /// Every open channel's snapshot, and the budget.
    pub fn snapshot(&self) -> ChannelsSnapshot {
        self.inner.snapshot()
    }
}

/// Builds a [`Channels`]: the budget its dynamic channels share and the [`Registry`] it reports
/// in, validated at [`build`](Self::build).
#[derive(Debug, Default)]
#[must_use]
pub struct ChannelsBuilder {
    total_budget: Option<usize>,
    registry: Option<Registration>,
}

impl ChannelsBuilder {
    /// The dynamic channels together hold at most `total_budget` records (default: no budget,
    /// each channel bounded by its capacity).
    pub fn total_budget(mut self, total_budget: usize) -> Self {
        self.total_budget = Some(total_budget);
        self
    }

    /// Reports every channel in `registry` under `name`.
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.registry = Some(Registration::new(registry, name));
        self
    }

    /// Builds the registry of channels.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for a zero budget or a registry name already taken.
    pub fn build(self) -> Result<Channels, ConfigError> {
        if self.total_budget == Some(0) {
            return Err(ConfigError::new("channels.total_budget", ConfigRule::Zero));
        }
        if let Some(registration) = &self.registry {
            registration.check()?;
        }
        let channels = Channels {
            inner: Arc::new(ChannelsInner {
                map: Mutex::new(BTreeMap::new()),
                budget: self.total_budget.map(|total| Arc::new(Budget::new(total))),
            }),
        };
        if let Some(registration) = &self.registry {
            registration.register(&channels.inner)?;
        }
        Ok(channels)
    }
}

fn downcast<T: Send + 'static>(
    name: &str,
    slot: &Slot,
) -> Result<Arc<ChannelShared<T>>, ChannelError> {
    slot.any
        .clone()
        .downcast::<ChannelShared<T>>()
        .map_err(|_| ChannelError::TypeMismatch(name.to_owned()))
}

impl ChannelsInner {
    fn snapshot(&self) -> ChannelsSnapshot {
        let channels: Vec<Arc<dyn AnyChannel>> =
            lock(&self.map).values().map(|slot| slot.channel.clone()).collect();
        ChannelsSnapshot {
            budget: self
                .budget
                .as_ref()
                .map(|budget| BudgetSnapshot { total: budget.max, used: budget.used() }),
            channels: channels.iter().map(|channel| channel.snapshot()).collect(),
        }
    }
}

impl Observe for ChannelsInner {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.insert("channels", name, &self.snapshot());
    }
}

impl Default for Channels {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Channels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channels")
            .field("names", &self.names())
            .field("budget_used", &self.budget_used())
            .finish()
    }
}

//! The storage under a spill queue: a flat directory of files. [`FsStorage`] is the real one;
//! [`MemStorage`] keeps files in memory and can fail or cut writes, to simulate crashes.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::util::lock;

/// A file open for appending.
pub trait AppendFile: Send + fmt::Debug {
    /// Appends `data` after what was appended so far.
    fn append(&mut self, data: &[u8]) -> io::Result<()>;
    /// Makes everything appended so far durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;
    /// Extends the file with zeros to `len` bytes if it is shorter, without moving where
    /// appends go: appends then write in place, and a sync need not record a new file size
    /// (on ext4, an `fdatasync` after an in-place write costs about two thirds of one after a
    /// write that grows the file). Recovery reads a zero tail as space never written. The
    /// default does nothing. An error only costs the queue the reservation: it appends on
    /// (a disk too full for a whole segment may still hold records).
    fn reserve(&mut self, len: u64) -> io::Result<()> {
        let _ = len;
        Ok(())
    }
    /// Cuts the file where the appended data ends (undoes [`reserve`](Self::reserve)); made
    /// durable by the next sync. The default does nothing.
    fn trim(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// A handle that syncs this file from another thread while appends go on, so that under
    /// [`SyncPolicy::Batch`](super::SyncPolicy::Batch) one group's sync overlaps the next
    /// group's write. `None` (the default): the queue syncs through [`sync`](Self::sync),
    /// between writes.
    fn syncer(&self) -> io::Result<Option<Arc<dyn FileSync>>> {
        Ok(None)
    }
}

/// Makes a file's appended data durable from another thread than the one appending: a sync
/// covers at least every append that returned before it began.
pub trait FileSync: Send + Sync + fmt::Debug {
    /// Makes everything appended before this call began durable (`fdatasync`).
    fn sync(&self) -> io::Result<()>;
}

/// A directory of files, as a spill queue uses it.
pub trait Storage: Send + Sync + fmt::Debug + 'static {
    /// File names in the directory.
    fn list(&self) -> io::Result<Vec<String>>;

    /// Entries named like queue files (segments, the state) that are not regular files:
    /// symlinks, directories. Never followed.
    fn list_other(&self) -> io::Result<Vec<String>> {
        Ok(Vec::new())
    }
    /// Whether the directory exists.
    fn exists(&self) -> bool;
    /// Creates the directory if it is missing.
    fn create_dir(&self) -> io::Result<()>;
    /// Takes the directory for this process; fails with `WouldBlock` if another holds it. The
    /// guard releases it when dropped, and the OS when the process dies.
    fn lock(&self) -> io::Result<Box<dyn fmt::Debug + Send + Sync>>;

    /// Whether a live owner holds the directory's lock, found without writing anything (for a
    /// read-only check). An error of kind `ResourceBusy` means this process holds it.
    fn is_owned(&self) -> io::Result<bool> {
        Ok(false)
    }
    /// The length of a file.
    fn len(&self, name: &str) -> io::Result<u64>;
    /// Reads `buf.len()` bytes (or fewer at the end) at `offset`.
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Reads a whole file.
    fn read_all(&self, name: &str) -> io::Result<Vec<u8>>;
    /// Creates a new empty file (failing if it exists) and opens it for appending.
    fn create(&self, name: &str) -> io::Result<Box<dyn AppendFile>>;
    /// Opens an existing file for appending.
    fn open_append(&self, name: &str) -> io::Result<Box<dyn AppendFile>>;
    /// Cuts a file to `len` bytes, durably.
    fn truncate(&self, name: &str, len: u64) -> io::Result<()>;
    /// Removes a file.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Replaces `name` atomically: writes a temporary file, syncs it, renames it over `name`,
    /// syncs the directory.
    fn write_atomic(&self, name: &str, data: &[u8]) -> io::Result<()>;
    /// Makes the directory's entries (created, renamed, removed files) durable.
    fn sync_dir(&self) -> io::Result<()>;
    /// Replaces `name` atomically with `from`, a file written and synced already: renames it
    /// over `name`, syncs the directory. (Recovery rewrites a damaged segment this way, a
    /// piece at a time, rather than whole in memory.) The default reads `from` whole, removes
    /// it, and writes its bytes with [`write_atomic`](Self::write_atomic) (which may use
    /// `from`'s name for its own temporary file); a storage that can rename should.
    fn replace(&self, from: &str, name: &str) -> io::Result<()> {
        let data = self.read_all(from)?;
        self.remove(from)?;
        self.write_atomic(name, &data)
    }
}

/// Files on the local filesystem.
#[derive(Debug, Clone)]
pub struct FsStorage {
    dir: PathBuf,
}

impl FsStorage {
    /// The directory `dir` (created on open if missing).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

#[derive(Debug)]
struct FsAppend {
    file: File,
    /// Where the appended data ends (the file may be longer: reserved zeros).
    end: u64,
}

impl AppendFile for FsAppend {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, self.end)?;
        self.end += data.len() as u64;
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn reserve(&mut self, len: u64) -> io::Result<()> {
        let now = self.file.metadata()?.len();
        if now >= len {
            return Ok(());
        }
        // Allocated, not a hole: a write into a hole allocates blocks that its sync must then
        // record (measured on ext4: 64 KiB appends synced one at a time ran 10% faster into
        // fallocated space than into a hole, 64 B appends 15%). A filesystem without fallocate
        // gets the hole.
        let mode = rustix::fs::FallocateFlags::empty();
        match rustix::fs::fallocate(&self.file, mode, now, len - now) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => self.file.set_len(len),
            Err(err) => Err(err.into()),
        }
    }

    fn trim(&mut self) -> io::Result<()> {
        if self.file.metadata()?.len() > self.end {
            self.file.set_len(self.end)?;
        }
        Ok(())
    }

    fn syncer(&self) -> io::Result<Option<Arc<dyn FileSync>>> {
        Ok(Some(Arc::new(FsSync(self.file.try_clone()?))))
    }
}

/// A second descriptor of a segment, synced by the queue's sync thread.
#[derive(Debug)]
struct FsSync(File);

impl FileSync for FsSync {
    fn sync(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

/// Holds the directory's lock file, locked.
#[derive(Debug)]
struct FsLock {
    _file: File,
    /// The directory, as registered in [`HELD`].
    dir: PathBuf,
}

/// Directories whose lock this process holds: `flock` would only say "locked", as if another
/// process held it.
static HELD: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

impl Drop for FsLock {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        held.retain(|dir| dir != &self.dir);
    }
}

impl Storage for FsStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file()
                && let Ok(name) = entry.file_name().into_string()
            {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn list_other(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            if !entry.file_type()?.is_file()
                && let Ok(name) = entry.file_name().into_string()
                && (super::format::segment_id(&name).is_some() || name == super::format::STATE)
            {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn exists(&self) -> bool {
        self.dir.is_dir()
    }

    fn create_dir(&self) -> io::Result<()> {
        if self.dir.is_dir() {
            return Ok(());
        }
        // Each directory made is synced into its parent, from the top down: on a file system
        // that does not order metadata, a power loss right after the first open could drop
        // the new directory, and with it appends acknowledged as synced.
        let mut missing = Vec::new();
        let mut at = self.dir.as_path();
        while !at.is_dir() {
            missing.push(at.to_path_buf());
            match at.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => at = parent,
                _ => break,
            }
        }
        std::fs::create_dir_all(&self.dir)?;
        for made in missing.iter().rev() {
            // A relative path's top directory lives in the working directory ("" as a parent).
            let parent = match made.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => parent,
                _ => std::path::Path::new("."),
            };
            File::open(parent)?.sync_all()?;
        }
        Ok(())
    }

    fn lock(&self) -> io::Result<Box<dyn fmt::Debug + Send + Sync>> {
        let dir = std::fs::canonicalize(&self.dir)?;
        let mut held = HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.contains(&dir) {
            return Err(io::Error::new(io::ErrorKind::ResourceBusy, "open in this process"));
        }
        let path = self.path(super::format::LOCK);
        let mut file =
            OpenOptions::new().create(true).truncate(false).read(true).write(true).open(path)?;
        // A lock this process just released can still be held for a moment by a child between
        // fork and exec (it shares the open file): try a few times over ~100 ms before saying
        // another process holds it.
        let mut attempts = 0;
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) if attempts < 20 => {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(TryLockError::WouldBlock) => {
                    let message = "locked by another process";
                    return Err(io::Error::new(io::ErrorKind::WouldBlock, message));
                }
                Err(TryLockError::Error(err)) => return Err(err),
            }
        }
        // For people looking at the directory: who holds it.
        file.set_len(0)?;
        writeln!(file, "{}", std::process::id())?;
        held.push(dir.clone());
        Ok(Box::new(FsLock { _file: file, dir }))
    }

    fn is_owned(&self) -> io::Result<bool> {
        let dir = std::fs::canonicalize(&self.dir)?;
        if HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains(&dir) {
            return Err(io::Error::new(io::ErrorKind::ResourceBusy, "open in this process"));
        }
        // Only read: a missing LOCK file means nobody ever held it, and a shared lock on a
        // read-only handle fails while an owner holds its exclusive one.
        let file = match File::open(self.path(super::format::LOCK)) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(err),
        };
        // As in `lock`: a lock its owner just released can still be held for a moment by a
        // child of the owner between fork and exec, so "owned" is said only after ~100 ms of
        // asking (a test process that closes a queue and then runs `lanes spill check` on it
        // while other tests spawn processes was told the queue was open).
        let mut attempts = 0;
        loop {
            match file.try_lock_shared() {
                Ok(()) => return Ok(false),
                Err(TryLockError::WouldBlock) if attempts < 20 => {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(TryLockError::WouldBlock) => return Ok(true),
                Err(TryLockError::Error(err)) => return Err(err),
            }
        }
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        Ok(std::fs::metadata(self.path(name))?.len())
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let file = File::open(self.path(name))?;
        let mut filled = 0;
        while filled < buf.len() {
            match file.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(filled)
    }

    fn read_all(&self, name: &str) -> io::Result<Vec<u8>> {
        std::fs::read(self.path(name))
    }

    fn create(&self, name: &str) -> io::Result<Box<dyn AppendFile>> {
        let file = OpenOptions::new().create_new(true).write(true).open(self.path(name))?;
        Ok(Box::new(FsAppend { file, end: 0 }))
    }

    fn open_append(&self, name: &str) -> io::Result<Box<dyn AppendFile>> {
        let file = OpenOptions::new().write(true).open(self.path(name))?;
        let end = file.metadata()?.len();
        Ok(Box::new(FsAppend { file, end }))
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(self.path(name))?;
        file.set_len(len)?;
        file.sync_all()
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        std::fs::remove_file(self.path(name))
    }

    fn write_atomic(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let tmp = self.path(&format!("{name}.tmp"));
        {
            let mut file = OpenOptions::new().create(true).truncate(true).write(true).open(&tmp)?;
            file.write_all(data)?;
            file.sync_all()?;
        }
        std::fs::rename(&tmp, self.path(name))?;
        self.sync_dir()
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    fn replace(&self, from: &str, name: &str) -> io::Result<()> {
        std::fs::rename(self.path(from), self.path(name))?;
        self.sync_dir()
    }
}

/// One in-memory file: what the process sees, and what would survive a crash.
#[derive(Debug, Clone, Default)]
struct MemFile {
    data: Vec<u8>,
    /// Bytes made durable by a sync (a prefix of `data` unless truncated since).
    durable: Vec<u8>,
}

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The next append fails after writing this many of its bytes.
    FailAppendAfter(usize),
    /// The next sync fails.
    FailSync,
    /// The next sync panics (a [`Storage`] written carelessly): armed on an open queue, the
    /// queue fails as if the sync had failed.
    PanicSync,
    /// Every [`AppendFile::reserve`] fails with `ENOSPC` from now on (a disk too full for a
    /// segment's worth of space, which may still hold a record), until another fault is armed.
    FailReserve,
}

#[derive(Debug, Default)]
struct MemState {
    files: BTreeMap<String, MemFile>,
    locked: bool,
    fault: Option<Fault>,
    exists: bool,
    /// Bumped by every crash: handles of an older generation belong to the crashed process
    /// and fail every operation.
    generation: u64,
}

/// Files in memory, with crash simulation: every file remembers what a sync made durable, and
/// [`crash`](MemStorage::crash) keeps only that plus an arbitrary prefix of what came after
/// (a write cut at any byte). Faults can fail an append part-way, fail a sync or make one
/// panic.
///
/// Directory operations (create, rename, remove) are durable at once, as after a directory
/// sync, which the queue always does right after them.
///
/// A crash fences the crashed "process": this handle and everything opened through it fail
/// from then on. Reopen through [`after_crash`](MemStorage::after_crash).
#[derive(Debug, Clone, Default)]
pub struct MemStorage {
    state: Arc<Mutex<MemState>>,
    generation: u64,
}

#[derive(Debug)]
struct MemAppend {
    state: Arc<Mutex<MemState>>,
    generation: u64,
    name: String,
}

#[derive(Debug)]
struct MemLock {
    state: Arc<Mutex<MemState>>,
    generation: u64,
}

impl Drop for MemLock {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        if state.generation == self.generation {
            state.locked = false;
        }
    }
}

fn missing(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("no file {name}"))
}

/// The state, if `generation` is still the live one.
fn live(
    state: &Mutex<MemState>,
    generation: u64,
) -> io::Result<std::sync::MutexGuard<'_, MemState>> {
    let state = lock(state);
    if state.generation != generation {
        return Err(io::Error::other("the process using this storage crashed"));
    }
    Ok(state)
}

impl MemStorage {
    /// An empty, not yet created directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Arms a fault for the next append or sync.
    pub fn inject(&self, fault: Fault) {
        lock(&self.state).fault = Some(fault);
    }

    /// Simulates a crash of the process using this storage (and the loss of its lock): every
    /// file keeps its durable bytes, plus up to `keep(name, unsynced)` of the bytes written
    /// after its last sync.
    pub fn crash(&self, mut keep: impl FnMut(&str, usize) -> usize) {
        let mut state = lock(&self.state);
        state.generation += 1;
        state.locked = false;
        state.fault = None;
        for (name, file) in &mut state.files {
            let durable = file.durable.len();
            let unsynced = file.data.len().saturating_sub(durable);
            let kept = keep(name, unsynced).min(unsynced);
            let mut survived = file.durable.clone();
            if file.data.starts_with(&file.durable) {
                survived.extend_from_slice(&file.data[durable..durable + kept]);
            }
            file.data = survived.clone();
            file.durable = survived;
        }
    }

    /// A handle for the next "process", after a crash.
    pub fn after_crash(&self) -> Self {
        Self { state: self.state.clone(), generation: lock(&self.state).generation }
    }

    /// The bytes of a file, as the process sees them.
    pub fn contents(&self, name: &str) -> Option<Vec<u8>> {
        lock(&self.state).files.get(name).map(|f| f.data.clone())
    }

    /// Overwrites bytes of a file in place (to simulate disk corruption), durably.
    pub fn corrupt(&self, name: &str, offset: usize, bytes: &[u8]) {
        let mut state = lock(&self.state);
        if let Some(file) = state.files.get_mut(name) {
            let end = (offset + bytes.len()).min(file.data.len());
            if offset < end {
                file.data[offset..end].copy_from_slice(&bytes[..end - offset]);
            }
            file.durable = file.data.clone();
        }
    }
}

impl AppendFile for MemAppend {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        let mut state = live(&self.state, self.generation)?;
        let fault = state.fault;
        let file = state.files.get_mut(&self.name).ok_or_else(|| missing(&self.name))?;
        if let Some(Fault::FailAppendAfter(written)) = fault {
            file.data.extend_from_slice(&data[..written.min(data.len())]);
            state.fault = None;
            return Err(io::Error::other("injected append failure"));
        }
        file.data.extend_from_slice(data);
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        mem_sync(&self.state, self.generation, &self.name)
    }

    fn reserve(&mut self, _len: u64) -> io::Result<()> {
        let state = live(&self.state, self.generation)?;
        if state.fault == Some(Fault::FailReserve) {
            return Err(io::Error::from_raw_os_error(28)); // ENOSPC
        }
        Ok(())
    }

    fn syncer(&self) -> io::Result<Option<Arc<dyn FileSync>>> {
        let (state, generation, name) = (self.state.clone(), self.generation, self.name.clone());
        Ok(Some(Arc::new(MemSync { state, generation, name })))
    }
}

/// Syncs a [`MemStorage`] file from another thread, as [`FsSync`] does a real one.
#[derive(Debug)]
struct MemSync {
    state: Arc<Mutex<MemState>>,
    generation: u64,
    name: String,
}

impl FileSync for MemSync {
    fn sync(&self) -> io::Result<()> {
        mem_sync(&self.state, self.generation, &self.name)
    }
}

/// Makes a memory file's data durable, or fails with an armed [`Fault::FailSync`] (panics
/// with an armed [`Fault::PanicSync`]).
fn mem_sync(state: &Mutex<MemState>, generation: u64, name: &str) -> io::Result<()> {
    let mut state = live(state, generation)?;
    if state.fault == Some(Fault::FailSync) {
        state.fault = None;
        return Err(io::Error::other("injected sync failure"));
    }
    if state.fault == Some(Fault::PanicSync) {
        state.fault = None;
        drop(state);
        panic!("injected sync panic");
    }
    let file = state.files.get_mut(name).ok_or_else(|| missing(name))?;
    file.durable = file.data.clone();
    Ok(())
}

impl Storage for MemStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        Ok(live(&self.state, self.generation)?.files.keys().cloned().collect())
    }

    fn exists(&self) -> bool {
        lock(&self.state).exists
    }

    fn create_dir(&self) -> io::Result<()> {
        live(&self.state, self.generation)?.exists = true;
        Ok(())
    }

    fn lock(&self) -> io::Result<Box<dyn fmt::Debug + Send + Sync>> {
        let mut state = live(&self.state, self.generation)?;
        if state.locked {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "locked by another process"));
        }
        state.locked = true;
        Ok(Box::new(MemLock { state: self.state.clone(), generation: self.generation }))
    }

    fn len(&self, name: &str) -> io::Result<u64> {
        let state = live(&self.state, self.generation)?;
        Ok(state.files.get(name).ok_or_else(|| missing(name))?.data.len() as u64)
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let state = live(&self.state, self.generation)?;
        let data = &state.files.get(name).ok_or_else(|| missing(name))?.data;
        let start = (offset as usize).min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }

    fn read_all(&self, name: &str) -> io::Result<Vec<u8>> {
        let state = live(&self.state, self.generation)?;
        Ok(state.files.get(name).ok_or_else(|| missing(name))?.data.clone())
    }

    fn create(&self, name: &str) -> io::Result<Box<dyn AppendFile>> {
        let mut state = live(&self.state, self.generation)?;
        if state.files.contains_key(name) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, name.to_owned()));
        }
        state.files.insert(name.to_owned(), MemFile::default());
        let (state, generation) = (self.state.clone(), self.generation);
        Ok(Box::new(MemAppend { state, generation, name: name.to_owned() }))
    }

    fn open_append(&self, name: &str) -> io::Result<Box<dyn AppendFile>> {
        if !live(&self.state, self.generation)?.files.contains_key(name) {
            return Err(missing(name));
        }
        let (state, generation) = (self.state.clone(), self.generation);
        Ok(Box::new(MemAppend { state, generation, name: name.to_owned() }))
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let mut state = live(&self.state, self.generation)?;
        let file = state.files.get_mut(name).ok_or_else(|| missing(name))?;
        file.data.truncate(len as usize);
        file.durable = file.data.clone();
        Ok(())
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        live(&self.state, self.generation)?
            .files
            .remove(name)
            .map(drop)
            .ok_or_else(|| missing(name))
    }

    fn write_atomic(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let mut state = live(&self.state, self.generation)?;
        let file = MemFile { data: data.to_vec(), durable: data.to_vec() };
        state.files.insert(name.to_owned(), file);
        Ok(())
    }

    fn sync_dir(&self) -> io::Result<()> {
        Ok(())
    }

    fn replace(&self, from: &str, name: &str) -> io::Result<()> {
        let mut state = live(&self.state, self.generation)?;
        let file = state.files.remove(from).ok_or_else(|| missing(from))?;
        // Renamed and the directory synced: the name holds what `from` held durably.
        let file = MemFile { data: file.data, durable: file.durable };
        state.files.insert(name.to_owned(), file);
        Ok(())
    }
}

//! The FUSE side: a passthrough to BACKING that tells [`Inner`] about every
//! change, so it can tell what a sync makes durable.
//!
//! Entry and attribute TTLs are 0 and no open sets `FOPEN_KEEP_CACHE`, so
//! the kernel asks again after a `cut` or a corruption.

use std::ffi::OsStr;
use std::fs::{self, File, Metadata, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::state::{cpath, errno, kind_of, list_dir, Fid, Handle, Inner, ROOT};

const TTL: Duration = Duration::ZERO;

/// The state shared by the FUSE threads and the control socket.
#[derive(Debug)]
pub struct Shared {
    pub inner: Mutex<Inner>,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panicked request must not wedge the mount.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The FUSE filesystem.
#[derive(Debug)]
pub struct FaultFs {
    pub shared: Arc<Shared>,
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH
    }
}

fn attr(fid: Fid, md: &Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(fid),
        size: md.len(),
        blocks: md.blocks(),
        atime: time(md.atime(), md.atime_nsec()),
        mtime: time(md.mtime(), md.mtime_nsec()),
        ctime: time(md.ctime(), md.ctime_nsec()),
        crtime: time(md.ctime(), md.ctime_nsec()),
        kind: kind_of(md),
        perm: (md.mode() & 0o7777) as u16,
        nlink: md.nlink() as u32,
        uid: md.uid(),
        gid: md.gid(),
        rdev: md.rdev() as u32,
        blksize: md.blksize() as u32,
        flags: 0,
    }
}

fn lstat(p: &Path) -> Result<Metadata, Errno> {
    fs::symlink_metadata(p).map_err(errno)
}

/// The new entry belongs to the caller, not to us.
fn chown_to(req: &Request, p: &Path) {
    // SAFETY: geteuid has no preconditions.
    if req.uid() == unsafe { libc::geteuid() } {
        return;
    }
    if let Ok(c) = cpath(p) {
        // SAFETY: c is a valid NUL-terminated path.
        unsafe { libc::lchown(c.as_ptr(), req.uid(), req.gid()) };
    }
}

fn check(rc: libc::c_int) -> Result<(), Errno> {
    if rc < 0 {
        Err(errno(std::io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

/// Open flags for the backing file: the access mode and what matters to
/// the data, never O_APPEND (the kernel gives the offset) or O_CREAT.
fn backing_flags(flags: i32) -> i32 {
    flags & (libc::O_NOATIME | libc::O_NOFOLLOW)
}

fn open_backing(path: &Path, flags: i32) -> Result<File, Errno> {
    let mut o = OpenOptions::new();
    match flags & libc::O_ACCMODE {
        // Write-only opens read too: the first change copies the old content.
        libc::O_WRONLY | libc::O_RDWR => o.read(true).write(true),
        _ => o.read(true),
    };
    o.custom_flags(backing_flags(flags));
    o.open(path).map_err(errno)
}

fn is_sync(flags: i32) -> bool {
    flags & libc::O_DSYNC != 0
}

impl FaultFs {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.lock()
    }

    /// Makes a new entry known and answers with it.
    fn entry_made(&self, inner: &mut Inner, parent: Fid, name: &OsStr, p: &Path) -> Result<FileAttr, Errno> {
        let md = lstat(p)?;
        let fid = inner.created(parent, name, &md);
        Ok(attr(fid, &md))
    }

    /// Waits `delay-fsync`, outside the lock, then runs a sync unless an
    /// armed failure eats it.
    fn sync(&self, f: impl FnOnce(&mut Inner) -> Result<(), Errno>) -> Result<(), Errno> {
        let delay = self.lock().faults.delay_ms;
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        let mut inner = self.lock();
        if inner.take_fsync_failure() {
            return Err(Errno::EIO);
        }
        f(&mut inner)
    }

    #[allow(clippy::too_many_arguments)] // one per FUSE setattr field
    fn do_setattr(
        &self,
        ino: Fid,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        fh: Option<FileHandle>,
    ) -> Result<FileAttr, Errno> {
        let mut inner = self.lock();
        let handle = fh.and_then(|fh| inner.file_handle(fh.0).ok());
        let path = inner.path_of(ino);
        if let Some(size) = size {
            let file = match &handle {
                Some((_, f, _)) => f.clone(),
                None => Arc::new(OpenOptions::new().read(true).write(true).open(path.clone()?).map_err(errno)?),
            };
            let old = file.metadata().map_err(errno)?.len();
            inner.check_space(size.saturating_sub(old))?;
            inner.ensure_stored(ino, &file)?;
            file.set_len(size).map_err(errno)?;
            inner.grew(old, size);
            inner.resized(ino, old, size);
        }
        if let Some(mode) = mode {
            match &handle {
                Some((_, f, _)) => f.set_permissions(fs::Permissions::from_mode(mode & 0o7777)),
                None => fs::set_permissions(path.clone()?, fs::Permissions::from_mode(mode & 0o7777)),
            }
            .map_err(errno)?;
            inner.meta_changed(ino);
        }
        if uid.is_some() || gid.is_some() {
            let c = cpath(&path.clone()?)?;
            let u = uid.unwrap_or(u32::MAX);
            let g = gid.unwrap_or(u32::MAX);
            // SAFETY: c is a valid NUL-terminated path.
            check(unsafe { libc::lchown(c.as_ptr(), u, g) })?;
            inner.meta_changed(ino);
        }
        if atime.is_some() || mtime.is_some() {
            let ts = |t: Option<TimeOrNow>| match t {
                None => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
                Some(TimeOrNow::Now) => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
                Some(TimeOrNow::SpecificTime(t)) => {
                    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
                    libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long }
                }
            };
            let times = [ts(atime), ts(mtime)];
            let c = cpath(&path.clone()?)?;
            // SAFETY: c is a valid path and times has two entries.
            check(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) })?;
        }
        let md = match &handle {
            Some((_, f, _)) => f.metadata().map_err(errno)?,
            None => lstat(&path?)?,
        };
        Ok(attr(ino, &md))
    }

    fn do_rename(&self, parent: Fid, name: &OsStr, np: Fid, nn: &OsStr, flags: RenameFlags) -> Result<(), Errno> {
        let mut inner = self.lock();
        let from = inner.child_path(parent, name)?;
        let to = inner.child_path(np, nn)?;
        let md = lstat(&from)?;
        let fid = inner.register(parent, name, &md);
        let target = fs::symlink_metadata(&to).ok();
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        if let (Some(t), false) = (&target, exchange) {
            inner.before_unlink(t, &to)?;
        }
        let target_fid = match (&target, exchange) {
            (Some(t), true) => Some(inner.register(np, nn, t)),
            _ => None,
        };
        let (cf, ct) = (cpath(&from)?, cpath(&to)?);
        // SAFETY: both are valid NUL-terminated paths.
        check(unsafe { libc::renameat2(libc::AT_FDCWD, cf.as_ptr(), libc::AT_FDCWD, ct.as_ptr(), flags.bits()) })?;
        match (&target, target_fid) {
            (Some(_), Some(tf)) => inner.renamed(tf, np, nn, parent, name),
            (Some(t), None) if t.ino() != md.ino() => inner.unlinked(np, nn, t),
            _ => {}
        }
        inner.renamed(fid, parent, name, np, nn);
        Ok(())
    }

    fn do_write(&self, ino: Fid, fh: u64, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        let mut inner = self.lock();
        let (fid, file, sync) = inner.file_handle(fh)?;
        let fid = if fid == ino { fid } else { ino };
        let old = file.metadata().map_err(errno)?.len();
        let end = offset + data.len() as u64;
        inner.check_space(end.saturating_sub(old))?;
        inner.ensure_stored(fid, &file)?;
        file.write_all_at(data, offset).map_err(errno)?;
        inner.grew(old, old.max(end));
        inner.wrote(fid, old, offset, data.len() as u64);
        if sync {
            inner.fsync_file(fid, Some(fh))?;
        }
        Ok(data.len() as u32)
    }
}

impl Filesystem for FaultFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.child_path(parent.0, name)?;
            let md = lstat(&p)?;
            let fid = inner.register(parent.0, name, &md);
            Ok(attr(fid, &md))
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let inner = self.lock();
        let md = match fh.and_then(|fh| inner.file_handle(fh.0).ok()) {
            Some((_, f, _)) => f.metadata().map_err(errno),
            None => inner.path_of(ino.0).and_then(|p| lstat(&p)),
        };
        match md {
            Ok(md) => reply.attr(&TTL, &attr(ino.0, &md)),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        match self.do_setattr(ino.0, mode, uid, gid, size, atime, mtime, fh) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let inner = self.lock();
        match inner.path_of(ino.0).and_then(|p| fs::read_link(p).map_err(errno)) {
            Ok(t) => reply.data(t.as_os_str().as_encoded_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        let mut inner = self.lock();
        let r = (|| {
            inner.check_space(0)?;
            let p = inner.child_path(parent.0, name)?;
            let c = cpath(&p)?;
            // SAFETY: c is a valid NUL-terminated path.
            check(unsafe { libc::mknod(c.as_ptr(), (mode & !umask) as libc::mode_t, rdev as libc::dev_t) })?;
            chown_to(req, &p);
            self.entry_made(&mut inner, parent.0, name, &p)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.child_path(parent.0, name)?;
            fs::create_dir(&p).map_err(errno)?;
            fs::set_permissions(&p, fs::Permissions::from_mode(mode & !umask & 0o7777)).map_err(errno)?;
            chown_to(req, &p);
            self.entry_made(&mut inner, parent.0, name, &p)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.child_path(parent.0, name)?;
            let md = lstat(&p)?;
            inner.register(parent.0, name, &md);
            inner.before_unlink(&md, &p)?;
            fs::remove_file(&p).map_err(errno)?;
            inner.unlinked(parent.0, name, &md);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.child_path(parent.0, name)?;
            let md = lstat(&p)?;
            inner.register(parent.0, name, &md);
            fs::remove_dir(&p).map_err(errno)?;
            inner.unlinked(parent.0, name, &md);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.child_path(parent.0, link_name)?;
            std::os::unix::fs::symlink(target, &p).map_err(errno)?;
            chown_to(req, &p);
            self.entry_made(&mut inner, parent.0, link_name, &p)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        match self.do_rename(parent.0, name, newparent.0, newname, flags) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let mut inner = self.lock();
        let r = (|| {
            let from = inner.path_of(ino.0)?;
            let to = inner.child_path(newparent.0, newname)?;
            fs::hard_link(&from, &to).map_err(errno)?;
            inner.linked(ino.0, newparent.0, newname);
            let md = lstat(&to)?;
            Ok(attr(ino.0, &md))
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.path_of(ino.0)?;
            let file = open_backing(&p, flags.0)?;
            Ok(inner.add_handle(Handle::File { fid: ino.0, file: Arc::new(file), sync: is_sync(flags.0) }))
        })();
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut inner = self.lock();
        let r = (|| {
            inner.check_space(0)?;
            let p = inner.child_path(parent.0, name)?;
            let mut o = OpenOptions::new();
            o.read(true).write(true).create(true).truncate(false);
            if flags & libc::O_EXCL != 0 {
                o.create_new(true);
            }
            o.mode(mode & !umask & 0o7777).custom_flags(backing_flags(flags));
            let file = o.open(&p).map_err(errno)?;
            chown_to(req, &p);
            let a = self.entry_made(&mut inner, parent.0, name, &p)?;
            let fh = inner.add_handle(Handle::File { fid: a.ino.0, file: Arc::new(file), sync: is_sync(flags) });
            Ok((a, fh))
        })();
        match r {
            Ok((a, fh)) => reply.created(&TTL, &a, Generation(0), FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let file = self.lock().file_handle(fh.0);
        let r = file.and_then(|(_, f, _)| {
            let mut buf = vec![0u8; size as usize];
            let mut done = 0;
            while done < buf.len() {
                match f.read_at(&mut buf[done..], offset + done as u64) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(errno(e)),
                }
            }
            buf.truncate(done);
            Ok(buf)
        });
        match r {
            Ok(b) => reply.data(&b),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.do_write(ino.0, fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.lock().release(fh.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.sync(|inner| inner.fsync_file(ino.0, Some(fh.0))) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut inner = self.lock();
        let r = (|| {
            let p = inner.path_of(ino.0)?;
            let md = lstat(&p)?;
            if !md.is_dir() {
                return Err(Errno::ENOTDIR);
            }
            let parent = inner.parent_of(ino.0);
            let mut entries =
                vec![(".".into(), ino.0, FileType::Directory), ("..".into(), parent, FileType::Directory)];
            for (name, md) in list_dir(&p) {
                let fid = inner.register(ino.0, &name, &md);
                entries.push((name, fid, kind_of(&md)));
            }
            Ok(inner.add_handle(Handle::Dir { fid: ino.0, entries }))
        })();
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let inner = self.lock();
        let Some(Handle::Dir { entries, .. }) = inner.handles.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        for (i, (name, fid, kind)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*fid), (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        self.lock().release(fh.0);
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.sync(|inner| {
            inner.fsync_dir(ino.0);
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let inner = self.lock();
        let r = inner.path_of(ROOT).and_then(|p| {
            let c = cpath(&p)?;
            // SAFETY: statvfs is plain data; c is a valid path.
            let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
            check(unsafe { libc::statvfs(c.as_ptr(), &mut s) })?;
            Ok(s)
        });
        match r {
            Ok(s) => {
                let (blocks, bfree, bavail) = inner.space_limited(s.f_blocks, s.f_bfree, s.f_bavail, s.f_frsize);
                reply.statfs(
                    blocks,
                    bfree,
                    bavail,
                    s.f_files,
                    s.f_ffree,
                    s.f_bsize as u32,
                    s.f_namemax as u32,
                    s.f_frsize as u32,
                )
            }
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut inner = self.lock();
        let r = (|| {
            let (_, file, _) = inner.file_handle(fh.0)?;
            let old = file.metadata().map_err(errno)?.len();
            let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
            let end = offset + length;
            if !keep {
                inner.check_space(end.saturating_sub(old))?;
            }
            inner.ensure_stored(ino.0, &file)?;
            use std::os::fd::AsRawFd;
            // SAFETY: the fd is open for as long as `file` lives.
            check(unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as libc::off_t, length as libc::off_t) })?;
            let new = file.metadata().map_err(errno)?.len();
            inner.grew(old, new);
            if mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
                inner.wrote(ino.0, old, offset, end.min(new).saturating_sub(offset));
            }
            if new != old {
                inner.resized(ino.0, old, new);
            }
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

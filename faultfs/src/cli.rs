//! Command-line arguments (clap structs only).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// A FUSE passthrough filesystem that forgets what was not synced.
#[derive(Debug, Parser)]
#[command(name = "faultfs", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mount BACKING at MOUNTPOINT in the foreground until unmounted or
    /// sent SIGTERM/SIGINT.
    Mount(MountArgs),
    /// Send one command to a running mount's control socket and print the
    /// answer; exits 1 if the answer is `err ...`.
    Ctl {
        /// The control socket given to `mount --control`.
        socket: PathBuf,
        /// The command and its arguments, e.g. `cut 7` or `fail-fsync 2`.
        #[arg(required = true, num_args = 1.., trailing_var_arg = true)]
        command: Vec<String>,
    },
}

#[derive(Debug, clap::Args)]
pub struct MountArgs {
    /// Directory holding the live contents (the passthrough target).
    #[arg(long)]
    pub backing: PathBuf,
    /// Where to mount.
    #[arg(long)]
    pub mountpoint: PathBuf,
    /// Unix socket taking one-line control commands.
    #[arg(long)]
    pub control: PathBuf,
    /// A directory's entries become durable only when that directory is
    /// fsync'd (default: any fsync commits the whole namespace, like ext4's
    /// journal).
    #[arg(long)]
    pub strict: bool,
    /// Where the durable copies of files are kept. Default: a sibling of
    /// BACKING named `.NAME.faultfs-state`. Emptied at mount.
    #[arg(long)]
    pub state: Option<PathBuf>,
    /// FUSE worker threads; more than one lets other requests run while a
    /// `delay-fsync` sleeps. Default 4, minimum 1.
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
}

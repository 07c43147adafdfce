//! `faultfs mount ...` and `faultfs ctl SOCK CMD...`.

use std::process::ExitCode;

use clap::Parser;
use faultfs::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Mount(args) => match faultfs::mount::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("faultfs: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Ctl { socket, command } => match faultfs::control::request(&socket, &command.join(" ")) {
            Ok(answer) => {
                println!("{answer}");
                if answer.starts_with("ok") {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Err(e) => {
                eprintln!("faultfs: {e}");
                ExitCode::from(2)
            }
        },
    }
}

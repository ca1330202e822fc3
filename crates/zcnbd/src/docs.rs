//! `zcnbd generate-docs DIR` (hidden): man pages and shell completions from the clap
//! definitions, so they never drift from `--help`. Writes `DIR/man/zcnbd.1`,
//! `zcnbd-serve.1`, `zcnbd-bench.1`, `zcnbd-bitmap.1` and `DIR/completions/zcnbd.bash`,
//! `_zcnbd` (zsh), `zcnbd.fish`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use clap::Command;
use clap_complete::Shell;

/// Options of `zcnbd generate-docs`.
#[derive(Debug, clap::Args)]
pub struct DocsArgs {
    /// Output directory (man/ and completions/ are created in it).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
}

/// Writes the man pages and completions for `cli` (the whole command tree).
pub fn run(args: &DocsArgs, cli: Command) -> io::Result<()> {
    // `zcnbd help` is clap's, not worth a page of its own.
    let mut cli = cli.disable_help_subcommand(true);
    cli.build();
    let man = args.dir.join("man");
    fs::create_dir_all(&man)?;
    write_man(&man.join("zcnbd.1"), cli.clone())?;
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
        // clap takes names as `&'static str` (without its "string" feature); this runs once
        // per subcommand in a short-lived command, so leaking the few bytes is fine.
        let name: &'static str = Box::leak(format!("zcnbd-{}", sub.get_name()).into_boxed_str());
        let page = sub.clone().name(name).display_name(name);
        write_man(&man.join(format!("{name}.1")), page)?;
    }
    let completions = args.dir.join("completions");
    fs::create_dir_all(&completions)?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let path = completions.join(completion_file(shell));
        let mut file = io::BufWriter::new(fs::File::create(&path)?);
        clap_complete::generate(shell, &mut cli, "zcnbd", &mut file);
        io::Write::flush(&mut file)?;
    }
    Ok(())
}

fn write_man(path: &Path, command: Command) -> io::Result<()> {
    let mut out = Vec::new();
    clap_mangen::Man::new(command).render(&mut out)?;
    fs::write(path, out)
}

/// Where each shell looks for completions of `zcnbd` by default.
fn completion_file(shell: Shell) -> &'static str {
    match shell {
        Shell::Zsh => "_zcnbd",
        Shell::Fish => "zcnbd.fish",
        _ => "zcnbd.bash",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn writes_man_pages_and_completions() {
        let dir = tempfile::tempdir().unwrap();
        let args = DocsArgs {
            dir: dir.path().to_owned(),
        };
        run(&args, crate::Cli::command()).unwrap();
        let serve = fs::read_to_string(dir.path().join("man/zcnbd-serve.1")).unwrap();
        assert!(serve.contains("zcnbd\\-serve"), "{serve}");
        assert!(serve.contains("pid\\-file"));
        let top = fs::read_to_string(dir.path().join("man/zcnbd.1")).unwrap();
        assert!(
            !top.contains("generate\\-docs"),
            "the hidden subcommand is not shown"
        );
        assert!(dir.path().join("man/zcnbd-bench.1").exists());
        assert!(!dir.path().join("man/zcnbd-generate-docs.1").exists());
        assert!(!dir.path().join("man/zcnbd-help.1").exists());
        for file in ["zcnbd.bash", "_zcnbd", "zcnbd.fish"] {
            let text = fs::read_to_string(dir.path().join("completions").join(file)).unwrap();
            assert!(text.contains("exit-with-parent"), "{file}");
        }
    }
}

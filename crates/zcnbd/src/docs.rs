//! `zcnbd generate-docs DIR` (hidden): man pages and shell completions from the clap
//! definitions, so they never drift from `--help`, with the sections clap does not know
//! (`man_sections.rs`: EXAMPLES, ENVIRONMENT, SIGNALS, FILES, EXIT STATUS, SEE ALSO). Writes
//! `DIR/man/zcnbd.1`, `zcnbd-serve.1`, `zcnbd-bench.1`, `zcnbd-bitmap.1`, `zcnbd-filter.1`, `zcnbd.toml.5` and
//! `DIR/completions/zcnbd.bash`, `_zcnbd` (zsh), `zcnbd.fish`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use clap::Command;
use clap_complete::Shell;

use crate::man_sections::{self, Section};

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
    write_man(&man.join("zcnbd.1"), cli.clone(), man_sections::ZCNBD)?;
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
        let extra = match sub.get_name() {
            "serve" => man_sections::SERVE,
            "bench" => man_sections::BENCH,
            "bitmap" => man_sections::BITMAP,
            "filter" => man_sections::FILTER,
            "attach" | "detach" | "list" => man_sections::ATTACH,
            _ => &[],
        };
        // clap takes names as `&'static str` (without its "string" feature); this runs once
        // per subcommand in a short-lived command, so leaking the few bytes is fine.
        let name: &'static str = Box::leak(format!("zcnbd-{}", sub.get_name()).into_boxed_str());
        let page = sub.clone().name(name).display_name(name);
        write_man(&man.join(format!("{name}.1")), page, extra)?;
    }
    write_toml_page(&man.join("zcnbd.toml.5"), &cli)?;
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

/// clap's page for `command` with `extra` after its options and subcommands.
fn write_man(path: &Path, command: Command, extra: &[Section]) -> io::Result<()> {
    let has_options = command.get_arguments().any(|a| !a.is_hide_set());
    let has_subcommands = command.get_subcommands().any(|s| !s.is_hide_set());
    let has_version = command.get_version().is_some();
    let man = clap_mangen::Man::new(command);
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if has_options {
        man.render_options_section(&mut out)?;
    }
    if has_subcommands {
        man.render_subcommands_section(&mut out)?;
    }
    for section in extra {
        out.extend_from_slice(format!(".SH \"{}\"\n", section.title).as_bytes());
        out.extend_from_slice(man_sections::roff(section.paragraphs).as_bytes());
    }
    if has_version {
        man.render_version_section(&mut out)?;
    }
    fs::write(path, out)
}

/// zcnbd.toml(5), the configuration file's page.
fn write_toml_page(path: &Path, cli: &Command) -> io::Result<()> {
    let version = cli.get_version().unwrap_or_default();
    let mut out = format!(
        ".TH ZCNBD.TOML 5 \"\" \"zcnbd {version}\"\n.SH NAME\nzcnbd.toml \\- the exports of zcnbd serve \\-\\-config\n"
    );
    for (title, paragraphs) in man_sections::toml_page() {
        let paragraphs: Vec<&str> = paragraphs.iter().map(String::as_str).collect();
        out.push_str(&format!(".SH \"{title}\"\n"));
        out.push_str(&man_sections::roff(&paragraphs));
    }
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
        for section in [
            "EXAMPLES",
            "ENVIRONMENT",
            "SIGNALS",
            "FILES",
            "EXIT STATUS",
            "SEE ALSO",
        ] {
            assert!(serve.contains(&format!(".SH \"{section}\"")), "{section}");
        }
        let toml = fs::read_to_string(dir.path().join("man/zcnbd.toml.5")).unwrap();
        assert!(toml.contains("bitmap_granularity") && toml.contains("verify_peer"));
        assert!(!dir.path().join("man/zcnbd-generate-docs.1").exists());
        assert!(!dir.path().join("man/zcnbd-help.1").exists());
        for file in ["zcnbd.bash", "_zcnbd", "zcnbd.fish"] {
            let text = fs::read_to_string(dir.path().join("completions").join(file)).unwrap();
            assert!(text.contains("exit-with-parent"), "{file}");
        }
    }
}

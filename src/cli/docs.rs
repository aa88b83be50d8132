//! `bootfleet completions SHELL` and `bootfleet man DIR`: generated from the command
//! line's own definition, so they cannot drift from `--help`.

use std::path::Path;

use anyhow::Context;

pub fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut cmd = super::command();
    clap_complete::generate(shell, &mut cmd, "bootfleet", &mut std::io::stdout());
    Ok(())
}

/// One page per command, named by its path (`bootfleet-node-list.1`); each written to a
/// temporary file and renamed, so a reader never sees half a page.
pub fn man_pages(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let cmd = super::command();
    let mut written = 0;
    write_pages(&cmd, "bootfleet", dir, &mut written)?;
    eprintln!("{written} man pages in {}", dir.display());
    Ok(())
}

fn write_pages(
    cmd: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut usize,
) -> anyhow::Result<()> {
    let mut text = Vec::new();
    clap_mangen::Man::new(cmd.clone())
        .title(name.to_uppercase())
        .render(&mut text)?;
    let path = dir.join(format!("{name}.1"));
    let tmp = dir.join(format!(".{name}.1.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    *written += 1;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        write_pages(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}

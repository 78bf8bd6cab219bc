//! A private apt setup for the lab: its own sources list, package lists and cache under
//! the lab cache, so packages from any Debian suite can be downloaded (never installed)
//! without touching the host's apt configuration.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};

use super::{need_tool, run};

/// Debian suites the lab downloads from (kernels, QEMU builds).
const SUITES: &[(&str, &str)] = &[
    ("http://deb.debian.org/debian", "bullseye"),
    ("http://deb.debian.org/debian-security", "bullseye-security"),
    ("http://deb.debian.org/debian", "bookworm"),
    ("http://deb.debian.org/debian", "bookworm-updates"),
    ("http://deb.debian.org/debian-security", "bookworm-security"),
    ("http://deb.debian.org/debian", "bookworm-backports"),
    ("http://deb.debian.org/debian", "trixie"),
    ("http://deb.debian.org/debian-security", "trixie-security"),
    ("http://deb.debian.org/debian", "sid"),
];

/// Package lists older than this are refreshed before a lookup that needs them.
const LISTS_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// The lab's private apt: `<cache>/apt/{sources.list,lists,cache}`.
pub struct Apt {
    root: PathBuf,
}

impl Apt {
    pub fn new(cache: &Path) -> Result<Apt> {
        let root = cache.join("apt");
        fs::create_dir_all(root.join("lists/partial"))?;
        fs::create_dir_all(root.join("cache/archives/partial"))?;
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        let mut list = String::new();
        for (uri, suite) in SUITES {
            let signed = if Path::new(keyring).exists() {
                format!(" [signed-by={keyring}]")
            } else {
                String::new()
            };
            list += &format!("deb{signed} {uri} {suite} main\n");
        }
        let sources = root.join("sources.list");
        if fs::read_to_string(&sources).ok().as_deref() != Some(list.as_str()) {
            fs::write(&sources, list)?;
            // New suites: the lists must be fetched again.
            let _ = fs::remove_file(root.join("updated"));
        }
        Ok(Apt { root })
    }

    fn options(&self) -> Vec<String> {
        let r = &self.root;
        vec![
            format!(
                "-oDir::Etc::sourcelist={}",
                r.join("sources.list").display()
            ),
            "-oDir::Etc::sourceparts=-".into(),
            format!("-oDir::State::lists={}", r.join("lists").display()),
            format!("-oDir::Cache={}", r.join("cache").display()),
            "-oAPT::Get::List-Cleanup=0".into(),
            // Downloads go to a root-owned cache dir: no _apt sandbox user.
            "-oAPT::Sandbox::User=root".into(),
            // Only Packages indexes (no DEP-11 / translations).
            "-oAcquire::IndexTargets::deb::DEP-11::DefaultEnabled=false".into(),
            "-oAcquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false".into(),
            "-oAcquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false".into(),
            "-oAcquire::Languages=none".into(),
        ]
    }

    fn command(&self, tool: &str) -> Command {
        let mut c = Command::new(tool);
        c.args(self.options());
        c
    }

    /// Refreshes the package lists if they are missing or older than a day (`force`: always).
    pub fn update(&self, force: bool) -> Result<()> {
        let stamp = self.root.join("updated");
        let fresh = fs::metadata(&stamp)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age < LISTS_MAX_AGE);
        if fresh && !force {
            return Ok(());
        }
        need_tool("apt-get", "apt")?;
        eprintln!("viotrace-vm: refreshing the lab's private apt lists (Debian suites)");
        run(self.command("apt-get").args(["-q", "update"]))
            .context("apt-get update with the lab's private sources list")?;
        fs::write(&stamp, b"")?;
        Ok(())
    }

    /// Names of packages matching `pattern` (an apt-cache search regex on names).
    pub fn search_names(&self, pattern: &str) -> Result<Vec<String>> {
        self.update(false)?;
        let out = run(self
            .command("apt-cache")
            .args(["search", "--names-only", pattern]))?;
        Ok(out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect())
    }

    /// Downloads packages (`name`, `name/suite` or `name=version`) into `dir`, returning the .debs.
    /// Stale lists (a 404) are refreshed once.
    pub fn download(&self, packages: &[String], dir: &Path) -> Result<Vec<PathBuf>> {
        self.update(false)?;
        need_tool("apt-get", "apt")?;
        fs::create_dir_all(dir)?;
        let attempt = || {
            run(self
                .command("apt-get")
                .args(["-q", "download"])
                .args(packages)
                .current_dir(dir))
        };
        if let Err(first) = attempt() {
            self.update(true)?;
            attempt().with_context(|| format!("download {packages:?} (first try: {first:#})"))?;
        }
        let mut debs: Vec<PathBuf> = fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "deb"))
            .collect();
        debs.sort();
        if debs.len() < packages.len() {
            bail!(
                "apt-get download of {packages:?} left only {} .deb file(s) in {}",
                debs.len(),
                dir.display()
            );
        }
        Ok(debs)
    }
}

/// A control field of a .deb (`Depends`, `Version`, …).
pub fn deb_field(deb: &Path, field: &str) -> Result<String> {
    need_tool("dpkg-deb", "dpkg")?;
    Ok(run(Command::new("dpkg-deb").arg("-f").arg(deb).arg(field))?
        .trim()
        .to_string())
}

/// Extracts a .deb's files into `dir`.
pub fn deb_extract(deb: &Path, dir: &Path) -> Result<()> {
    need_tool("dpkg-deb", "dpkg")?;
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(dir))?;
    Ok(())
}

/// Package names in a Depends field (alternatives and version constraints dropped).
pub fn depends_names(depends: &str) -> Vec<String> {
    depends
        .split(',')
        .flat_map(|alt| alt.split('|'))
        .filter_map(|d| d.split_whitespace().next())
        .map(|d| d.split(':').next().unwrap_or(d).to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_names_drops_versions_and_keeps_alternatives() {
        assert_eq!(
            depends_names(
                "dracut | initramfs-tools (>= 0.120+deb8u2), linux-binary-7.2.13+deb14-cloud-amd64 (= 7.2.13-1), libc6:amd64"
            ),
            [
                "dracut",
                "initramfs-tools",
                "linux-binary-7.2.13+deb14-cloud-amd64",
                "libc6"
            ]
        );
    }
}

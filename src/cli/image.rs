//! `bootfleet image ...`: publish, list, show, tag, history, verify, gc.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Subcommand;
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::Method;

use super::client::Client;
use super::output::{OutputFormat, emit, human_bytes};
use crate::api::image::{
    GcReport, Image, ImageDetail, ImportOutcome, ImportRequest, PublishOutcome, TagMove,
    TagRequest, TagResult, VerifyReport,
};
use crate::api::refs::{ImageRef, TagName};

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Publish a bundle (tar, tar.gz, tar.zst) or a directory holding manifest.toml.
    Publish {
        /// A bundle file (tar, tar.gz, tar.zst) or a directory with manifest.toml.
        path: PathBuf,
        /// Also point this tag (NAME:TAG) at the published image.
        #[arg(long)]
        tag: Option<String>,
    },
    /// Import an OCI image (built as a container) as a two-stage image: its root becomes
    /// one squashfs blob with a dm-verity tree, its kernel and a stage-1 initramfs of its
    /// own modules boot it, and its pins are read from its content.
    Import {
        /// docker://HOST[:PORT]/REPO[:TAG|@DIGEST] (pulled by the server),
        /// oci-archive:PATH[:NAME], docker-archive:PATH[:TAG], oci:DIR[:NAME], or a path
        /// (an OCI layout directory or an archive file), uploaded.
        source: String,
        /// The image name.
        #[arg(long)]
        name: String,
        /// The version to publish it as.
        #[arg(long)]
        version: String,
        /// Also point this tag (NAME:TAG) at the imported image.
        #[arg(long)]
        tag: Option<String>,
        /// The image's kernel command line.
        #[arg(long, default_value = "console=tty0 console=ttyS0,115200n8")]
        cmdline: String,
        /// A pin the content must agree with, NAME=VERSION (kernel, nvidia-driver, ofed,
        /// cuda); repeatable. What the content holds and is not pinned is added.
        #[arg(long = "pin", value_name = "NAME=VERSION")]
        pins: Vec<String>,
        /// A TOML file with the manifest's [pins] and [validation] sections.
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
        /// Keep the image's device files (refused otherwise).
        #[arg(long)]
        allow_devices: bool,
        /// Add the server's bootfleet-agent and its enabled systemd unit to the root.
        #[arg(long)]
        install_agent: bool,
        /// The server's secret holding the registry login (username, password).
        #[arg(long, value_name = "NAME")]
        registry_credential: Option<String>,
        /// Speak plain HTTP to the registry (a local registry on a trusted network).
        #[arg(long)]
        plain_http: bool,
    },
    /// List published images.
    List,
    /// Show one image: REF is sha256:<hex> (or its first 8+ digits), NAME:VERSION or NAME:TAG.
    Show {
        /// The image: sha256:<hex> (or its first 8+ digits), NAME:VERSION or NAME:TAG.
        reference: String,
    },
    /// Point NAME:TAG at REF (a rollback is a tag back to the previous digest).
    Tag {
        /// The image: sha256:<hex> (or its first 8+ digits), NAME:VERSION or NAME:TAG.
        reference: String,
        /// The tag to move, NAME:TAG.
        tag: String,
    },
    /// Every move of NAME:TAG: who, when, from, to.
    History {
        /// The tag, NAME:TAG.
        tag: String,
    },
    /// Remove an image no tag, assignment or running node uses (the refusal names them);
    /// its boot records go with it, and `image gc` then frees its blobs.
    Rm {
        /// The image: sha256:<hex> (or its first 8+ digits), NAME:VERSION or NAME:TAG.
        reference: String,
    },
    /// Re-hash every blob; quarantine the ones that no longer match.
    Verify,
    /// Remove blobs that no image references.
    Gc,
}

pub async fn run(cmd: ImageCommand, client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Publish { path, tag } => {
            if let Some(t) = &tag {
                TagName::parse(t)?;
            }
            let result = publish(client, &path, tag.as_deref()).await?;
            emit(out, &result, |r| {
                let what = if r.created {
                    "published"
                } else {
                    "already published"
                };
                println!("{what} {}:{} {}", r.name, r.version, r.digest);
                if let Some(t) = &r.tag {
                    println!("tagged {} -> {}", t.tag, t.digest);
                }
            })
        }
        ImageCommand::Import {
            source,
            name,
            version,
            tag,
            cmdline,
            pins,
            manifest,
            allow_devices,
            install_agent,
            registry_credential,
            plain_http,
        } => {
            let mut request = ImportRequest {
                name,
                version,
                tag,
                cmdline,
                allow_devices,
                install_agent,
                registry_credential,
                plain_http,
                ..ImportRequest::default()
            };
            if let Some(path) = &manifest {
                let (p, v) = import_manifest(path)?;
                request.pins = p;
                request.validation = v;
            }
            for pin in &pins {
                let (k, v) = pin
                    .split_once('=')
                    .filter(|(k, v)| !k.is_empty() && !v.is_empty())
                    .with_context(|| format!("--pin {pin:?}: NAME=VERSION"))?;
                request.pins.insert(k.to_string(), v.to_string());
            }
            let result = import(client, &source, request).await?;
            emit(out, &result, print_import)
        }
        ImageCommand::List => {
            let images: Vec<Image> = client
                .send(client.request(Method::GET, "/api/v1/images"))
                .await?;
            emit(out, &images, |images| print_images(images))
        }
        ImageCommand::Show { reference } => {
            let r = ImageRef::parse(&reference)?;
            let detail: ImageDetail = client
                .send(client.request(Method::GET, &format!("/api/v1/images/{r}")))
                .await?;
            emit(out, &detail, print_image)
        }
        ImageCommand::Rm { reference } => {
            let r = ImageRef::parse(&reference)?;
            let image: Image = client
                .send(client.request(Method::DELETE, &format!("/api/v1/images/{r}")))
                .await?;
            emit(out, &image, |i| {
                println!(
                    "removed {}:{} ({}); `bootfleet image gc` frees its blobs",
                    i.name, i.version, i.digest
                )
            })
        }
        ImageCommand::Tag { reference, tag } => {
            let r = ImageRef::parse(&reference)?;
            let t = TagName::parse(&tag)?;
            let result: TagResult = client
                .send(
                    client
                        .request(Method::PUT, &format!("/api/v1/tags/{}/{}", t.name, t.tag))
                        .json(&TagRequest {
                            image: r.to_string(),
                        }),
                )
                .await?;
            emit(out, &result, |r| match (&r.from, r.changed) {
                (_, false) => println!("{} already points to {}", r.tag, r.digest),
                (Some(from), true) => println!("{}: {} -> {}", r.tag, from, r.digest),
                (None, true) => println!("{} -> {} (new tag)", r.tag, r.digest),
            })
        }
        ImageCommand::History { tag } => {
            let t = TagName::parse(&tag)?;
            let moves: Vec<TagMove> = client
                .send(client.request(
                    Method::GET,
                    &format!("/api/v1/tags/{}/{}/history", t.name, t.tag),
                ))
                .await?;
            emit(out, &moves, |moves| {
                for m in moves {
                    let from = match (&m.from, &m.from_version) {
                        (Some(d), Some(v)) => format!("{v} ({d})"),
                        (Some(d), None) => d.to_string(),
                        (None, _) => "(new)".into(),
                    };
                    println!(
                        "{}  {}  {} -> {} ({})",
                        m.at, m.actor, from, m.to_version, m.to
                    );
                }
            })
        }
        ImageCommand::Verify => {
            let report: VerifyReport = client
                .send(client.request(Method::POST, "/api/v1/blobs/verify"))
                .await?;
            emit(out, &report, print_verify)?;
            if !report.quarantined.is_empty()
                || !report.missing.is_empty()
                || !report.damaged_objects.is_empty()
            {
                bail!("verify found damaged or missing blobs");
            }
            Ok(())
        }
        ImageCommand::Gc => {
            let report: GcReport = client
                .send(client.request(Method::POST, "/api/v1/blobs/gc"))
                .await?;
            emit(out, &report, |r| {
                println!(
                    "removed {} blobs, freed {}, kept {}",
                    r.removed.len(),
                    human_bytes(r.bytes_freed),
                    r.kept
                );
                if !r.objects_removed.is_empty() {
                    println!(
                        "removed {} objects from the object store, freed {}",
                        r.objects_removed.len(),
                        human_bytes(r.object_bytes_freed)
                    );
                }
            })
        }
    }
}

/// Streams the bundle (a file as is, a directory as a tar made on the fly) to the server.
async fn publish(
    client: &Client,
    path: &Path,
    tag: Option<&str>,
) -> anyhow::Result<PublishOutcome> {
    if path.is_dir() && !path.join(crate::api::image::MANIFEST_NAME).is_file() {
        bail!("{} has no manifest.toml", path.display());
    }
    let mut req = client.request(Method::POST, "/api/v1/images");
    if let Some(t) = tag {
        req = req.query(&[("tag", t)]);
    }
    upload(client, req, path).await
}

/// An import: a registry source goes as JSON for the server to pull; an archive or a
/// layout directory is uploaded with the request in `?spec=`.
async fn import(
    client: &Client,
    source: &str,
    mut request: ImportRequest,
) -> anyhow::Result<ImportOutcome> {
    if source.starts_with("docker://") {
        request.source = Some(source.to_string());
        let req = client
            .request(Method::POST, "/api/v1/images/import")
            .json(&request);
        return client.send(req).await;
    }
    let (path, reference) = archive_source(source);
    request.reference = reference;
    if path.is_dir() && !path.join("index.json").is_file() {
        bail!("{} is not an OCI layout (no index.json)", path.display());
    }
    let req = client
        .request(Method::POST, "/api/v1/images/import")
        .query(&[("spec", serde_json::to_string(&request)?)]);
    upload(client, req, &path).await
}

/// `oci-archive:PATH[:REF]`, `docker-archive:PATH[:REF]`, `oci:DIR[:REF]` or a plain path:
/// the path, and the image named in it if any.
fn archive_source(source: &str) -> (PathBuf, Option<String>) {
    for prefix in ["oci-archive:", "docker-archive:", "oci:"] {
        if let Some(rest) = source.strip_prefix(prefix) {
            // A reference follows the path's last ':' (paths with ':' need the prefix and a
            // reference, as with skopeo).
            return match rest.rsplit_once(':') {
                Some((path, r)) if !r.contains('/') && !Path::new(rest).exists() => {
                    (PathBuf::from(path), Some(r.to_string()))
                }
                _ => (PathBuf::from(rest), None),
            };
        }
    }
    (PathBuf::from(source), None)
}

/// `--manifest FILE`: its [pins] and [validation].
fn import_manifest(
    path: &Path,
) -> anyhow::Result<(
    std::collections::BTreeMap<String, String>,
    Option<serde_json::Value>,
)> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sections {
        #[serde(default)]
        pins: std::collections::BTreeMap<String, String>,
        validation: Option<toml::Table>,
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let s: Sections = toml::from_str(&text)
        .with_context(|| format!("{}: [pins] and [validation] only", path.display()))?;
    let validation = s.validation.map(serde_json::to_value).transpose()?;
    Ok((s.pins, validation))
}

fn print_import(r: &ImportOutcome) {
    let p = &r.publish;
    let what = if p.created {
        "imported"
    } else {
        "already published"
    };
    println!("{what} {}:{} {}", p.name, p.version, p.digest);
    if let Some(t) = &p.tag {
        println!("tagged {} -> {}", t.tag, t.digest);
    }
    let i = &r.import;
    println!("kernel       {}", i.kernel_release);
    for (k, v) in &i.pins {
        let derived = if i.derived_pins.contains(k) {
            " (read from the image)"
        } else {
            ""
        };
        println!("pin          {k} = {v}{derived}");
    }
    println!(
        "rootfs       {} bytes ({}, {} bytes of files in {} layers), verity root {}",
        i.rootfs_bytes, i.compressor, i.root_bytes, i.layers, i.verity_root_hash
    );
    println!("stage 1      {}", i.stage1_modules.join(" "));
    if i.dropped_acls > 0 {
        println!(
            "dropped      POSIX ACLs of {} files (squashfs cannot hold them)",
            i.dropped_acls
        );
    }
    if !i.absent_network_drivers.is_empty() {
        println!(
            "not in the kernel: {} (nodes with these NICs cannot boot it)",
            i.absent_network_drivers.join(" ")
        );
    }
}

/// Streams a file as is, or a directory as a tar made on the fly, as the body of `req`.
async fn upload<T: serde::de::DeserializeOwned>(
    client: &Client,
    mut req: reqwest::RequestBuilder,
    path: &Path,
) -> anyhow::Result<T> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (stream, total): (
        futures_util::stream::BoxStream<'static, std::io::Result<Bytes>>,
        Option<u64>,
    ) = if meta.is_dir() {
        // Not sent as Content-Length (an estimate), only shown: percent and ETA.
        let estimate = tar_size_estimate(path).ok();
        (tar_directory(path.to_path_buf()).boxed(), estimate)
    } else {
        let file = tokio::fs::File::open(path).await?;
        (
            tokio_util::io::ReaderStream::with_capacity(file, 1 << 20).boxed(),
            Some(meta.len()),
        )
    };
    let bar = progress_bar(total);
    let counted = {
        let bar = bar.clone();
        stream.inspect(move |chunk| {
            if let Ok(c) = chunk {
                bar.inc(c.len() as u64);
            }
        })
    };
    req = req.body(reqwest::Body::wrap_stream(counted));
    if let (Some(len), false) = (total, meta.is_dir()) {
        req = req.header(reqwest::header::CONTENT_LENGTH, len);
    }
    let result = client.send(req).await;
    bar.finish_and_clear();
    result
}

fn progress_bar(total: Option<u64>) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    match total {
        Some(len) => ProgressBar::new(len).with_style(
            ProgressStyle::with_template(
                "{bar:40} {percent:>3}% {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("valid template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {bytes} {bytes_per_sec}")
                .expect("valid template"),
        ),
    }
}

/// About the size of `tar_directory(dir)`: a 512-byte header per entry (two for a name
/// past ustar's 100 bytes), file data in 512-byte blocks, the two end blocks. Links are
/// not followed, as in the tar.
fn tar_size_estimate(dir: &Path) -> std::io::Result<u64> {
    const BLOCK: u64 = 512;
    fn walk(dir: &Path, prefix_len: usize, total: &mut u64) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let meta = entry.path().symlink_metadata()?;
            let name_len = prefix_len + entry.file_name().len() + 1;
            *total += BLOCK;
            if name_len > 100 {
                *total += BLOCK + (name_len as u64 + 1).div_ceil(BLOCK) * BLOCK;
            }
            if meta.is_dir() {
                walk(&entry.path(), name_len, total)?;
            } else if meta.is_file() {
                *total += meta.len().div_ceil(BLOCK) * BLOCK;
            }
        }
        Ok(())
    }
    let mut total = BLOCK; // the "." entry
    walk(dir, 2, &mut total)?;
    Ok(total + 2 * BLOCK)
}

/// A tar of `dir` produced on a blocking thread, in deterministic order and headers.
/// Links and special files go in as they are; the server refuses them with a reason.
fn tar_directory(dir: PathBuf) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        let mut writer = ChannelWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(1 << 20),
        };
        let result = (|| {
            let mut builder = tar::Builder::new(&mut writer);
            builder.mode(tar::HeaderMode::Deterministic);
            builder.follow_symlinks(false);
            builder.append_dir_all(".", &dir)?;
            builder.into_inner()?.flush()
        })();
        if let Err(e) = result {
            let _ = tx.blocking_send(Err(e));
        }
    });
    tokio_stream_from(rx)
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= 1 << 20 {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(1 << 20),
        ));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "upload stopped"))
    }
}

fn print_images(images: &[Image]) {
    println!(
        "{:<24} {:<20} {:<20} {:>10}  DIGEST",
        "NAME", "VERSION", "TAGS", "SIZE"
    );
    for i in images {
        let size: u64 = i.artifacts.iter().map(|a| a.size).sum();
        let tags: Vec<&str> = i
            .tags
            .iter()
            .map(|t| t.split_once(':').map_or(t.as_str(), |x| x.1))
            .collect();
        println!(
            "{:<24} {:<20} {:<20} {:>10}  {}{}",
            i.name,
            i.version,
            tags.join(","),
            human_bytes(size),
            i.digest,
            if i.broken.is_some() { "  BROKEN" } else { "" }
        );
    }
}

/// An image, its artifacts and its manifest as written.
fn print_image(d: &ImageDetail) {
    let i = &d.image;
    println!("image:    {}:{}", i.name, i.version);
    println!("digest:   {}", i.digest);
    println!("created:  {}", i.created_at);
    println!("tags:     {}", i.tags.join(", "));
    if let Some(why) = &i.broken {
        println!("broken:   {why}");
    }
    println!("artifacts:");
    for a in &i.artifacts {
        println!(
            "  {:<7} {:<32} {:>10}  {}",
            a.role.as_str(),
            a.path,
            human_bytes(a.size),
            a.digest
        );
    }
    println!("manifest:\n{}", d.manifest.trim_end());
}

fn print_verify(r: &VerifyReport) {
    println!("checked {} blobs ({})", r.checked, human_bytes(r.bytes));
    for d in &r.quarantined {
        println!("QUARANTINED {d}: content does not match its digest");
    }
    for d in &r.missing {
        println!("MISSING {d}: needed by an image; publish that image again to restore it");
    }
    for d in &r.damaged_objects {
        println!(
            "DAMAGED {d}: the object store's copy does not match its digest (never served); publish that image again"
        );
    }
    if r.quarantined.is_empty() && r.missing.is_empty() && r.damaged_objects.is_empty() {
        println!("all blobs intact");
    }
}

#[cfg(test)]
mod tests {
    /// The progress bar's total for a directory is close to the tar actually sent.
    #[test]
    fn a_directory_tar_size_estimate_is_close() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(root.join("manifest.toml"), "x".repeat(700)).unwrap();
        std::fs::create_dir_all(root.join("boot/a-rather-long-directory-name-for-the-kernel-and-its-friends/and-deeper-than-ustar-names-reach")).unwrap();
        std::fs::write(
            root.join("boot/a-rather-long-directory-name-for-the-kernel-and-its-friends/and-deeper-than-ustar-names-reach/vmlinuz"),
            vec![1u8; 100_000],
        )
        .unwrap();
        std::fs::write(root.join("boot/initrd.img"), vec![2u8; 4096]).unwrap();
        let mut tar = tar::Builder::new(Vec::new());
        tar.mode(tar::HeaderMode::Deterministic);
        tar.follow_symlinks(false);
        tar.append_dir_all(".", root).unwrap();
        let actual = tar.into_inner().unwrap().len() as u64;
        let estimate = super::tar_size_estimate(root).unwrap();
        let diff = actual.abs_diff(estimate);
        assert!(diff <= 2048, "estimate {estimate}, actual {actual}");
    }
}

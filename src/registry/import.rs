//! Imports: an OCI image staged (an uploaded archive, or pulled from a registry), built
//! into a two-stage image on the blocking pool, and published like a bundle. Refused
//! imports leave nothing: the staging directory goes with its guard, temp blobs with
//! theirs, and no row is written before every check passed.

use std::io::Read;

use super::{Registry, RegistryError};
use crate::api::image::{ImportOutcome, ImportRequest};
use crate::api::refs::{TagName, check_label, check_name};
use crate::image::import::{self, ImportError, ImportPlan};
use crate::image::oci::archive::Staging;
use crate::image::oci::pull::{self, Credentials, PullSource};

/// Where an import's image comes from.
pub enum ImportSource {
    /// An archive (OCI layout as a tar, oci-archive, docker-archive) being uploaded.
    Archive(Box<dyn Read + Send>),
    /// `ImportRequest::source`, with the registry login named by the request.
    Registry(Option<Credentials>),
}

impl Registry {
    /// Removes what a crash left of imports in progress.
    pub fn clear_import_staging(&self) -> std::io::Result<()> {
        match std::fs::remove_dir_all(&self.imports_dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    pub async fn import(
        &self,
        request: ImportRequest,
        source: ImportSource,
        actor: &str,
    ) -> Result<ImportOutcome, RegistryError> {
        let invalid = |e: String| RegistryError::Invalid(e);
        check_name(&request.name).map_err(|e| invalid(e.to_string()))?;
        check_label("version", &request.version).map_err(|e| invalid(e.to_string()))?;
        let tag = request
            .tag
            .as_deref()
            .map(TagName::parse)
            .transpose()
            .map_err(|e| invalid(e.to_string()))?;
        let plan = ImportPlan {
            name: request.name.clone(),
            version: request.version.clone(),
            cmdline: request.cmdline.clone(),
            pins: request.pins.clone(),
            validation: request.validation.clone(),
            allow_devices: request.allow_devices,
            install_agent: request.install_agent,
        };
        // Imports share the publishes' bound: each holds a blocking thread for minutes.
        let _slot = self
            .publishing
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let mut staging = Staging::new(&self.imports_dir, self.imports.spool_limits())?;
        let image = match source {
            ImportSource::Registry(credentials) => {
                let Some(text) = request.source.as_deref() else {
                    return Err(invalid(
                        "an import names a source or uploads an archive".into(),
                    ));
                };
                let source =
                    PullSource::parse(text, request.plain_http).map_err(ImportError::from)?;
                let client = pull::client().map_err(ImportError::from)?;
                let image = pull::pull(&client, &source, credentials.as_ref(), &mut staging)
                    .await
                    .map_err(ImportError::from)?;
                Pending::Pulled(image)
            }
            ImportSource::Archive(_) if request.source.is_some() => {
                return Err(invalid(
                    "an import from a registry (source) has no archive in its body".into(),
                ));
            }
            ImportSource::Archive(body) => Pending::Upload(body),
        };
        let blobs = self.blobs.clone();
        let settings = self.imports.clone();
        let reference = request.reference.clone();
        // Spooling an upload, both passes over the layers and mksquashfs: minutes of
        // blocking work for a large image.
        let (staged, report) = tokio::task::spawn_blocking(move || {
            let image = match image {
                Pending::Pulled(image) => image,
                Pending::Upload(body) => {
                    import::stage_archive(&mut staging, body, reference.as_deref())?
                }
            };
            import::build(&mut staging, &image, &plan, &settings, &blobs)
        })
        .await
        .map_err(|e| std::io::Error::other(format!("import failed: {e}")))??;
        let publish = self.publish_staged(staged, tag, actor).await?;
        tracing::info!(digest = %publish.digest, kernel = report.kernel_release, rootfs_bytes = report.rootfs_bytes, "imported image");
        Ok(ImportOutcome {
            publish,
            import: report,
        })
    }
}

/// An import's image before the blocking build: pulled already, or still to be read.
enum Pending {
    Pulled(crate::image::oci::OciImage),
    Upload(Box<dyn Read + Send>),
}

//! The image helper of an override entry: replaces parts of `spec.image`, read as an
//! image reference by oci-spec's parser (a port of Docker's distribution/reference:
//! a registry is the first component when it has a `.` or a port or is `localhost`;
//! without one the registry is `docker.io` and a one-part repository is under
//! `library/`).
//!
//! Parts the helper does not set are kept as written: rewriting the tag of `nginx:1.27`
//! gives `nginx:1.28`, not `docker.io/library/nginx:1.28`. Setting the registry or the
//! repository writes both in full (`registry.eu.example.com/library/nginx:1.27`).

use flotilla_crds::federated::ImageOverride;
use oci_spec::distribution::Reference;

/// `image` with the parts `with` sets replaced, or why not, in words.
pub fn rewrite(image: &str, with: &ImageOverride) -> Result<String, String> {
    let parsed = Reference::try_from(image)
        .map_err(|e| format!("spec.image {image:?} is not an image reference: {e}"))?;
    // What distribution/reference refuses and the pattern alone lets through.
    if parsed.repository().bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(format!(
            "spec.image {image:?} is not an image reference: the repository must be lowercase"
        ));
    }
    check_parts(with)?;
    let (written_name, written_tag, written_digest) = split_written(image);
    let name = match (&with.registry, &with.repository) {
        (None, None) => written_name.to_owned(),
        (registry, repository) => format!(
            "{}/{}",
            registry.as_deref().unwrap_or(parsed.registry()),
            repository.as_deref().unwrap_or(parsed.repository())
        ),
    };
    // A digest replaces the tag and a tag the digest: an old digest kept beside a new
    // tag would pin the old content.
    let (tag, digest) = match (&with.tag, &with.digest) {
        (None, None) => (written_tag, written_digest),
        (tag, Some(digest)) => (tag.as_deref(), Some(digest.as_str())),
        (Some(tag), None) => (Some(tag.as_str()), None),
    };
    let mut out = name;
    if let Some(tag) = tag {
        out.push(':');
        out.push_str(tag);
    }
    if let Some(digest) = digest {
        out.push('@');
        out.push_str(digest);
    }
    Reference::try_from(out.as_str())
        .map_err(|e| format!("the image helper gives {out:?}, not an image reference: {e}"))?;
    Ok(out)
}

/// Each part set must read back as that part alone: a registry without a `.` or a port
/// would otherwise be taken as the first component of the repository.
fn check_parts(with: &ImageOverride) -> Result<(), String> {
    let reads = |part: &str, value: &str, probe: String, back: &dyn Fn(&Reference) -> bool| {
        match Reference::try_from(probe.as_str()) {
            Ok(r) if back(&r) => Ok(()),
            _ => Err(format!(
                "image.{part} {value:?} is not a valid {part}{}",
                hint(part)
            )),
        }
    };
    if let Some(registry) = &with.registry {
        let probe = format!("{registry}/x");
        reads("registry", registry, probe, &|r| r.registry() == registry)?;
    }
    if let Some(repository) = &with.repository {
        let probe = format!("registry.invalid/{repository}");
        reads("repository", repository, probe, &|r| {
            r.repository() == repository
        })?;
    }
    if let Some(tag) = &with.tag {
        reads("tag", tag, format!("x:{tag}"), &|r| r.tag() == Some(tag))?;
    }
    if let Some(digest) = &with.digest {
        let probe = format!("x@{digest}");
        reads("digest", digest, probe, &|r| r.digest() == Some(digest))?;
    }
    Ok(())
}

fn hint(part: &str) -> &'static str {
    match part {
        "registry" => {
            " (a host with a '.' or a port, or localhost, e.g. registry.example.com:5000)"
        }
        "repository" => " (lowercase path components, e.g. team/web)",
        "tag" => " (up to 128 of letters, digits, '_', '.', '-', not starting with '.' or '-')",
        _ => " (e.g. sha256: and 64 hex digits)",
    }
}

/// The name, tag and digest as written in a reference that parses (a tag follows the
/// last `:` after the last `/`; a registry's port comes before a `/`).
fn split_written(image: &str) -> (&str, Option<&str>, Option<&str>) {
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
    let last = rest.rfind('/').map_or(0, |i| i + 1);
    match rest[last..].rfind(':') {
        Some(i) => (&rest[..last + i], Some(&rest[last + i + 1..]), digest),
        None => (rest, None, digest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn with(
        registry: Option<&str>,
        repository: Option<&str>,
        tag: Option<&str>,
        digest: Option<&str>,
    ) -> ImageOverride {
        ImageOverride {
            registry: registry.map(Into::into),
            registry_from: None,
            repository: repository.map(Into::into),
            tag: tag.map(Into::into),
            digest: digest.map(Into::into),
        }
    }

    fn registry(r: &str) -> ImageOverride {
        with(Some(r), None, None, None)
    }

    #[test]
    fn malformed_references_are_refused_with_the_image_named() {
        for image in [
            "",
            "UPPER/case:1",
            "nginx:",
            "nginx@sha256:12",
            ":1.27",
            "a//b:1",
            "nginx:bad/tag",
            "nginx@md5:0123",
        ] {
            let e = rewrite(image, &with(None, None, Some("1"), None)).unwrap_err();
            assert!(
                e.starts_with(&format!("spec.image {image:?} is not an image reference")),
                "{image}: {e}"
            );
        }
    }

    #[test]
    fn bad_parts_are_named() {
        for (part, w) in [
            ("registry", registry("noport")),
            ("registry", registry("")),
            ("registry", registry("reg.example.com/extra")),
            ("repository", with(None, Some("Team/Web"), None, None)),
            ("repository", with(None, Some(""), None, None)),
            ("tag", with(None, None, Some("-x"), None)),
            ("tag", with(None, None, Some("a/b"), None)),
            ("tag", with(None, None, Some(&"t".repeat(129)), None)),
            ("digest", with(None, None, None, Some("sha256:abc"))),
            ("digest", with(None, None, None, Some("1.27"))),
        ] {
            let e = rewrite("nginx:1.27", &w).unwrap_err();
            assert!(e.starts_with(&format!("image.{part} ")), "{w:?}: {e}");
            assert!(e.contains(&format!("is not a valid {part}")), "{w:?}: {e}");
        }
    }

    #[test]
    fn unset_parts_keep_what_is_written() {
        let cases = [
            (
                "nginx:1.27",
                with(None, None, Some("1.28"), None),
                "nginx:1.28",
            ),
            ("nginx", with(None, None, Some("1.28"), None), "nginx:1.28"),
            (
                "docker.io/library/nginx:1.27",
                with(None, None, Some("1.28"), None),
                "docker.io/library/nginx:1.28",
            ),
            (
                "localhost:5000/web:1",
                with(None, None, Some("2"), None),
                "localhost:5000/web:2",
            ),
            (
                "reg.io:5000/team/web:1",
                with(None, None, Some("2"), None),
                "reg.io:5000/team/web:2",
            ),
            ("nginx:1.27", with(None, None, None, None), "nginx:1.27"),
            // A port without a path is a tag: `localhost:5000` is the image localhost.
            (
                "localhost:5000",
                with(None, None, Some("6000"), None),
                "localhost:6000",
            ),
        ];
        for (image, w, want) in cases {
            assert_eq!(rewrite(image, &w).unwrap(), want, "{image} {w:?}");
        }
    }

    #[test]
    fn registry_and_repository_are_written_in_full() {
        let cases = [
            (
                "nginx:1.27",
                registry("registry.eu.example.com"),
                "registry.eu.example.com/library/nginx:1.27",
            ),
            (
                "nginx",
                registry("reg.io:5000"),
                "reg.io:5000/library/nginx",
            ),
            (
                "quay.io/team/web:1",
                registry("localhost"),
                "localhost/team/web:1",
            ),
            (
                "quay.io/team/web:1",
                registry("[::1]:5000"),
                "[::1]:5000/team/web:1",
            ),
            (
                "quay.io/team/web:1",
                with(None, Some("other/api"), None, None),
                "quay.io/other/api:1",
            ),
            (
                "nginx:1.27",
                with(None, Some("team/nginx"), None, None),
                "docker.io/team/nginx:1.27",
            ),
            (
                "nginx:1.27",
                with(Some("reg.io"), Some("x/y"), Some("2"), None),
                "reg.io/x/y:2",
            ),
        ];
        for (image, w, want) in cases {
            match rewrite(image, &w) {
                Ok(got) => assert_eq!(got, want, "{image} {w:?}"),
                // IPv6 registries are beyond the parser's grammar: refused, by name.
                Err(e) => assert!(
                    want.starts_with('[') && e.starts_with("image.registry"),
                    "{image} {w:?}: {e}"
                ),
            }
        }
    }

    #[test]
    fn digest_replaces_the_tag_and_a_tag_the_digest() {
        let pinned = format!("nginx@{DIGEST}");
        assert_eq!(
            rewrite("nginx:1.27", &with(None, None, None, Some(DIGEST))).unwrap(),
            pinned
        );
        assert_eq!(
            rewrite(&pinned, &with(None, None, Some("1.28"), None)).unwrap(),
            "nginx:1.28"
        );
        assert_eq!(
            rewrite("nginx:1.27", &with(None, None, Some("1.28"), Some(DIGEST))).unwrap(),
            format!("nginx:1.28@{DIGEST}")
        );
        // Both written and neither set: both kept.
        let both = format!("reg.io:5000/web:1@{DIGEST}");
        assert_eq!(
            rewrite(&both, &registry("other.io")).unwrap(),
            format!("other.io/web:1@{DIGEST}")
        );
    }

    #[test]
    fn split_written_finds_tag_after_the_last_slash() {
        assert_eq!(
            split_written("reg:5000/a/b:1@d"),
            ("reg:5000/a/b", Some("1"), Some("d"))
        );
        assert_eq!(split_written("reg:5000/a"), ("reg:5000/a", None, None));
        assert_eq!(split_written("a"), ("a", None, None));
    }
}

//! Certificates and a token made for a test: a CA `good` with a server certificate for
//! localhost and a client certificate, a CA `rogue` with a client certificate of its own.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// The bearer token in [`Pki`]'s `token` file.
pub const TOKEN: &str = "e2e-test-token-0123456789";

/// PEM files in a temporary directory: `good-ca.pem`, `server.pem` / `server-key.pem`
/// (localhost, signed by `good`), `client.pem` / `client-key.pem` (signed by `good`),
/// `rogue-ca.pem`, `rogue-client.pem` / `rogue-client-key.pem`, and `token`.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// Makes the certificates and the token file.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let good = ca(dir.path(), "good");
        leaf(dir.path(), &good, &["localhost"], "server");
        leaf(dir.path(), &good, &["orchestrator"], "client");
        let rogue = ca(dir.path(), "rogue");
        leaf(dir.path(), &rogue, &["orchestrator"], "rogue-client");
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).expect("token file");
        Self { dir }
    }

    /// The file `name` of the set.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

/// A CA named `name`, written as `<name>-ca.pem`.
fn ca(dir: &Path, name: &str) -> Issuer<'static, KeyPair> {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} CA"));
    let cert = params.self_signed(&key).expect("CA certificate");
    std::fs::write(dir.join(format!("{name}-ca.pem")), cert.pem()).expect("CA file");
    Issuer::new(params, key)
}

/// A certificate for `names` signed by `issuer`, written as `<file>.pem` and `<file>-key.pem`.
fn leaf(dir: &Path, issuer: &Issuer<'_, KeyPair>, names: &[&str], file: &str) {
    let key = KeyPair::generate().expect("key");
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let cert = CertificateParams::new(names)
        .expect("params")
        .signed_by(&key, issuer)
        .expect("certificate");
    std::fs::write(dir.join(format!("{file}.pem")), cert.pem()).expect("certificate file");
    std::fs::write(dir.join(format!("{file}-key.pem")), key.serialize_pem()).expect("key file");
}

//! Certificates for TLS tests, made on the spot with rcgen: no certificate is checked in.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use crate::harness;

/// A certificate authority, a server certificate it signed (for `localhost` and
/// `127.0.0.1`), and an unrelated authority, written as PEM files into a directory.
#[derive(Debug)]
pub struct Pki {
    dir: PathBuf,
    /// The server certificate, PEM.
    pub server_cert: String,
    /// The server certificate's private key, PEM.
    pub server_key: String,
}

impl Pki {
    /// Makes the keys and certificates and writes `ca.pem`, `other-ca.pem`, `server.pem`
    /// and `server.key` into a temporary directory, removed on drop.
    ///
    /// # Panics
    ///
    /// When a key cannot be generated or a file written.
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(harness::unique_name("idem-tls-"));
        std::fs::create_dir_all(&dir).expect("pki dir");
        let authority = |name: &str| {
            let key = KeyPair::generate().expect("key");
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let cert = params.self_signed(&key).expect("self-signed CA");
            (cert.pem(), Issuer::new(params, key))
        };
        let (ca_pem, ca) = authority("idem test CA");
        let (other_pem, _) = authority("another CA");
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &ca).expect("server certificate");
        let pki = Self {
            dir,
            server_cert: cert.pem(),
            server_key: key.serialize_pem(),
        };
        for (name, contents) in [
            ("ca.pem", &ca_pem),
            ("other-ca.pem", &other_pem),
            ("server.pem", &pki.server_cert),
            ("server.key", &pki.server_key),
        ] {
            std::fs::write(pki.dir.join(name), contents).expect("write pem");
        }
        pki
    }

    /// The path of one of its files, as text for a URL or a flag.
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

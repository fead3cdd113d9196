//! A throwaway certificate authority (feature `local-ca`): kas-local's and the tests'
//! certificates. Outside kas's own dependency tree.

/// A throwaway certificate authority, for `kas-local --tls` and tests: its certificate, and
/// the certificates it issues for 127.0.0.1 and localhost.
pub struct LocalCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// Its certificate (PEM).
    pub pem: String,
}

impl LocalCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Result<LocalCa, String> {
        let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let pem = params.self_signed(&key).map_err(|e| e.to_string())?.pem();
        Ok(LocalCa {
            issuer: rcgen::Issuer::new(params, key),
            pem,
        })
    }

    /// A new certificate for 127.0.0.1 and localhost: (certificate, private key), PEM.
    pub fn issue(&self) -> Result<(String, String), String> {
        let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
        let names = vec!["127.0.0.1".to_string(), "localhost".into()];
        let cert = rcgen::CertificateParams::new(names)
            .and_then(|p| p.signed_by(&key, &self.issuer))
            .map_err(|e| e.to_string())?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

//! Telling a refused TLS handshake from an unreachable Redis: the first is the config's (or the certificates')
//! to fix, so the daemon and the CLI stop with exit 2 and say what to do, instead of retrying forever.
//!
//! The redis crate keeps rustls's error only as the text of an I/O error (behind an `Arc`, where it cannot be
//! downcast), so the refusal is read from rustls's own wording: `invalid peer certificate: ...` when kmqd
//! refuses the server's certificate, `received fatal alert: ...` when the server refuses kmqd's.

/// What to fix, when `error` is a TLS handshake that failed over a certificate (on a connection of its own, or
/// as the last error of the pool's attempts); `None` for any other error.
pub fn tls_refusal(error: &super::BrokerError) -> Option<String> {
    match error {
        super::BrokerError::Redis(_) | super::BrokerError::Pool(_) => explain(&error.to_string()),
        _ => None,
    }
}

fn explain(text: &str) -> Option<String> {
    if let Some(at) = text.find("invalid peer certificate: ") {
        let why = &text[at + "invalid peer certificate: ".len()..];
        let hint = if why.starts_with("UnknownIssuer") {
            "it is not signed by a CA kmqd trusts: set [redis] tls_ca_file to the PEM of the CA that signed it \
             (without it, the system's CAs are trusted)"
        } else if why.starts_with("Expired") || why.starts_with("certificate expired") {
            "it has expired: renew the server's certificate"
        } else if why.starts_with("NotValidYet") || why.starts_with("certificate not valid yet") {
            "it is not valid yet: check the clocks of this host and of the CA"
        } else if why.starts_with("certificate not valid for name")
            || why.starts_with("NotValidForName")
        {
            "it does not name the host in the URL: connect by a name the certificate lists (its subjectAltName)"
        } else if why.starts_with("Revoked") {
            "it is revoked"
        } else {
            "check the server's certificate, [redis] tls_ca_file and tls_cert_file (certificates must be X.509 v3)"
        };
        return Some(format!(
            "TLS: Redis's certificate was refused ({why}); {hint}"
        ));
    }
    if let Some(at) = text.find("received fatal alert: ") {
        let alert = &text[at + "received fatal alert: ".len()..];
        let hint = if alert.starts_with("CertificateRequired") {
            "Redis requires a client certificate: set [redis] tls_cert_file and tls_key_file"
        } else if alert.starts_with("UnknownCA") || alert.starts_with("BadCertificate") {
            "Redis does not trust kmqd's client certificate (tls_cert_file): have it signed by a CA in Redis's \
             tls-ca-cert-file"
        } else if alert.starts_with("CertificateExpired") {
            "kmqd's client certificate (tls_cert_file) has expired"
        } else {
            "check [redis] tls_cert_file and tls_key_file against Redis's tls-* settings"
        };
        return Some(format!(
            "TLS: Redis refused the connection ({alert}); {hint}"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::explain;

    #[test]
    fn certificate_refusals_say_what_to_fix() {
        let unknown = explain("redis: invalid peer certificate: UnknownIssuer").unwrap();
        assert!(unknown.contains("tls_ca_file"), "{unknown}");
        let name = explain(
            "invalid peer certificate: certificate not valid for name \"127.0.0.1\"; certificate is only valid \
             for localhost",
        )
        .unwrap();
        assert!(name.contains("subjectAltName"), "{name}");
        let required = explain("received fatal alert: CertificateRequired").unwrap();
        assert!(required.contains("tls_cert_file"), "{required}");
        assert_eq!(explain("Connection refused (os error 111)"), None);
    }
}

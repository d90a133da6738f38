//! Certificates for the TLS tests, made with the `openssl` command: a test CA and what it signs, plus the
//! certificates a TLS client must refuse.
//!
//! kmqd's `rediss://` support has to be tested against a real TLS redis-server, and a client that accepts
//! everything would pass a test that only checks the happy path. So [`TlsFiles::generate`] writes, into a
//! directory the caller owns (usually a temp dir that lives as long as the test):
//! - a test CA, and a server certificate it signs for `DNS:localhost, IP:127.0.0.1` (the host names the
//!   harness's URLs use), usable as a client certificate too: a cluster node or a replica presents its own
//!   certificate to its peers, which check it under `tls-auth-clients yes`;
//! - a client certificate it signs, for mutual TLS;
//! - an unrelated CA and a server certificate it signs (a client trusting only the test CA must refuse it);
//! - a server certificate of the test CA for `DNS:wrong.example` only (a client must refuse it for `localhost`);
//! - a server certificate of the test CA that expired in 2021 (made with `openssl ca -startdate -enddate`, as
//!   `openssl x509 -days` cannot go back in time and OpenSSL 3.0 has no `-not_before`).
//!
//! Keys are EC P-256 in PKCS#8 PEM (`BEGIN PRIVATE KEY`): rustls and Redis read them, and making one is
//! instant, where an RSA key takes a noticeable fraction of a second. A [`ServerTls`] (from
//! [`TlsFiles::server`]) says which certificate a [`super::RedisServer`] presents and whether it asks for
//! client certificates; put it in [`super::Options::tls`].

use std::path::{Path, PathBuf};
use std::process::Command;

/// The OpenSSL config of every step: our own, so that the system's `openssl.cnf` (its default extensions, a
/// distribution's policy) changes nothing. Relative paths are relative to the output directory, where the
/// commands run.
const OPENSSL_CONFIG: &str = "\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = kmqd-test

# A CA: what rustls (webpki) insists on, basicConstraints CA:TRUE with keyCertSign.
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

# A server that is also a client of its peers (replication, the cluster bus): both usages.
[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[wrong_host_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:wrong.example
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[client_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectAltName = DNS:kmqd-test-client
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

# `openssl ca`, only for the expired certificate: the one command that takes a start and an end date.
[ca]
default_ca = test_ca

[test_ca]
database = expired-ca/index.txt
new_certs_dir = expired-ca
certificate = ca.crt
private_key = ca.key
rand_serial = yes
default_md = sha256
policy = any_name
unique_subject = no
copy_extensions = none

[any_name]
commonName = supplied
";

/// How long the certificates that should be valid are valid (about ten years: a test machine's clock is never
/// that far off).
const VALID_DAYS: &str = "3650";

/// The files [`TlsFiles::generate`] wrote. Every path is absolute (under the directory given to it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The directory holding everything.
    pub dir: PathBuf,
    /// The test CA: what a client should trust (`--cacert`, a `ca_cert` setting).
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    /// Signed by the test CA for `DNS:localhost, IP:127.0.0.1`; usable for server and client authentication.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// Signed by the test CA, client authentication only: what a client presents to a mutual-TLS server.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// An unrelated CA: a client trusting it refuses [`TlsFiles::server_cert`], and a client trusting the test
    /// CA refuses [`TlsFiles::other_server_cert`].
    pub other_ca_cert: PathBuf,
    pub other_ca_key: PathBuf,
    /// Signed by the other CA, for `DNS:localhost, IP:127.0.0.1`.
    pub other_server_cert: PathBuf,
    pub other_server_key: PathBuf,
    /// Signed by the test CA for `DNS:wrong.example` only.
    pub wrong_host_cert: PathBuf,
    pub wrong_host_key: PathBuf,
    /// Signed by the test CA for `DNS:localhost, IP:127.0.0.1`, valid from 2020-01-01 to 2021-01-01 only.
    pub expired_cert: PathBuf,
    pub expired_key: PathBuf,
}

/// Which certificate a TLS server presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerCert {
    /// [`TlsFiles::server_cert`]: what a client trusting the test CA accepts for `localhost`.
    Valid,
    /// [`TlsFiles::other_server_cert`]: signed by a CA the client does not know.
    OtherCa,
    /// [`TlsFiles::wrong_host_cert`]: the right CA, the wrong name.
    WrongHost,
    /// [`TlsFiles::expired_cert`]: the right CA and name, expired.
    Expired,
}

/// Whether a TLS server asks its clients for a certificate (`tls-auth-clients`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthClients {
    /// `yes`: a client without a certificate signed by the server's CA is refused (mutual TLS).
    Yes,
    /// `no`: no client certificate is asked for.
    No,
    /// `optional`: a client may present none, but one it presents must be valid.
    Optional,
}

impl AuthClients {
    /// The value of `tls-auth-clients`.
    pub fn as_redis_value(self) -> &'static str {
        match self {
            AuthClients::Yes => "yes",
            AuthClients::No => "no",
            AuthClients::Optional => "optional",
        }
    }
}

/// What a TLS redis-server needs: what it presents, what it trusts, and what the harness presents to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTls {
    /// `tls-cert-file`, `tls-key-file`: presented to clients, and to its peers when it connects to them
    /// (a replica to its master, a node to the cluster bus, MIGRATE).
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// `tls-ca-cert-file`: client certificates, and the certificates of its peers, are checked against it.
    pub ca_cert_file: PathBuf,
    pub auth_clients: AuthClients,
    /// What the harness's own `redis-cli` presents (always, so that `AuthClients::Yes` servers answer it). The
    /// harness's redis-cli does not check the server's certificate (`--insecure`): it must reach servers that
    /// present a bad one on purpose. Tests check certificates themselves.
    pub client_cert_file: PathBuf,
    pub client_key_file: PathBuf,
}

impl TlsFiles {
    /// Writes every certificate and key into `dir` (which must exist; files of an earlier call are
    /// overwritten). Takes a few tenths of a second: about twenty `openssl` runs.
    pub fn generate(dir: &Path) -> Result<TlsFiles, String> {
        let dir = std::path::absolute(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::fs::write(dir.join("openssl.cnf"), OPENSSL_CONFIG)
            .map_err(|e| format!("write {}: {e}", dir.join("openssl.cnf").display()))?;
        let files = TlsFiles {
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
            other_ca_cert: dir.join("other-ca.crt"),
            other_ca_key: dir.join("other-ca.key"),
            other_server_cert: dir.join("other-server.crt"),
            other_server_key: dir.join("other-server.key"),
            wrong_host_cert: dir.join("wrong-host.crt"),
            wrong_host_key: dir.join("wrong-host.key"),
            expired_cert: dir.join("expired.crt"),
            expired_key: dir.join("expired.key"),
            dir,
        };
        let openssl = Openssl { dir: &files.dir };
        openssl.self_signed_ca("ca", "kmqd test CA")?;
        openssl.signed("server", "localhost", "ca", "server_ext")?;
        openssl.signed("client", "kmqd-test-client", "ca", "client_ext")?;
        openssl.signed("wrong-host", "wrong.example", "ca", "wrong_host_ext")?;
        openssl.self_signed_ca("other-ca", "kmqd unrelated CA")?;
        openssl.signed("other-server", "localhost", "other-ca", "server_ext")?;
        openssl.expired("expired", "localhost")?;
        Ok(files)
    }

    /// A server presenting the valid certificate, trusting the test CA, asking for client certificates as
    /// `auth_clients` says.
    pub fn server(&self, auth_clients: AuthClients) -> ServerTls {
        self.server_with(ServerCert::Valid, auth_clients)
    }

    /// A server presenting `cert`, trusting the test CA, asking for client certificates as `auth_clients` says.
    pub fn server_with(&self, cert: ServerCert, auth_clients: AuthClients) -> ServerTls {
        let (cert_file, key_file) = match cert {
            ServerCert::Valid => (&self.server_cert, &self.server_key),
            ServerCert::OtherCa => (&self.other_server_cert, &self.other_server_key),
            ServerCert::WrongHost => (&self.wrong_host_cert, &self.wrong_host_key),
            ServerCert::Expired => (&self.expired_cert, &self.expired_key),
        };
        ServerTls {
            cert_file: cert_file.clone(),
            key_file: key_file.clone(),
            ca_cert_file: self.ca_cert.clone(),
            auth_clients,
            client_cert_file: self.client_cert.clone(),
            client_key_file: self.client_key.clone(),
        }
    }
}

/// Runs `openssl` in the output directory with our config.
struct Openssl<'a> {
    dir: &'a Path,
}

impl Openssl<'_> {
    fn run(&self, args: &[&str]) -> Result<(), String> {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(self.dir)
            // `openssl req` reads OPENSSL_CONF when no -config is given; every step gives one, but a broken
            // OPENSSL_CONF in the environment can still break provider loading: ignore it.
            .env_remove("OPENSSL_CONF")
            .output()
            .map_err(|e| {
                format!("cannot run openssl ({e}): the TLS tests need the openssl command")
            })?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "openssl {} failed ({}):\n{}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }

    /// `name.key`: a new EC P-256 key in PKCS#8.
    fn key(&self, name: &str) -> Result<(), String> {
        self.run(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            &format!("{name}.key"),
        ])
    }

    /// `name.key` and a self-signed `name.crt` for a CA.
    fn self_signed_ca(&self, name: &str, common_name: &str) -> Result<(), String> {
        self.key(name)?;
        self.run(&[
            "req",
            "-config",
            "openssl.cnf",
            "-x509",
            "-new",
            "-sha256",
            "-key",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={common_name}"),
            "-days",
            VALID_DAYS,
            "-extensions",
            "ca_ext",
            "-out",
            &format!("{name}.crt"),
        ])
    }

    /// `name.key` and its certificate request `name.csr`.
    fn request(&self, name: &str, common_name: &str) -> Result<(), String> {
        self.key(name)?;
        self.run(&[
            "req",
            "-config",
            "openssl.cnf",
            "-new",
            "-sha256",
            "-key",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={common_name}"),
            "-out",
            &format!("{name}.csr"),
        ])
    }

    /// `name.key` and `name.crt`, signed by the CA `ca` with the extensions of the config's section `extensions`.
    fn signed(
        &self,
        name: &str,
        common_name: &str,
        ca: &str,
        extensions: &str,
    ) -> Result<(), String> {
        self.request(name, common_name)?;
        self.run(&[
            "x509",
            "-req",
            "-sha256",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-CAserial",
            &format!("{ca}.srl"),
            "-days",
            VALID_DAYS,
            "-extfile",
            "openssl.cnf",
            "-extensions",
            extensions,
            "-out",
            &format!("{name}.crt"),
        ])
    }

    /// `name.key` and `name.crt`, a server certificate of the test CA valid in 2020 only.
    fn expired(&self, name: &str, common_name: &str) -> Result<(), String> {
        self.request(name, common_name)?;
        // `openssl ca` keeps a database of what it signed: a fresh one each time, so a second run into the same
        // directory does not trip over the first's entries.
        let database = self.dir.join("expired-ca");
        let _ = std::fs::remove_dir_all(&database);
        std::fs::create_dir(&database)
            .map_err(|e| format!("create {}: {e}", database.display()))?;
        std::fs::write(database.join("index.txt"), "")
            .map_err(|e| format!("write {}: {e}", database.join("index.txt").display()))?;
        self.run(&[
            "ca",
            "-config",
            "openssl.cnf",
            "-batch",
            "-notext",
            "-in",
            &format!("{name}.csr"),
            "-startdate",
            "20200101000000Z",
            "-enddate",
            "20210101000000Z",
            "-extfile",
            "openssl.cnf",
            "-extensions",
            "server_ext",
            "-out",
            &format!("{name}.crt"),
        ])
    }
}

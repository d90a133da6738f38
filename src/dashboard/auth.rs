//! Who may use the dashboard, when `[dashboard]` configures it (docs/DASHBOARD.md, "Authentication"): users of
//! `users_file` by HTTP Basic (what a browser asks for by itself), and a bearer token (`token_env` or
//! `token_file`) for scripts. With either configured every request needs one, pages and API alike.
//!
//! Passwords are stored as Argon2id PHC strings (`kmqd dashboard hash-password NAME`). Argon2 costs tens of
//! milliseconds by design and the pages ask every second, so a verified `Authorization` value is remembered
//! for the life of the process (at most [`REMEMBERED`] of them): a user removed from the file is refused after
//! a restart. What is not remembered costs an Argon2 verification, one at a time, a name that is no user's as
//! much as a wrong password (review L8).

use std::collections::HashMap;
use std::sync::Mutex;

use argon2::Argon2;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use base64::Engine;

use crate::config::{DashboardConfig, read_small_file};
use crate::poison::lock;

/// The most verified `Authorization` values remembered; past it, the memory starts again.
const REMEMBERED: usize = 256;

/// The user name a bearer token acts as, in the log.
pub const TOKEN_USER: &str = "token";

/// The configured credentials.
pub struct Auth {
    /// User name -> PHC string.
    users: HashMap<String, String>,
    token: Option<String>,
    /// Verified `Authorization` header values -> the user they are.
    verified: Mutex<HashMap<String, String>>,
    /// Held for each Argon2 verification, so there is one at a time: each costs 19 MiB and tens of milliseconds of
    /// a core, and wrong passwords sent by every handler thread at once would cost as many (review L8). A request
    /// that waited here for a value that was being verified finds it remembered.
    verifying: Mutex<()>,
    /// A hash of no one's password (the default cost, as `hash-password` makes them), verified for a name that is
    /// no user's: a wrong name then costs what a wrong password does, and the time of a refusal does not tell
    /// which names are users (review L8). `None` without users.
    decoy: Option<String>,
    /// Argon2 verifications run, for the tests to count.
    #[cfg(test)]
    verifications: std::sync::atomic::AtomicUsize,
}

impl Auth {
    /// Reads `users_file` and the token, or says what is wrong where (`FILE:LINE:COLUMN: dashboard.KEY: ...`,
    /// and a bad line of the users file as `USERS_FILE:LINE: ...`). `None` when nothing is configured.
    pub fn load(config: &DashboardConfig) -> Result<Option<Auth>, String> {
        if !config.has_authentication() {
            return Ok(None);
        }
        let mut users = HashMap::new();
        if let Some(file) = &config.users_file {
            let text = read_small_file(&file.value).map_err(|error| {
                file.error(format!("cannot read {}: {error}", file.value.display()))
            })?;
            for (number, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let at = format!("{}:{}", file.value.display(), number + 1);
                let Some((name, hash)) = line.split_once(':') else {
                    return Err(format!(
                        "{at}: not NAME:HASH; make a line with `kmqd dashboard hash-password NAME`"
                    ));
                };
                PasswordHash::new(hash).map_err(|error| {
                    format!("{at}: user {name:?}: the hash is not a PHC string ({error}); make it with `kmqd dashboard hash-password {name}`")
                })?;
                if users.insert(name.to_string(), hash.to_string()).is_some() {
                    return Err(format!("{at}: user {name:?} is listed twice"));
                }
            }
            if users.is_empty() {
                return Err(file.error(format!("{} has no user", file.value.display())));
            }
        }
        let token = match (&config.token_env, &config.token_file) {
            (Some(var), _) => Some(std::env::var(&var.value).map_err(|_| {
                var.error(format!("environment variable {} is not set", var.value))
            })?),
            (None, Some(file)) => Some(
                read_small_file(&file.value)
                    .map_err(|error| {
                        file.error(format!("cannot read {}: {error}", file.value.display()))
                    })?
                    .trim_end_matches(['\r', '\n'])
                    .to_string(),
            ),
            (None, None) => None,
        };
        if let (Some(token), Some(from)) = (
            &token,
            config
                .token_env
                .as_ref()
                .map(|v| &v.at)
                .or(config.token_file.as_ref().map(|f| &f.at)),
        ) && token.len() < 16
        {
            return Err(format!(
                "{from}: the token is {} characters; use at least 16 (for example `openssl rand -hex 32`)",
                token.len()
            ));
        }
        let decoy = match users.is_empty() {
            true => None,
            false => Some(hash_password(&uuid::Uuid::new_v4().to_string())?),
        };
        Ok(Some(Auth {
            users,
            token,
            verified: Mutex::new(HashMap::new()),
            verifying: Mutex::new(()),
            decoy,
            #[cfg(test)]
            verifications: Default::default(),
        }))
    }

    /// Whether users may log in with a password (then a refusal asks the browser for one).
    pub fn has_users(&self) -> bool {
        !self.users.is_empty()
    }

    /// The user an `Authorization` header value is, or `None` when it is missing or wrong.
    pub fn user(&self, authorization: Option<&str>) -> Option<String> {
        let value = authorization?.trim();
        if let Some(user) = self.remembered().get(value) {
            return Some(user.clone());
        }
        let user = if let Some(token) = value.strip_prefix("Bearer ") {
            let expected = self.token.as_deref()?;
            same(token.trim().as_bytes(), expected.as_bytes()).then(|| TOKEN_USER.to_string())?
        } else {
            let encoded = value.strip_prefix("Basic ")?;
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .ok()?;
            let decoded = String::from_utf8(decoded).ok()?;
            let (name, password) = decoded.split_once(':')?;
            let _one_at_a_time = lock(&self.verifying);
            if let Some(user) = self.remembered().get(value) {
                return Some(user.clone());
            }
            let known = self.users.get(name);
            let hash = PasswordHash::new(known.or(self.decoy.as_ref())?).ok()?;
            let verified = Argon2::default()
                .verify_password(password.as_bytes(), &hash)
                .is_ok();
            #[cfg(test)]
            self.verifications
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if !verified || known.is_none() {
                return None;
            }
            // Before the next verification may start: one that waited for this value finds it remembered.
            self.remember(value, name);
            name.to_string()
        };
        self.remember(value, &user);
        Some(user)
    }

    fn remember(&self, value: &str, user: &str) {
        let mut remembered = self.remembered();
        if remembered.len() >= REMEMBERED {
            remembered.clear();
        }
        remembered.insert(value.to_string(), user.to_string());
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        lock(&self.verified)
    }
}

/// `password` as an Argon2id PHC string with a random salt (16 bytes from the OS, through uuid's v4) and the
/// crate's default cost (OWASP's minimum: 19 MiB, 2 passes).
pub fn hash_password(password: &str) -> Result<String, String> {
    let salt =
        SaltString::encode_b64(uuid::Uuid::new_v4().as_bytes()).map_err(|e| e.to_string())?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|hash| hash.to_string())
        .map_err(|error| error.to_string())
}

/// Equal bytes, compared in a time that does not depend on where they differ (a token guessed byte by byte).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Located;

    fn auth(users: &str, token: Option<&str>) -> Auth {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("users");
        std::fs::write(&file, users).unwrap();
        let token_file = dir.path().join("token");
        if let Some(token) = token {
            std::fs::write(&token_file, format!("{token}\n")).unwrap();
        }
        let config = DashboardConfig {
            users_file: Some(Located {
                value: file,
                at: "kmqd.toml:2:14: dashboard.users_file".into(),
            }),
            token_env: None,
            token_file: token.map(|_| Located {
                value: token_file,
                at: "kmqd.toml:3:14: dashboard.token_file".into(),
            }),
        };
        Auth::load(&config).unwrap().unwrap()
    }

    fn basic(user: &str, password: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
        )
    }

    #[test]
    fn users_log_in_with_their_password_and_scripts_with_the_token() {
        let hash = hash_password("correct horse").unwrap();
        assert!(hash.starts_with("$argon2id$"), "{hash}");
        let auth = auth(
            &format!("# who may\nada:{hash}\n"),
            Some("0123456789abcdef0123"),
        );
        assert_eq!(
            auth.user(Some(&basic("ada", "correct horse"))).as_deref(),
            Some("ada")
        );
        // Remembered: the same value again is not verified again, and still right.
        assert_eq!(
            auth.user(Some(&basic("ada", "correct horse"))).as_deref(),
            Some("ada")
        );
        assert_eq!(auth.user(Some(&basic("ada", "wrong"))), None);
        assert_eq!(auth.user(Some(&basic("bob", "correct horse"))), None);
        assert_eq!(
            auth.user(Some("Bearer 0123456789abcdef0123")).as_deref(),
            Some(TOKEN_USER)
        );
        assert_eq!(auth.user(Some("Bearer 0123456789abcdef012")), None);
        assert_eq!(auth.user(Some("Basic !!")), None);
        assert_eq!(auth.user(None), None);
    }

    fn verifications(auth: &Auth) -> usize {
        auth.verifications
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    #[test]
    fn a_name_that_is_no_users_costs_a_verification_as_a_wrong_password_does() {
        let hash = hash_password("correct horse").unwrap();
        let auth = auth(&format!("ada:{hash}\n"), None);
        assert_eq!(auth.user(Some(&basic("bob", "correct horse"))), None);
        assert_eq!(verifications(&auth), 1, "the unknown name was verified");
        assert_eq!(auth.user(Some(&basic("ada", "wrong"))), None);
        assert_eq!(verifications(&auth), 2);
    }

    #[test]
    fn requests_at_once_with_one_new_password_verify_it_once() {
        let hash = hash_password("correct horse").unwrap();
        let auth = auth(&format!("ada:{hash}\n"), None);
        let value = basic("ada", "correct horse");
        std::thread::scope(|scope| {
            let asking: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| auth.user(Some(&value))))
                .collect();
            for asked in asking {
                assert_eq!(asked.join().unwrap().as_deref(), Some("ada"));
            }
        });
        assert_eq!(verifications(&auth), 1, "one Argon2 run for four requests");
    }

    #[test]
    fn a_bad_users_file_or_short_token_is_refused_with_where() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("users");
        let load = |text: &str, token: Option<&str>| {
            std::fs::write(&file, text).unwrap();
            let token_file = dir.path().join("token");
            if let Some(token) = token {
                std::fs::write(&token_file, token).unwrap();
            }
            Auth::load(&DashboardConfig {
                users_file: Some(Located {
                    value: file.clone(),
                    at: "k.toml:2:14: dashboard.users_file".into(),
                }),
                token_env: None,
                token_file: token.map(|_| Located {
                    value: token_file,
                    at: "k.toml:3:14: dashboard.token_file".into(),
                }),
            })
            .err()
            .unwrap()
        };
        let error = load("ada\n", None);
        assert!(
            error.ends_with(
                "users:1: not NAME:HASH; make a line with `kmqd dashboard hash-password NAME`"
            ),
            "{error}"
        );
        let error = load("\nada:plain\n", None);
        assert!(
            error.contains("users:2: user \"ada\": the hash is not a PHC string"),
            "{error}"
        );
        let hash = hash_password("x").unwrap();
        let error = load(&format!("ada:{hash}\nada:{hash}\n"), None);
        assert!(
            error.contains("users:2: user \"ada\" is listed twice"),
            "{error}"
        );
        let error = load("# nobody\n", None);
        assert!(
            error.starts_with("k.toml:2:14: dashboard.users_file: "),
            "{error}"
        );
        let error = load(&format!("ada:{hash}\n"), Some("short"));
        assert!(
            error.starts_with("k.toml:3:14: dashboard.token_file: the token is 5 characters"),
            "{error}"
        );
    }
}

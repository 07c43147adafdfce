//! Users, virtual hosts and permissions, as RabbitMQ users know them. Pure:
//! the metadata state holds them, the AMQP and HTTP front ends ask here
//! whether someone may do something.
//!
//! Passwords are stored as RabbitMQ stores them (`rabbit_password_hashing_sha256`
//! by default: base64 of a 4-byte salt followed by SHA-256(salt ++ password)),
//! so the users of a RabbitMQ definitions export log in with the same passwords.

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256, Sha512};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Hashing {
    Sha256,
    Sha512,
}

impl Hashing {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "rabbit_password_hashing_sha256" => Ok(Self::Sha256),
            "rabbit_password_hashing_sha512" => Ok(Self::Sha512),
            other => {
                Err(format!("hashing_algorithm '{other}' is not supported (rabbit_password_hashing_sha256 or _sha512)"))
            }
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sha256 => "rabbit_password_hashing_sha256",
            Self::Sha512 => "rabbit_password_hashing_sha512",
        }
    }
    fn digest(self, salt: &[u8], password: &[u8]) -> Vec<u8> {
        match self {
            Self::Sha256 => Sha256::new().chain_update(salt).chain_update(password).finalize().to_vec(),
            Self::Sha512 => Sha512::new().chain_update(salt).chain_update(password).finalize().to_vec(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub name: String,
    /// Base64 of salt and digest; empty: no password login.
    pub password_hash: String,
    pub hashing: Hashing,
    /// `administrator`, `monitoring`, `policymaker`, `management`, or others kept as given.
    pub tags: Vec<String>,
}

impl User {
    /// A user with `password` hashed under a fresh salt (taken before the
    /// change is proposed, so every node applies the same hash).
    pub fn with_password(name: &str, password: &str, tags: Vec<String>) -> Self {
        let salt: [u8; 4] = rand::random();
        Self {
            name: name.into(),
            password_hash: hash_password(Hashing::Sha256, salt, password),
            hashing: Hashing::Sha256,
            tags,
        }
    }

    pub fn password_matches(&self, password: &str) -> bool {
        let Ok(stored) = base64::engine::general_purpose::STANDARD.decode(&self.password_hash) else {
            return false;
        };
        if stored.len() < 5 {
            return false;
        }
        let (salt, digest) = stored.split_at(4);
        let want = self.hashing.digest(salt, password.as_bytes());
        // Compare all of it whatever differs first: no timing hint.
        want.len() == digest.len() && want.iter().zip(digest).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    pub fn is_admin(&self) -> bool {
        self.has_tag("administrator")
    }

    /// May use the management API at all (RabbitMQ: any of these tags).
    pub fn is_management(&self) -> bool {
        ["administrator", "monitoring", "policymaker", "management"].iter().any(|t| self.has_tag(t))
    }

    /// Sees every vhost's objects and the nodes (read only).
    pub fn is_monitoring(&self) -> bool {
        self.is_admin() || self.has_tag("monitoring")
    }

    /// May change policies in the vhosts it has access to.
    pub fn is_policymaker(&self) -> bool {
        self.is_admin() || self.has_tag("policymaker")
    }
}

pub fn hash_password(hashing: Hashing, salt: [u8; 4], password: &str) -> String {
    let mut out = salt.to_vec();
    out.extend(hashing.digest(&salt, password.as_bytes()));
    base64::engine::general_purpose::STANDARD.encode(out)
}

/// Tags as RabbitMQ takes them: a comma-separated string (3.x exports) or a list.
pub fn parse_tags(v: &serde_json::Value) -> Result<Vec<String>, String> {
    match v {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::String(s) => {
            Ok(s.split(',').map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect())
        }
        serde_json::Value::Array(items) => items
            .iter()
            .map(|t| t.as_str().map(String::from).ok_or_else(|| "tags must be strings".to_string()))
            .collect(),
        _ => Err("tags must be a string or a list of strings".into()),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vhost {
    pub name: String,
    pub description: String,
    pub tags: Vec<String>,
}

impl Vhost {
    pub fn named(name: &str) -> Self {
        Self { name: name.into(), description: String::new(), tags: Vec::new() }
    }
}

/// What a user may do in a vhost: three regexes over resource names, as in
/// RabbitMQ (an empty one matches nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permission {
    pub user: String,
    pub vhost: String,
    pub configure: String,
    pub write: String,
    pub read: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Declare or delete the resource.
    Configure,
    /// Publish to an exchange; bind a queue (write on the queue).
    Write,
    /// Consume, get or purge a queue; bind from an exchange (read on it).
    Read,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Configure => "configure",
            Self::Write => "write",
            Self::Read => "read",
        }
    }
}

impl Permission {
    pub fn full(user: &str, vhost: &str) -> Self {
        Self { user: user.into(), vhost: vhost.into(), configure: ".*".into(), write: ".*".into(), read: ".*".into() }
    }

    pub fn validate(&self) -> Result<(), String> {
        for (what, re) in [("configure", &self.configure), ("write", &self.write), ("read", &self.read)] {
            regex::Regex::new(re).map_err(|e| format!("{what} is not a valid regex: {e}"))?;
        }
        Ok(())
    }

    pub fn pattern(&self, access: Access) -> &str {
        match access {
            Access::Configure => &self.configure,
            Access::Write => &self.write,
            Access::Read => &self.read,
        }
    }

    /// Whether `access` to the resource `name` (a bare queue or exchange
    /// name; the default exchange is `amq.default`) is granted. As in
    /// RabbitMQ, a pattern matches anywhere in the name unless anchored, and
    /// an empty one means `^$`: nothing.
    pub fn allows(&self, access: Access, name: &str) -> bool {
        let pattern = self.pattern(access);
        if pattern.is_empty() {
            return false;
        }
        if pattern == ".*" {
            return true;
        }
        let name = if name.is_empty() { "amq.default" } else { name };
        super::policy::pattern_matches(pattern, name)
    }
}

/// The default user as RabbitMQ creates it on a fresh node; the salt is
/// fixed so every node starts from the same state.
pub fn default_guest() -> User {
    User {
        name: "guest".into(),
        password_hash: hash_password(Hashing::Sha256, *b"mq\x01\x02", "guest"),
        hashing: Hashing::Sha256,
        tags: vec!["administrator".into()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_rabbitmqs() {
        // Computed independently: python3 -c "import hashlib,base64;
        // s=bytes([1,2,3,4]); print(base64.b64encode(s+hashlib.sha256(s+b'secret').digest()).decode())"
        let h = hash_password(Hashing::Sha256, [1, 2, 3, 4], "secret");
        assert_eq!(h, EXPECTED_SHA256);
        let u = User { name: "a".into(), password_hash: h, hashing: Hashing::Sha256, tags: vec![] };
        assert!(u.password_matches("secret"));
        assert!(!u.password_matches("Secret"));
        assert!(!u.password_matches(""));
        let fresh = User::with_password("b", "pw", vec![]);
        assert!(fresh.password_matches("pw"));
        assert_ne!(fresh.password_hash, User::with_password("b", "pw", vec![]).password_hash, "salted");
        let none = User { name: "c".into(), password_hash: String::new(), hashing: Hashing::Sha256, tags: vec![] };
        assert!(!none.password_matches(""), "a user without a password cannot log in with one");
        assert!(default_guest().password_matches("guest"));
    }

    const EXPECTED_SHA256: &str = "AQIDBDB9kM21iEUzN1lZ+6VReCsdNqS0sERdAQTcY6Xs3PMz";

    #[test]
    fn permissions_match_as_rabbitmq_does() {
        let p = Permission {
            user: "u".into(),
            vhost: "v".into(),
            configure: "^app-.*".into(),
            write: "^(app-.*|amq\\.default)$".into(),
            read: "".into(),
        };
        assert!(p.allows(Access::Configure, "app-1"));
        assert!(!p.allows(Access::Configure, "other"));
        assert!(!p.allows(Access::Write, "my-app-1"), "anchored by the pattern");
        assert!(p.allows(Access::Configure, "app-1x"), "unanchored end matches anywhere");
        assert!(p.allows(Access::Write, ""), "the default exchange is amq.default");
        assert!(!p.allows(Access::Read, "app-1"), "empty matches nothing");
        assert!(Permission { configure: "(".into(), ..p.clone() }.validate().is_err());
    }

    #[test]
    fn tags_from_string_or_list() {
        assert_eq!(
            parse_tags(&serde_json::json!("administrator, management")).unwrap(),
            ["administrator", "management"]
        );
        assert_eq!(parse_tags(&serde_json::json!(["monitoring"])).unwrap(), ["monitoring"]);
        assert_eq!(parse_tags(&serde_json::json!("")).unwrap(), Vec::<String>::new());
        assert!(parse_tags(&serde_json::json!(3)).is_err());
    }
}

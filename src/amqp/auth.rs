//! Who is on a connection and what they may do: SASL PLAIN / AMQPLAIN
//! against the cluster's users, and RabbitMQ's configure/write/read
//! permission checks, cached per channel so a publish costs a lookup.

use std::collections::HashMap;

use crate::metadata::{Access, MetaState, Permission};

/// The user name and password a client sent.
fn credentials(mechanism: &str, response: &[u8]) -> Option<(String, String)> {
    match mechanism {
        // `\0user\0password` (an authorization identity before the first NUL is allowed and ignored).
        "PLAIN" => {
            let mut parts = response.split(|b| *b == 0);
            let (_authz, user, pass) = (parts.next()?, parts.next()?, parts.next()?);
            if parts.next().is_some() {
                return None;
            }
            Some((String::from_utf8(user.to_vec()).ok()?, String::from_utf8(pass.to_vec()).ok()?))
        }
        // A field table without its length: LOGIN and PASSWORD as long strings.
        "AMQPLAIN" => {
            let (mut user, mut pass) = (None, None);
            let mut rest = response;
            while !rest.is_empty() {
                let klen = *rest.first()? as usize;
                let key = rest.get(1..1 + klen)?;
                let kind = *rest.get(1 + klen)?;
                if kind != b'S' {
                    return None;
                }
                let at = 2 + klen;
                let vlen = u32::from_be_bytes(rest.get(at..at + 4)?.try_into().ok()?) as usize;
                let value = String::from_utf8(rest.get(at + 4..at + 4 + vlen)?.to_vec()).ok()?;
                match key {
                    b"LOGIN" => user = Some(value),
                    b"PASSWORD" => pass = Some(value),
                    _ => {}
                }
                rest = &rest[at + 4 + vlen..];
            }
            Some((user?, pass?))
        }
        _ => None,
    }
}

/// The user a client logs in as, or the text of the refusal. As RabbitMQ's
/// default `loopback_users`, `guest` may log in only from a loopback address.
pub fn authenticate(meta: &MetaState, mechanism: &str, response: &[u8], from_loopback: bool) -> Result<String, String> {
    let refused = || {
        format!("ACCESS_REFUSED - Login was refused using authentication mechanism {mechanism}. For details see the broker logfile.")
    };
    let (user, password) = credentials(mechanism, response).ok_or_else(refused)?;
    if !meta.users.get(&user).is_some_and(|u| u.password_matches(&password)) {
        return Err(refused());
    }
    if user == "guest" && !from_loopback {
        return Err("ACCESS_REFUSED - login refused: user 'guest' can only connect via localhost".into());
    }
    Ok(user)
}

/// A channel's answers to "may this user do that", kept while the user's
/// permission in the vhost stays the same.
#[derive(Default)]
pub struct Grants {
    perm: Option<Permission>,
    seen: [HashMap<String, bool>; 3],
}

impl Grants {
    /// Whether `user` may have `access` to `name` (bare) in `vhost` now.
    pub fn allows(&mut self, meta: &MetaState, user: &str, vhost: &str, access: Access, name: &str) -> bool {
        let Some(perm) = meta.permission(user, vhost) else {
            return false;
        };
        if self.perm.as_ref() != Some(perm) {
            self.perm = Some(perm.clone());
            self.seen = Default::default();
        }
        let seen = &mut self.seen[access as usize];
        if let Some(ok) = seen.get(name) {
            return *ok;
        }
        let ok = perm.allows(access, name);
        if seen.len() < 1024 {
            seen.insert(name.to_string(), ok);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{MetaCmd, User, Vhost};

    fn amqplain(user: &str, pass: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in [("LOGIN", user), ("PASSWORD", pass)] {
            out.push(k.len() as u8);
            out.extend(k.as_bytes());
            out.push(b'S');
            out.extend((v.len() as u32).to_be_bytes());
            out.extend(v.as_bytes());
        }
        out
    }

    #[test]
    fn logins_check_the_clusters_users() {
        let mut meta = MetaState::default();
        meta.apply(&MetaCmd::PutUser(User::with_password("alice", "s3cret", vec![])));
        assert_eq!(authenticate(&meta, "PLAIN", b"\0guest\0guest", true), Ok("guest".into()));
        assert!(authenticate(&meta, "PLAIN", b"\0guest\0guest", false).is_err(), "guest only from loopback");
        assert_eq!(authenticate(&meta, "PLAIN", b"\0alice\0s3cret", false), Ok("alice".into()));
        assert!(authenticate(&meta, "PLAIN", b"\0alice\0guest", true).is_err());
        assert!(authenticate(&meta, "PLAIN", b"\0bob\0s3cret", true).is_err());
        assert!(authenticate(&meta, "PLAIN", b"garbage", true).is_err());
        assert!(authenticate(&meta, "EXTERNAL", b"", true).is_err());
        assert_eq!(authenticate(&meta, "AMQPLAIN", &amqplain("alice", "s3cret"), true), Ok("alice".into()));
        assert!(authenticate(&meta, "AMQPLAIN", &amqplain("alice", "nope"), true).is_err());
        assert!(authenticate(&meta, "AMQPLAIN", b"\x05LOGIN", true).is_err(), "truncated table");
    }

    #[test]
    fn grants_follow_permission_changes() {
        let mut meta = MetaState::default();
        meta.apply(&MetaCmd::PutUser(User::with_password("alice", "pw", vec![])));
        meta.apply(&MetaCmd::PutVhost(Vhost::named("dev")));
        let mut g = Grants::default();
        assert!(!g.allows(&meta, "alice", "dev", Access::Read, "q"), "no permission in dev yet");
        let mut p = Permission::full("alice", "dev");
        p.read = "^app-".into();
        meta.apply(&MetaCmd::SetPermission(p.clone()));
        assert!(g.allows(&meta, "alice", "dev", Access::Read, "app-1"));
        assert!(!g.allows(&meta, "alice", "dev", Access::Read, "q"));
        p.read = ".*".into();
        meta.apply(&MetaCmd::SetPermission(p));
        assert!(g.allows(&meta, "alice", "dev", Access::Read, "q"), "a changed permission is seen at once");
        meta.apply(&MetaCmd::ClearPermission { vhost: "dev".into(), user: "alice".into() });
        assert!(!g.allows(&meta, "alice", "dev", Access::Read, "q"));
    }
}

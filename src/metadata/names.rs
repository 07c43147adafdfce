//! Queues, exchanges and policies live in virtual hosts. The engine (Raft
//! groups, the node link, the proposer, the state machines) names each of
//! them by one string, its *key*: the bare name in the default vhost `/`, and
//! `vhost NUL name` in any other. So the engine never needs to know about
//! vhosts, keys from before vhosts existed are still the same keys, and a
//! queue `q` in `/` and one in `dev` can never be confused. NUL is refused in
//! names and vhost names at the front ends, which keeps keys unambiguous.

pub const DEFAULT_VHOST: &str = "/";

const SEP: char = '\0';

/// The engine's key of `name` in `vhost`.
pub fn key(vhost: &str, name: &str) -> String {
    if vhost == DEFAULT_VHOST {
        name.to_string()
    } else {
        format!("{vhost}{SEP}{name}")
    }
}

/// `(vhost, name)` of a key.
pub fn split(key: &str) -> (&str, &str) {
    key.split_once(SEP).unwrap_or((DEFAULT_VHOST, key))
}

pub fn vhost_of(key: &str) -> &str {
    split(key).0
}

pub fn name_of(key: &str) -> &str {
    split(key).1
}

/// Names and vhosts that can be part of a key.
pub fn check(what: &str, name: &str) -> Result<(), String> {
    if name.contains(SEP) {
        Err(format!("{what} name must not contain a NUL character"))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_keep_default_vhost_names_bare() {
        assert_eq!(key("/", "orders"), "orders");
        assert_eq!(split("orders"), ("/", "orders"));
        let k = key("dev", "orders");
        assert_ne!(k, "orders");
        assert_eq!(split(&k), ("dev", "orders"));
        // Names may hold anything but NUL, slashes included.
        let k = key("a/b", "c/d");
        assert_eq!(split(&k), ("a/b", "c/d"));
        assert_eq!(split(&key("dev", "")), ("dev", ""));
        assert!(check("queue", "x\0y").is_err());
        assert!(check("queue", "x/y").is_ok());
    }
}

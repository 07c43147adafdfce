//! `mirrorq ctl`: the HTTP API from the command line, tables by default,
//! `--json` for scripts; a clear message and exit 1 on any error.

use std::path::Path;

use serde_json::{json, Value};

use crate::cli::{CtlArgs, CtlCommand};

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("{0}")]
    Api(String),
    #[error("cannot reach {url}: {reason}")]
    Transport { url: String, reason: String },
    #[error("{0}")]
    Input(String),
}

struct Client {
    base: String,
    auth: String,
}

impl Client {
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, CtlError> {
        let url = format!("{}{}", self.base.trim_end_matches('/'), path);
        let req =
            ureq::request(method, &url).set("Authorization", &self.auth).timeout(std::time::Duration::from_secs(60));
        let res = match body {
            Some(b) => req.send_json(b.clone()),
            None => req.call(),
        };
        match res {
            Ok(r) => {
                let text = r.into_string().unwrap_or_default();
                Ok(if text.is_empty() {
                    Value::Null
                } else {
                    serde_json::from_str(&text).unwrap_or(Value::String(text))
                })
            }
            Err(ureq::Error::Status(code, r)) => {
                let v: Value = r.into_json().unwrap_or(Value::Null);
                let reason = v["reason"].as_str().unwrap_or("").to_string();
                Err(CtlError::Api(format!("{method} {path}: {code} {} {reason}", v["error"].as_str().unwrap_or(""))))
            }
            Err(e) => Err(CtlError::Transport { url, reason: e.to_string() }),
        }
    }
}

fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = vec![line(headers.iter().map(|h| h.to_string()).collect())];
    out.extend(rows.into_iter().map(line));
    out.join("\n")
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        Value::Array(a) => a.iter().map(s).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// Run one command; returns what to print.
pub fn run(args: &CtlArgs) -> Result<String, CtlError> {
    let ctl = Ctl::new(args);
    let vhost = &ctl.vhost;
    match &args.command {
        CtlCommand::ClusterStatus => ctl.list("/api/nodes", &["name", "running"], &["node", "running"]),
        CtlCommand::ListQueues => ctl.list("/api/queues", QUEUE_KEYS, QUEUE_HEADERS),
        CtlCommand::ListPolicies => ctl.list_policies(),
        CtlCommand::SetPolicy { name, pattern, definition, priority, apply_to } => {
            ctl.set_policy(name, pattern, definition, *priority, apply_to)
        }
        CtlCommand::ClearPolicy { name } => {
            ctl.done("DELETE", &format!("/api/policies/{vhost}/{}", enc(name)), None, format!("policy {name} cleared"))
        }
        CtlCommand::SyncQueue { name } => ctl.queue_action(name, "sync", format!("sync of {name} started")),
        CtlCommand::CancelSyncQueue { name } => {
            ctl.queue_action(name, "cancel_sync", format!("sync of {name} cancelled"))
        }
        CtlCommand::ForgetNode { name } => {
            ctl.done("DELETE", &format!("/api/nodes/{}", enc(name)), None, format!("node {name} forgotten"))
        }
        CtlCommand::Rebalance => ctl.rebalance(),
        CtlCommand::ExportDefinitions { file } => ctl.export_definitions(file),
        CtlCommand::ImportDefinitions { file } => ctl.import_definitions(file),
        CtlCommand::ListUsers => ctl.list("/api/users", &["name", "tags"], &["user", "tags"]),
        CtlCommand::AddUser { name, password, tags } => {
            let body = json!({"password": password, "tags": tags});
            ctl.done("PUT", &format!("/api/users/{}", enc(name)), Some(&body), format!("user {name} added"))
        }
        CtlCommand::DeleteUser { name } => {
            ctl.done("DELETE", &format!("/api/users/{}", enc(name)), None, format!("user {name} deleted"))
        }
        CtlCommand::ListVhosts => ctl.list("/api/vhosts", &["name", "description"], &["vhost", "description"]),
        CtlCommand::AddVhost { name } => {
            ctl.done("PUT", &format!("/api/vhosts/{}", enc(name)), Some(&json!({})), format!("vhost {name} added"))
        }
        CtlCommand::DeleteVhost { name } => {
            ctl.done("DELETE", &format!("/api/vhosts/{}", enc(name)), None, format!("vhost {name} deleted"))
        }
        CtlCommand::ListPermissions => ctl.list(
            &format!("/api/vhosts/{vhost}/permissions"),
            &["user", "configure", "write", "read"],
            &["user", "configure", "write", "read"],
        ),
        CtlCommand::SetPermissions { user, configure, write, read } => {
            let body = json!({"configure": configure, "write": write, "read": read});
            let done = format!("permissions of {user} in vhost {} set", args.vhost);
            ctl.done("PUT", &format!("/api/permissions/{vhost}/{}", enc(user)), Some(&body), done)
        }
        CtlCommand::ClearPermissions { user } => {
            let done = format!("permissions of {user} in vhost {} cleared", args.vhost);
            ctl.done("DELETE", &format!("/api/permissions/{vhost}/{}", enc(user)), None, done)
        }
    }
}

/// `list_queues`: the API's keys, and the table's headers in RabbitMQ's
/// words for them.
const QUEUE_KEYS: &[&str] =
    &["vhost", "name", "node", "slave_nodes", "synchronised_slave_nodes", "messages", "policy", "state"];
const QUEUE_HEADERS: &[&str] = &["vhost", "name", "master", "mirrors", "synchronised", "messages", "policy", "state"];

/// One command's client and options.
struct Ctl<'a> {
    c: Client,
    args: &'a CtlArgs,
    /// The vhost, encoded for a path.
    vhost: String,
}

impl<'a> Ctl<'a> {
    fn new(args: &'a CtlArgs) -> Ctl<'a> {
        use base64::Engine;
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", args.user, args.password))
        );
        Ctl { c: Client { base: args.url.clone(), auth }, args, vhost: enc(&args.vhost) }
    }

    /// A call whose answer is not shown: `done` once it succeeded.
    fn done(&self, method: &str, path: &str, body: Option<&Value>, done: String) -> Result<String, CtlError> {
        self.c.call(method, path, body)?;
        Ok(done)
    }

    /// The JSON as it came (`--json`), or a table of `keys` of its items.
    fn list(&self, path: &str, keys: &[&str], headers: &[&str]) -> Result<String, CtlError> {
        let v = self.c.call("GET", path, None)?;
        if self.args.json {
            return Ok(serde_json::to_string_pretty(&v).unwrap_or_default());
        }
        let rows = v.as_array().map(Vec::as_slice).unwrap_or_default().iter();
        Ok(table(headers, rows.map(|item| keys.iter().map(|k| s(&item[*k])).collect()).collect()))
    }

    /// As [`Ctl::list`], but a definition is shown as JSON.
    fn list_policies(&self) -> Result<String, CtlError> {
        let v = self.c.call("GET", "/api/policies", None)?;
        if self.args.json {
            return Ok(serde_json::to_string_pretty(&v).unwrap_or_default());
        }
        let rows = v
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|p| {
                vec![
                    s(&p["vhost"]),
                    s(&p["name"]),
                    s(&p["pattern"]),
                    s(&p["apply-to"]),
                    s(&p["priority"]),
                    p["definition"].to_string(),
                ]
            })
            .collect();
        Ok(table(&["vhost", "name", "pattern", "apply-to", "priority", "definition"], rows))
    }

    fn set_policy(
        &self,
        name: &str,
        pattern: &str,
        definition: &str,
        priority: i64,
        apply_to: &str,
    ) -> Result<String, CtlError> {
        let def: Value = serde_json::from_str(definition)
            .map_err(|e| CtlError::Input(format!("DEFINITION_JSON is not JSON: {e}")))?;
        let body = json!({"pattern": pattern, "definition": def, "priority": priority, "apply-to": apply_to});
        self.done(
            "PUT",
            &format!("/api/policies/{}/{}", self.vhost, enc(name)),
            Some(&body),
            format!("policy {name} set"),
        )
    }

    fn queue_action(&self, name: &str, action: &str, done: String) -> Result<String, CtlError> {
        let path = format!("/api/queues/{}/{}/actions", self.vhost, enc(name));
        self.done("POST", &path, Some(&json!({"action": action})), done)
    }

    fn rebalance(&self) -> Result<String, CtlError> {
        let v = self.c.call("POST", "/api/rebalance/queues", Some(&json!({})))?;
        let moves = v["moves"].as_array().cloned().unwrap_or_default();
        let failed: Vec<String> = moves
            .iter()
            .filter(|m| !m["error"].is_null())
            .map(|m| format!("{}: {}", m["queue"].as_str().unwrap_or("?"), m["error"].as_str().unwrap_or("?")))
            .collect();
        let mut out =
            format!("rebalanced: {} of {} planned master moves done", moves.len() - failed.len(), moves.len());
        for f in failed {
            out.push_str(&format!("\nnot moved: {f}"));
        }
        Ok(out)
    }

    fn export_definitions(&self, file: &Path) -> Result<String, CtlError> {
        let v = self.c.call("GET", "/api/definitions", None)?;
        std::fs::write(file, serde_json::to_vec_pretty(&v).unwrap_or_default())
            .map_err(|e| CtlError::Input(format!("cannot write {}: {e}", file.display())))?;
        Ok(format!("definitions written to {}", file.display()))
    }

    fn import_definitions(&self, file: &Path) -> Result<String, CtlError> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| CtlError::Input(format!("cannot read {}: {e}", file.display())))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| CtlError::Input(format!("{} is not JSON: {e}", file.display())))?;
        self.c.call("POST", "/api/definitions", Some(&v))?;
        Ok(format!("definitions imported from {}", file.display()))
    }
}

/// Percent-encode a name for a path segment.
fn enc(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

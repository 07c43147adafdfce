//! A policy as a client sends it: the first line its pattern, the rest its
//! definition; validated, and matched against a queue name.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mirrorq::metadata::policy::{self, Policy};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (pattern, definition) = text.split_once('\n').unwrap_or((&text, "{}"));
    let p = Policy {
        name: "/\u{1}p".into(),
        pattern: pattern.into(),
        apply_to: mirrorq::metadata::ApplyTo::All,
        priority: 0,
        definition: definition.into(),
    };
    let _ = policy::validate(&p);
    let _ = policy::ha_policy_of(&p.definition);
    let policies = std::collections::BTreeMap::from([(p.name.clone(), p)]);
    let _ = policy::effective(&policies, "/\u{1}some.queue-name");
});

//! RabbitMQ's paging and filtering of long lists (`?page=2&page_size=100&
//! name=orders&use_regex=false`): a UI or tool listing 10,000 queues asks
//! for one page, and only that page's items are computed. Without `page`
//! a list is answered whole, as a plain array.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::ApiError;

/// RabbitMQ's bound on `page_size`.
const MAX_PAGE_SIZE: usize = 500;
const DEFAULT_PAGE_SIZE: usize = 100;

/// What a list request asked for.
pub(super) struct Listing {
    page: Option<(usize, usize)>,
    filter: Option<NameFilter>,
}

enum NameFilter {
    /// Case-insensitive substring, as RabbitMQ's UI filter box.
    Contains(String),
    Regex(regex::Regex),
}

impl Listing {
    pub(super) fn parse(q: &HashMap<String, String>) -> Result<Self, ApiError> {
        let number = |key: &str| -> Result<Option<usize>, ApiError> {
            match q.get(key) {
                None => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n >= 1 => Ok(Some(n)),
                    _ => Err(ApiError::bad_request(format!("{key} must be a whole number of at least 1, not {v:?}"))),
                },
            }
        };
        let page = number("page")?;
        let size = number("page_size")?.unwrap_or(DEFAULT_PAGE_SIZE);
        if size > MAX_PAGE_SIZE {
            return Err(ApiError::bad_request(format!("page_size must be at most {MAX_PAGE_SIZE}, not {size}")));
        }
        let use_regex = match q.get("use_regex").map(String::as_str) {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!("use_regex must be true or false, not {other:?}")))
            }
        };
        let filter = match q.get("name").filter(|n| !n.is_empty()) {
            None => None,
            Some(n) if use_regex => Some(NameFilter::Regex(
                regex::RegexBuilder::new(n)
                    .case_insensitive(true)
                    .size_limit(1 << 20)
                    .build()
                    .map_err(|e| ApiError::bad_request(format!("name is not a valid regular expression: {e}")))?,
            )),
            Some(n) => Some(NameFilter::Contains(n.to_lowercase())),
        };
        Ok(Listing { page: page.map(|p| (p, size)), filter })
    }

    /// Whether an item of this (bare) name is listed.
    pub(super) fn matches(&self, name: &str) -> bool {
        match &self.filter {
            None => true,
            Some(NameFilter::Contains(s)) => name.to_lowercase().contains(s),
            Some(NameFilter::Regex(r)) => r.is_match(name),
        }
    }

    /// The items of the page asked for, out of `filtered` (after the name
    /// filter) of `total`: the range of `filtered` to compute, and how to
    /// wrap what is computed. A page past the last is refused.
    pub(super) fn page(&self, filtered: usize) -> Result<std::ops::Range<usize>, ApiError> {
        match self.page {
            None => Ok(0..filtered),
            Some((page, size)) => {
                let pages = filtered.div_ceil(size).max(1);
                if page > pages {
                    return Err(ApiError::bad_request(format!("page out of range: {page} of {pages}")));
                }
                let start = (page - 1) * size;
                Ok(start..(start + size).min(filtered))
            }
        }
    }

    /// The answer: a plain array without `page`, else RabbitMQ's page object.
    pub(super) fn wrap(&self, items: Vec<Value>, filtered: usize, total: usize) -> Value {
        match self.page {
            None => Value::Array(items),
            Some((page, size)) => json!({
                "filtered_count": filtered,
                "item_count": items.len(),
                "items": items,
                "page": page,
                "page_count": filtered.div_ceil(size).max(1),
                "page_size": size,
                "total_count": total,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(pairs: &[(&str, &str)]) -> Result<Listing, ApiError> {
        Listing::parse(&pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn a_page_is_its_slice_and_says_how_many_there_are() {
        let l = listing(&[("page", "3"), ("page_size", "4")]).unwrap();
        assert_eq!(l.page(10).unwrap(), 8..10);
        let v = l.wrap(vec![json!(1), json!(2)], 10, 12);
        assert_eq!(v["page_count"], 3);
        assert_eq!(v["item_count"], 2);
        assert_eq!(v["filtered_count"], 10);
        assert_eq!(v["total_count"], 12);
        assert!(l.page(8).is_err(), "page 3 of 2");
        assert_eq!(listing(&[("page", "1")]).unwrap().page(0).unwrap(), 0..0, "an empty list has one empty page");
        assert!(listing(&[]).unwrap().wrap(vec![], 0, 0).is_array(), "no page asked: a plain array");
    }

    #[test]
    fn names_filter_by_substring_or_regex_ignoring_case() {
        let l = listing(&[("name", "Order")]).unwrap();
        assert!(l.matches("big-orders") && !l.matches("invoices"));
        let l = listing(&[("name", "^ha\\.[0-9]+$"), ("use_regex", "true")]).unwrap();
        assert!(l.matches("HA.12") && !l.matches("ha.x") && !l.matches("xha.1"));
        let l = listing(&[("name", "ha.1")]).unwrap();
        assert!(!l.matches("hax1"), "without use_regex a dot is a dot");
    }

    #[test]
    fn bad_paging_is_refused_with_a_reason() {
        for bad in [
            &[("page", "0")][..],
            &[("page", "x")],
            &[("page", "1"), ("page_size", "501")],
            &[("use_regex", "yes")],
            &[("name", "("), ("use_regex", "true")],
        ] {
            assert!(listing(bad).is_err(), "{bad:?} accepted");
        }
    }
}

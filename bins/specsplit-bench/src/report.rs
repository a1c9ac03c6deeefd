//! Writing results: `<out>/<name>.json` (`{"meta": …, "rows": […], …}`) and `<out>/<name>.csv`
//! (one line per row, columns = the union of the rows' keys, nested values as JSON).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Map, Value};

/// Writes the JSON document and the CSV of its `rows`; returns both paths.
pub fn write(out: &Path, name: &str, doc: &Value) -> Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = out.join(format!("{name}.json"));
    let csv = out.join(format!("{name}.csv"));
    std::fs::write(&json, serde_json::to_string_pretty(doc)? + "\n")
        .with_context(|| format!("writing {}", json.display()))?;
    let rows: Vec<Map<String, Value>> = doc
        .get("rows")
        .and_then(Value::as_array)
        .map(|rows| rows.iter().filter_map(|r| r.as_object().cloned()).collect())
        .unwrap_or_default();
    std::fs::write(&csv, to_csv(&rows)).with_context(|| format!("writing {}", csv.display()))?;
    Ok((json, csv))
}

/// CSV text of `rows`, columns in first-seen order.
pub fn to_csv(rows: &[Map<String, Value>]) -> String {
    let mut cols: Vec<&str> = Vec::new();
    for r in rows {
        for k in r.keys() {
            if !cols.contains(&k.as_str()) {
                cols.push(k);
            }
        }
    }
    let mut s = cols.iter().map(|c| field(c)).collect::<Vec<_>>().join(",") + "\n";
    for r in rows {
        let line: Vec<String> = cols
            .iter()
            .map(|c| match r.get(*c) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(x)) => field(x),
                Some(v) => field(&v.to_string()),
            })
            .collect();
        s += &line.join(",");
        s.push('\n');
    }
    s
}

/// One CSV field, quoted when needed.
fn field(x: &str) -> String {
    if x.contains([',', '"', '\n']) {
        format!("\"{}\"", x.replace('"', "\"\""))
    } else {
        x.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_and_unions_columns() {
        let rows: Vec<Map<String, Value>> = vec![
            serde_json::from_str(r#"{"a": 1, "b": "x,y"}"#).unwrap(),
            serde_json::from_str(r#"{"a": 2.5, "c": [1, 2], "b": null}"#).unwrap(),
        ];
        assert_eq!(to_csv(&rows), "a,b,c\n1,\"x,y\",\n2.5,,\"[1,2]\"\n");
    }
}

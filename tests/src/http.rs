//! A minimal HTTP/1.1 client over a raw `TcpStream`: one request per connection
//! (`Connection: close`), and control over when to hang up, which the
//! client-disconnect tests need and a full client library would hide.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response read to the end.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Lowercase names; repeated headers joined with `, `.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Builds the bytes of a request.
pub fn encode(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nHost: tollgate\r\nConnection: close\r\n");
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" || method == "PUT" {
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Sends one request and reads the whole response.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(&encode(method, path, headers, body))
        .await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    parse(&raw)
}

/// `send` with a JSON body and optional bearer token.
pub async fn json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&serde_json::Value>,
) -> Response {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    tokio::time::timeout(
        Duration::from_secs(60),
        send(addr, method, path, &headers, body.as_bytes()),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {path}: no answer within 60s"))
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// `POST /admin/users` as `admin`: creates `user` on `plan`.
pub async fn create_user(addr: SocketAddr, admin: &str, user: &str, plan: &str) -> Response {
    let body = serde_json::json!({"user": user, "plan": plan});
    json(addr, "POST", "/admin/users", Some(admin), Some(&body)).await
}

/// [`create_user`], which must answer 201: the new user's api key.
pub async fn user_key(addr: SocketAddr, admin: &str, user: &str, plan: &str) -> String {
    let created = create_user(addr, admin, user, plan).await;
    assert_eq!(created.status, 201, "{}", created.text());
    created.json()["api_key"]
        .as_str()
        .unwrap_or_else(|| panic!("no api_key in {}", created.text()))
        .to_owned()
}

/// Waits until `GET /readyz` on `addr` answers 200, polling every 50 ms;
/// panics once `deadline` has passed first.
pub async fn wait_ready(addr: SocketAddr, deadline: Instant) {
    while !matches!(send(addr, "GET", "/readyz", &[], b"").await, Ok(r) if r.status == 200) {
        assert!(
            Instant::now() < deadline,
            "tollgate api did not come up on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `reqwest` client whose requests give up after `timeout`, with the
/// process's TLS provider installed first.
pub fn reqwest_client(timeout: Duration) -> reqwest::Client {
    tollgate_providers::http::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .unwrap_or_else(|e| panic!("a reqwest client: {e}"))
}

/// A `reqwest` request sent and its body read as JSON, panicking on a
/// transport error or a body that is not JSON (a failed test).
pub trait FetchJson {
    fn fetch_json(self) -> impl Future<Output = serde_json::Value> + Send;
}

impl FetchJson for reqwest::RequestBuilder {
    async fn fetch_json(self) -> serde_json::Value {
        let response = self
            .send()
            .await
            .unwrap_or_else(|e| panic!("request failed: {e}"));
        response
            .json()
            .await
            .unwrap_or_else(|e| panic!("not a JSON body: {e}"))
    }
}

fn parse(raw: &[u8]) -> std::io::Result<Response> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| bad("headers not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status line"))?;
    let mut headers = BTreeMap::<String, String>::new();
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            let k = k.trim().to_ascii_lowercase();
            let v = v.trim().to_owned();
            headers
                .entry(k)
                .and_modify(|e| {
                    e.push_str(", ");
                    e.push_str(&v);
                })
                .or_insert(v);
        }
    }
    let mut body = raw[end + 4..].to_vec();
    if headers
        .get("transfer-encoding")
        .is_some_and(|t| t.contains("chunked"))
    {
        body = dechunk(&body).ok_or_else(|| bad("bad chunked body"))?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n")?;
        let size =
            usize::from_str_radix(std::str::from_utf8(&data[..line_end]).ok()?.trim(), 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(data.get(..size)?);
        data = data.get(size + 2..)?;
    }
}

/// `GET /v1/usage` with every live event: the first page's body, its `events`
/// replaced by those of every page (following `next_cursor`). Pages are
/// separate reads, not one snapshot: the walk is repeated (up to 20 times)
/// until `used` did not move between its first and last page.
pub async fn usage_all(addr: SocketAddr, key: &str) -> serde_json::Value {
    let mut tries = 0;
    loop {
        let mut usage = json(addr, "GET", "/v1/usage", Some(key), None).await.json();
        let mut events = usage["events"].as_array().cloned().unwrap_or_default();
        let mut next = usage["next_cursor"].as_str().map(str::to_owned);
        let mut last_used = usage["used"].clone();
        while let Some(cursor) = next {
            let path = format!("/v1/usage?cursor={cursor}");
            let page = json(addr, "GET", &path, Some(key), None).await.json();
            events.extend(page["events"].as_array().cloned().unwrap_or_default());
            next = page["next_cursor"].as_str().map(str::to_owned);
            last_used = page["used"].clone();
        }
        tries += 1;
        if last_used == usage["used"] || tries >= 20 {
            usage["events"] = serde_json::Value::Array(events);
            usage["next_cursor"] = serde_json::Value::Null;
            return usage;
        }
    }
}

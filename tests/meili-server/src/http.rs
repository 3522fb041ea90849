//! Minimal HTTP/1.1: request parsing (Content-Length and chunked bodies, `Expect:
//! 100-continue`, gzip/deflate request bodies) and response writing.

use std::io::{self, BufRead, Read, Write};

const MAX_HEAD: usize = 64 * 1024;

pub(crate) struct Request {
    pub(crate) method: String,
    /// Path and query as sent.
    pub(crate) target: String,
    pub(crate) keep_alive: bool,
    headers: Vec<(String, String)>,
    /// Body after content decoding.
    pub(crate) body: Vec<u8>,
    /// The payload limit the body was read under.
    pub(crate) limit: usize,
    /// The body (raw or decoded) was over the payload limit; it was discarded or left unread.
    pub(crate) too_large: Option<TooLarge>,
    /// `Content-Encoding` was set but the body could not be decoded.
    pub(crate) undecodable: bool,
}

/// How a route reads its body, as actix does for Meilisearch's extractors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum BodyKind {
    /// A document payload (actix `Payload`): read until more than the limit has arrived.
    Stream,
    /// A `web::Json` body: a `Content-Length` over the limit is refused before reading.
    Json,
}

/// Why a body was over the payload limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum TooLarge {
    /// More than the limit arrived, or came out of decompression.
    Body,
    /// A JSON body announced this `Content-Length`; none of it was read.
    Announced(usize),
}

impl Request {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    pub(crate) fn query(&self) -> &str {
        self.target.split_once('?').map_or("", |(_, q)| q)
    }

    pub(crate) fn content_encoding(&self) -> Option<String> {
        self.header("content-encoding").map(str::to_string)
    }
}

pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(&'static str, String)>,
    pub(crate) body: Vec<u8>,
}

impl Response {
    pub(crate) fn json(status: u16, body: String) -> Self {
        Response {
            status,
            headers: vec![("Content-Type", "application/json".into())],
            body: body.into_bytes(),
        }
    }

    pub(crate) fn empty(status: u16) -> Self {
        Response {
            status,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    pub(crate) fn write_to(&self, w: &mut impl Write, keep_alive: bool) -> io::Result<()> {
        let mut head = format!("HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        for (k, v) in &self.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n", self.body.len()));
        if !keep_alive {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        w.write_all(head.as_bytes())?;
        w.write_all(&self.body)?;
        w.flush()
    }
}

pub(crate) enum ReadError {
    /// The peer closed the connection or the socket failed.
    Closed,
    /// Unparseable request: answer with this status and close.
    Bad(u16),
}

impl From<io::Error> for ReadError {
    fn from(_: io::Error) -> Self {
        ReadError::Closed
    }
}

/// Reads one request. `Ok(None)` on a clean end of stream before a new request. `body_kind`
/// tells, from the method and path, how the route reads its body.
///
/// Over the limit, Meilisearch 1.50 (actix) answers before the rest of the body is read and
/// then closes the connection, so a client still uploading sees a broken pipe or a reset: a
/// document payload with a `Content-Length` is read up to one byte past the limit, a JSON body
/// not at all (observed: `Content-Length: 200000000` to `POST /indexes/big/documents`, 413
/// after about 100 MB, then the connection closed, the client's write failing with `EPIPE`;
/// `Content-Length: 100000001` to `.../documents/delete-batch`, 500 at once, then closed). A
/// chunked body is drained and the connection kept (observed: 150 MB chunked, 413, then a
/// pipelined `GET /health` answered on the same connection).
pub(crate) fn read_request(
    r: &mut impl BufRead,
    w: &mut impl Write,
    limit: usize,
    body_kind: impl Fn(&str, &str) -> BodyKind,
) -> Result<Option<Request>, ReadError> {
    let Some(request_line) = read_line(r, MAX_HEAD)? else {
        return Ok(None);
    };
    let mut parts = request_line.split_whitespace();
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(ReadError::Bad(400));
    };
    let (method, target, version) = (method.to_string(), target.to_string(), version.to_string());
    let mut headers = Vec::new();
    let mut head_size = request_line.len();
    loop {
        let line = read_line(r, MAX_HEAD)?.ok_or(ReadError::Closed)?;
        head_size += line.len();
        if head_size > MAX_HEAD {
            return Err(ReadError::Bad(431));
        }
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':').ok_or(ReadError::Bad(400))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let mut req = Request {
        method,
        target,
        keep_alive: true,
        headers,
        body: Vec::new(),
        limit,
        too_large: None,
        undecodable: false,
    };
    let connection = req.header("connection").unwrap_or("").to_ascii_lowercase();
    req.keep_alive = if version == "HTTP/1.0" {
        connection.contains("keep-alive")
    } else {
        !connection.contains("close")
    };

    let chunked = req
        .header("transfer-encoding")
        .is_some_and(|te| te.to_ascii_lowercase().contains("chunked"));
    let length = match req.header("content-length") {
        Some(v) if !chunked => Some(v.parse::<usize>().map_err(|_| ReadError::Bad(400))?),
        _ => None,
    };
    let expects_continue = req
        .header("expect")
        .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"));
    if expects_continue && (chunked || length.unwrap_or(0) > 0) {
        // Meilisearch says "continue" whatever the size, then refuses the body as it arrives.
        w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        w.flush()?;
    }

    let mut body = Vec::new();
    if chunked {
        read_chunked(r, &mut body, limit, &mut req.too_large)?;
    } else if let Some(n) = length.filter(|n| *n > limit) {
        // The rest of the body stays unread: the connection is closed after the answer.
        let kind = body_kind(&req.method, req.path());
        let read = match kind {
            BodyKind::Json => {
                req.too_large = Some(TooLarge::Announced(n));
                0
            }
            BodyKind::Stream => {
                req.too_large = Some(TooLarge::Body);
                io::copy(&mut r.take(limit as u64 + 1), &mut io::sink())?
            }
        };
        req.keep_alive &= read == n as u64;
    } else if let Some(n) = length {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    }
    if req.too_large.is_none() {
        decode_body(&mut req, body, limit);
    }
    Ok(Some(req))
}

fn read_chunked(
    r: &mut impl BufRead,
    body: &mut Vec<u8>,
    limit: usize,
    too_large: &mut Option<TooLarge>,
) -> Result<(), ReadError> {
    loop {
        let line = read_line(r, MAX_HEAD)?.ok_or(ReadError::Closed)?;
        let size_hex = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| ReadError::Bad(400))?;
        if size == 0 {
            // Trailers until the empty line.
            while !read_line(r, MAX_HEAD)?.ok_or(ReadError::Closed)?.is_empty() {}
            return Ok(());
        }
        if too_large.is_some() || body.len() + size > limit {
            *too_large = Some(TooLarge::Body);
            body.clear();
            io::copy(&mut r.take(size as u64), &mut io::sink())?;
        } else {
            let start = body.len();
            body.resize(start + size, 0);
            r.read_exact(&mut body[start..])?;
        }
        read_line(r, MAX_HEAD)?;
    }
}

fn decode_body(req: &mut Request, body: Vec<u8>, limit: usize) {
    let encoding = req
        .header("content-encoding")
        .unwrap_or("identity")
        .to_ascii_lowercase();
    let mut decoded = Vec::new();
    let result = match encoding.trim() {
        "" | "identity" => {
            req.body = body;
            return;
        }
        "gzip" | "x-gzip" => flate2::read::MultiGzDecoder::new(&body[..])
            .take(limit as u64 + 1)
            .read_to_end(&mut decoded),
        "deflate" => flate2::read::ZlibDecoder::new(&body[..])
            .take(limit as u64 + 1)
            .read_to_end(&mut decoded),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "unsupported encoding",
        )),
    };
    match result {
        Ok(_) if decoded.len() > limit => req.too_large = Some(TooLarge::Body),
        Ok(_) => req.body = decoded,
        Err(_) => req.undecodable = true,
    }
}

/// One CRLF- (or LF-) terminated line without its terminator; `None` at end of stream.
fn read_line(r: &mut impl BufRead, max: usize) -> Result<Option<String>, ReadError> {
    let mut buf = Vec::new();
    let n = r.take(max as u64 + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(if n > max {
            ReadError::Bad(431)
        } else {
            ReadError::Closed
        });
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| ReadError::Bad(400))
}

pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        451 => "Unavailable For Legal Reasons",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// Percent-decoding for path segments and query strings (`+` is a space only in queries).
pub(crate) fn percent_decode(s: &str, plus_is_space: bool) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' if plus_is_space => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Decoded `key=value` pairs of a query string, in order.
pub(crate) fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect()
}

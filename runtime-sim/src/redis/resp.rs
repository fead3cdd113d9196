//! RESP, Redis's wire format, as the simulated node speaks it: the store's commands arrive
//! as the bytes redis-rs packed, and the node's answers leave as the bytes a Redis server
//! writes, which redis-rs parses (errors included: `NOSCRIPT` makes it load its script).

/// An answer of the node.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// `+PONG`, `+OK`.
    Status(&'static str),
    /// `-CODE message`.
    Error(String),
    /// `:n`.
    Int(i64),
    /// `$n` and the bytes.
    Bulk(Vec<u8>),
    /// `$-1`.
    Nil,
    /// `*n` and the elements.
    Array(Vec<Reply>),
}

impl Reply {
    /// A bulk string of `s`.
    pub fn bulk(s: impl AsRef<[u8]>) -> Reply {
        Reply::Bulk(s.as_ref().to_vec())
    }

    /// The bytes a Redis server writes for this answer.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Status(s) => out.extend_from_slice(format!("+{s}\r\n").as_bytes()),
            // A message is one line.
            Reply::Error(e) => {
                out.extend_from_slice(format!("-{}\r\n", e.replace(['\r', '\n'], " ")).as_bytes());
            }
            Reply::Int(n) => out.extend_from_slice(format!(":{n}\r\n").as_bytes()),
            Reply::Bulk(b) => {
                out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
                out.extend_from_slice(b);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
            Reply::Array(items) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                for item in items {
                    item.write(out);
                }
            }
        }
    }
}

/// A command's arguments from the bytes a client sent: `*n\r\n` and `n` bulk strings
/// (`$len\r\n`, the bytes, `\r\n`), and nothing after them.
pub fn command(bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut input = Input(bytes);
    let n = input.header(b'*')?;
    let mut args = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let len = input.header(b'$')?;
        args.push(input.take(len)?.to_vec());
        if input.take(2)? != b"\r\n" {
            return Err(protocol("a bulk string longer than it said"));
        }
    }
    if !input.0.is_empty() {
        return Err(protocol("bytes after the command"));
    }
    Ok(args)
}

fn protocol(what: &str) -> String {
    format!("ERR Protocol error: {what}")
}

/// What is left to read of a command.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(protocol("the command ends early"));
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }

    /// A `kind` line's number: `*3\r\n`, `$5\r\n`.
    fn header(&mut self, kind: u8) -> Result<usize, String> {
        let end = self
            .0
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| protocol("a line without its end"))?;
        let line = self.take(end)?;
        self.take(2)?;
        match line.split_first() {
            Some((k, n)) if *k == kind => std::str::from_utf8(n)
                .ok()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| protocol("invalid length")),
            _ => Err(protocol(&format!("expected '{}'", char::from(kind)))),
        }
    }
}

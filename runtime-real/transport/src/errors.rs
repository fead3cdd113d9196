//! Error messages that keep their causes.

/// `e` and each of its sources, joined with ": " (tonic's transport errors say only
/// "transport error" at the top).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn joins_sources_without_repeating_them() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let outer = std::io::Error::other(io);
        assert_eq!(super::chain(&outer), "refused");
        #[derive(Debug)]
        struct Top(std::io::Error);
        impl std::fmt::Display for Top {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Top {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let top = Top(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        ));
        assert_eq!(super::chain(&top), "transport error: connection refused");
    }
}

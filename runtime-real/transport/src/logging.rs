//! The binaries' log set-up.

use tracing_subscriber::fmt::MakeWriter;

/// Installs the global tracing subscriber: `filter` in RUST_LOG syntax (from `--log`),
/// lines to `writer`, coloured when `ansi`. An invalid filter is an error naming it.
pub fn init<W>(filter: &str, writer: W, ansi: bool) -> Result<(), String>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| format!("invalid --log filter {filter:?}: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi)
        .init();
    Ok(())
}

/// [`init`] writing to standard error, coloured when it is a terminal.
pub fn init_stderr(filter: &str) -> Result<(), String> {
    use std::io::IsTerminal;
    init(filter, std::io::stderr, std::io::stderr().is_terminal())
}

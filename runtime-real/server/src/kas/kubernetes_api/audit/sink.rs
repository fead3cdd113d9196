//! Where the audit lines go: standard output, or a file rotated by size.

use crate::config::Audit;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The audit log's destination.
pub enum Sink {
    Stdout,
    File(Rotated),
}

/// A file renamed to `PATH.1` once it would pass `max_size` (older ones shifting to
/// `PATH.2` and on, `max_files` kept), and a new one started.
pub struct Rotated {
    path: PathBuf,
    max_size: u64,
    max_files: usize,
    /// The open file and its size; `None` after a failure, so that the next write opens
    /// it again (it may have been moved, or its directory made again).
    open: Option<(File, u64)>,
}

impl Sink {
    /// The destination `config` names, a file opened now so that a start without the right
    /// to write it fails.
    pub fn open(config: &Audit) -> io::Result<Sink> {
        if config.to_stdout() {
            return Ok(Sink::Stdout);
        }
        let mut file = Rotated {
            path: config.path.clone(),
            max_size: config.max_size,
            max_files: config.max_files,
            open: None,
        };
        file.open = Some(file.reopen().map_err(|e| name(&file.path, e))?);
        Ok(Sink::File(file))
    }

    /// What the log writes to, for its errors.
    pub fn name(&self) -> String {
        match self {
            Sink::Stdout => "standard output".into(),
            Sink::File(f) => f.path.display().to_string(),
        }
    }

    /// Writes `lines` (each ending with a newline), whole lines only: on an error, the
    /// error and how many bytes of whole lines were written before it.
    pub fn write(&mut self, lines: &[u8]) -> Result<(), (usize, io::Error)> {
        match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(lines)
                    .and_then(|()| out.flush())
                    .map_err(|e| (0, e))
            }
            Sink::File(f) => {
                let mut done = 0;
                while done < lines.len() {
                    let rest = lines.get(done..).unwrap_or_default();
                    done += f.write_some(rest).map_err(|e| (done, e))?;
                }
                Ok(())
            }
        }
    }
}

impl Rotated {
    /// Writes the whole lines at the start of `lines` that fit in the file (at least one,
    /// rotating first when the file has any), returning their bytes; on an error nothing
    /// of them stays in the file.
    fn write_some(&mut self, lines: &[u8]) -> io::Result<usize> {
        let (mut file, mut size) = match self.open.take() {
            Some(open) => open,
            None => self.reopen()?,
        };
        let first = line_end(lines, 0);
        if size > 0 && size + first as u64 > self.max_size {
            drop(file);
            self.rotate()?;
            (file, size) = self.reopen()?;
        }
        let room = usize::try_from(self.max_size.saturating_sub(size)).unwrap_or(usize::MAX);
        let mut end = first;
        while end < lines.len() {
            let next = line_end(lines, end);
            if next > room {
                break;
            }
            end = next;
        }
        if let Err(e) = file.write_all(lines.get(..end).unwrap_or_default()) {
            // A partial line would break every reader of the file: cut it off (the file
            // is appended to, so the next write lands at the cut).
            let _ = file.set_len(size);
            return Err(e);
        }
        self.open = Some((file, size + end as u64));
        Ok(end)
    }

    fn reopen(&self) -> io::Result<(File, u64)> {
        let mut options = OpenOptions::new();
        options.create(true).append(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let file = options.open(&self.path)?;
        let size = file.metadata()?.len();
        Ok((file, size))
    }

    /// Shifts `PATH.n` to `PATH.n+1` (dropping the one past `max_files`), then `PATH` to
    /// `PATH.1`.
    fn rotate(&self) -> io::Result<()> {
        let numbered = |n: usize| {
            let mut p = self.path.clone().into_os_string();
            p.push(format!(".{n}"));
            PathBuf::from(p)
        };
        if self.max_files == 0 {
            return gone_is_fine(std::fs::remove_file(&self.path));
        }
        gone_is_fine(std::fs::remove_file(numbered(self.max_files)))?;
        for n in (1..self.max_files).rev() {
            gone_is_fine(std::fs::rename(numbered(n), numbered(n + 1)))?;
        }
        std::fs::rename(&self.path, numbered(1))
    }
}

/// Where the line starting at `from` in `lines` ends (past its newline).
fn line_end(lines: &[u8], from: usize) -> usize {
    let rest = lines.get(from..).unwrap_or_default();
    rest.iter()
        .position(|&b| b == b'\n')
        .map_or(lines.len(), |i| from + i + 1)
}

fn gone_is_fine(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

fn name(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

//! Redis Cluster's key slots: the real cluster client groups its writes by them, and the
//! simulated cluster splits its keys into shards by them.

/// How many hash slots a Redis Cluster has.
pub const SLOTS: u16 = 16384;

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag (the text inside the first
/// non-empty `{...}`), or of the whole key without one, modulo 16384.
pub fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|b| *b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    crc16(tagged.unwrap_or(bytes)) % SLOTS
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in data {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_redis_cluster_hashing() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_ne!(
            slot("foo{}{bar}"),
            slot("bar"),
            "an empty tag hashes the whole key"
        );
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
    }
}

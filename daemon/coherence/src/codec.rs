//! Wire encoding of [`Batch`]es: fixed-width little-endian fields, one tag
//! byte per message. Peer streams carry these bytes; decoding never trusts
//! a length it has not checked against what is left of the input.

use crate::msg::{Batch, GrantResult, LocateResult, Msg, PublishResult, Registration};
use crate::{BlockKey, SlotMeta, SlotRef};

/// Version of the encoding (first byte of every encoded batch).
pub const CODEC_VERSION: u8 = 2;
/// Most messages one decoded batch may hold (a daemon's batches hold at
/// most `coherence.batch_entries_max`, itself at most this).
pub const DECODE_ENTRIES_MAX: usize = 1 << 16;
/// Most copies one decoded announce may hold (`coherence.
/// announce_entries_max` is at most this).
pub const ANNOUNCE_ENTRIES_MAX: usize = 1 << 18;

/// Why bytes are not a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Input ended inside a field.
    Truncated,
    /// Unknown codec version.
    Version(u8),
    /// Unknown message or result tag.
    Tag(u8),
    /// A count above `DECODE_ENTRIES_MAX` or above what the input can hold.
    Count(u64),
    /// Bytes left after the last message.
    Trailing(usize),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Truncated => write!(f, "batch truncated"),
            DecodeError::Version(v) => write!(f, "unknown batch encoding version {v}"),
            DecodeError::Tag(t) => write!(f, "unknown tag {t}"),
            DecodeError::Count(n) => write!(f, "implausible entry count {n}"),
            DecodeError::Trailing(n) => write!(f, "{n} bytes after the last message"),
        }
    }
}

impl std::error::Error for DecodeError {}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bool(&mut self, v: bool) {
        self.u8(v as u8);
    }
    fn key(&mut self, k: &BlockKey) {
        self.u64(k.ns);
        self.0.extend_from_slice(&k.key.to_le_bytes());
    }
    fn slot(&mut self, s: &SlotRef) {
        self.u32(s.slot);
        self.u64(s.generation);
    }
    fn meta(&mut self, m: &SlotMeta) {
        self.key(&m.key);
        self.u64(m.version);
        self.u64(m.generation);
        self.u64(m.checksum);
    }
    fn reg(&mut self, g: &Registration) {
        self.key(&g.key);
        self.u64(g.version);
        self.u64(g.copy);
    }
}

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        if self.0.len() < N {
            return Err(DecodeError::Truncated);
        }
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        Ok(a.try_into().expect("length checked"))
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            t => Err(DecodeError::Tag(t)),
        }
    }
    fn key(&mut self) -> Result<BlockKey, DecodeError> {
        Ok(BlockKey { ns: self.u64()?, key: u128::from_le_bytes(self.take()?) })
    }
    fn slot(&mut self) -> Result<SlotRef, DecodeError> {
        Ok(SlotRef { slot: self.u32()?, generation: self.u64()? })
    }
    fn meta(&mut self) -> Result<SlotMeta, DecodeError> {
        Ok(SlotMeta { key: self.key()?, version: self.u64()?, generation: self.u64()?, checksum: self.u64()? })
    }
    fn reg(&mut self) -> Result<Registration, DecodeError> {
        Ok(Registration { key: self.key()?, version: self.u64()?, copy: self.u64()? })
    }
    /// A count of entries of at least `min_entry` bytes each.
    fn count(&mut self, min_entry: usize, max: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n > max || n.saturating_mul(min_entry) > self.0.len() {
            return Err(DecodeError::Count(n as u64));
        }
        Ok(n)
    }
}

impl Batch {
    /// Encodes the batch for a peer stream.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::with_capacity(21 + self.msgs.len() * 48));
        w.u8(CODEC_VERSION);
        w.u64(self.epoch);
        w.u64(self.incarnation);
        w.u32(self.msgs.len() as u32);
        for m in &self.msgs {
            encode_msg(&mut w, m);
        }
        w.0
    }

    /// Decodes bytes from a peer stream (untrusted input).
    pub fn decode(bytes: &[u8]) -> Result<Batch, DecodeError> {
        let mut r = R(bytes);
        let v = r.u8()?;
        if v != CODEC_VERSION {
            return Err(DecodeError::Version(v));
        }
        let epoch = r.u64()?;
        let incarnation = r.u64()?;
        let n = r.count(1, DECODE_ENTRIES_MAX)?;
        // Grown as messages decode: a count is a claim, and a message in
        // memory is ~100 times its smallest encoding.
        let mut msgs = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            msgs.push(decode_msg(&mut r)?);
        }
        if !r.0.is_empty() {
            return Err(DecodeError::Trailing(r.0.len()));
        }
        Ok(Batch { epoch, incarnation, msgs })
    }
}

fn encode_msg(w: &mut W, m: &Msg) {
    match m {
        Msg::PublishReq { op, key, checksum, copy } => {
            w.u8(1);
            w.u64(*op);
            w.key(key);
            w.u64(*checksum);
            w.u64(*copy);
        }
        Msg::PublishResp { op, key, result, copy } => {
            w.u8(2);
            w.u64(*op);
            w.key(key);
            match result {
                PublishResult::Stored(v) => {
                    w.u8(0);
                    w.u64(*v);
                }
                PublishResult::Busy => w.u8(1),
            }
            w.u64(*copy);
        }
        Msg::PublishAbort { op, key } => {
            w.u8(3);
            w.u64(*op);
            w.key(key);
        }
        Msg::Invalidate { key, version, change } => {
            w.u8(4);
            w.key(key);
            w.u64(*version);
            w.u64(*change);
        }
        Msg::InvalidateAck { key, version, change } => {
            w.u8(5);
            w.key(key);
            w.u64(*version);
            w.u64(*change);
        }
        Msg::InvalidateReq { op, key } => {
            w.u8(6);
            w.u64(*op);
            w.key(key);
        }
        Msg::InvalidateResp { op, key, ok } => {
            w.u8(7);
            w.u64(*op);
            w.key(key);
            w.bool(*ok);
        }
        // Without a copy id, as before the locate-time registration (a
        // daemon that predates it decodes it); with one, tag 20.
        Msg::LocateReq { op, key, copy: 0 } => {
            w.u8(8);
            w.u64(*op);
            w.key(key);
        }
        Msg::LocateReq { op, key, copy } => {
            w.u8(20);
            w.u64(*op);
            w.key(key);
            w.u64(*copy);
        }
        // With the locate-time registration the home made: tags 21 and 22
        // (the body of 9 and 11, then key, version and copy id).
        Msg::LocateResp { op, key, result, reg } => {
            w.u8(if reg.is_none() { 9 } else { 21 });
            w.u64(*op);
            w.key(key);
            match result {
                LocateResult::Found { version, holder } => {
                    w.u8(0);
                    w.u64(*version);
                    w.u32(*holder);
                }
                LocateResult::Miss => w.u8(1),
                LocateResult::Busy => w.u8(2),
            }
            if let Some(reg) = reg {
                w.reg(reg);
            }
        }
        Msg::GrantReq { op, key, version } => {
            w.u8(10);
            w.u64(*op);
            w.key(key);
            w.u64(*version);
        }
        Msg::GrantResp { op, result, reg } => {
            w.u8(if reg.is_none() { 11 } else { 22 });
            w.u64(*op);
            match result {
                GrantResult::Granted { slot, meta, lease_us, grant } => {
                    w.u8(0);
                    w.slot(slot);
                    w.meta(meta);
                    w.u64(*lease_us);
                    w.u64(*grant);
                }
                GrantResult::Refused => w.u8(1),
            }
            if let Some(reg) = reg {
                w.reg(reg);
            }
        }
        Msg::GrantRelease { slot, grant } => {
            w.u8(12);
            w.slot(slot);
            w.u64(*grant);
        }
        Msg::AddHolderReq { op, key, version, copy } => {
            w.u8(13);
            w.u64(*op);
            w.key(key);
            w.u64(*version);
            w.u64(*copy);
        }
        Msg::AddHolderResp { op, key, version, copy, ok } => {
            w.u8(14);
            w.u64(*op);
            w.key(key);
            w.u64(*version);
            w.u64(*copy);
            w.bool(*ok);
        }
        Msg::RemoveHolder { key, version, copy } => {
            w.u8(15);
            w.key(key);
            w.u64(*version);
            w.u64(*copy);
        }
        Msg::Announce { round, part, parts, entries } => {
            w.u8(16);
            w.u64(*round);
            w.u32(*part);
            w.u32(*parts);
            w.u32(entries.len() as u32);
            for (k, v, c) in entries {
                w.key(k);
                w.u64(*v);
                w.u64(*c);
            }
        }
        Msg::AnnounceAck => w.u8(17),
        Msg::LookupReq { op, keys } => {
            w.u8(18);
            w.u64(*op);
            w.u32(keys.len() as u32);
            for k in keys {
                w.key(k);
            }
        }
        Msg::LookupResp { op, found } => {
            w.u8(19);
            w.u64(*op);
            w.u32(found.len() as u32);
            for (v, h) in found {
                w.u64(*v);
                w.u32(*h);
            }
        }
    }
}

fn decode_msg(r: &mut R<'_>) -> Result<Msg, DecodeError> {
    let tag = r.u8()?;
    Ok(match tag {
        1 => Msg::PublishReq { op: r.u64()?, key: r.key()?, checksum: r.u64()?, copy: r.u64()? },
        2 => {
            let (op, key) = (r.u64()?, r.key()?);
            let result = match r.u8()? {
                0 => PublishResult::Stored(r.u64()?),
                1 => PublishResult::Busy,
                t => return Err(DecodeError::Tag(t)),
            };
            Msg::PublishResp { op, key, result, copy: r.u64()? }
        }
        3 => Msg::PublishAbort { op: r.u64()?, key: r.key()? },
        4 => Msg::Invalidate { key: r.key()?, version: r.u64()?, change: r.u64()? },
        5 => Msg::InvalidateAck { key: r.key()?, version: r.u64()?, change: r.u64()? },
        6 => Msg::InvalidateReq { op: r.u64()?, key: r.key()? },
        7 => Msg::InvalidateResp { op: r.u64()?, key: r.key()?, ok: r.bool()? },
        8 => Msg::LocateReq { op: r.u64()?, key: r.key()?, copy: 0 },
        9 | 21 => {
            let (op, key) = (r.u64()?, r.key()?);
            let result = match r.u8()? {
                0 => LocateResult::Found { version: r.u64()?, holder: r.u32()? },
                1 => LocateResult::Miss,
                2 => LocateResult::Busy,
                t => return Err(DecodeError::Tag(t)),
            };
            let reg = if tag == 21 { Some(r.reg()?) } else { None };
            Msg::LocateResp { op, key, result, reg }
        }
        10 => Msg::GrantReq { op: r.u64()?, key: r.key()?, version: r.u64()? },
        11 | 22 => {
            let op = r.u64()?;
            let result = match r.u8()? {
                0 => GrantResult::Granted { slot: r.slot()?, meta: r.meta()?, lease_us: r.u64()?, grant: r.u64()? },
                1 => GrantResult::Refused,
                t => return Err(DecodeError::Tag(t)),
            };
            let reg = if tag == 22 { Some(r.reg()?) } else { None };
            Msg::GrantResp { op, result, reg }
        }
        12 => Msg::GrantRelease { slot: r.slot()?, grant: r.u64()? },
        13 => Msg::AddHolderReq { op: r.u64()?, key: r.key()?, version: r.u64()?, copy: r.u64()? },
        14 => Msg::AddHolderResp { op: r.u64()?, key: r.key()?, version: r.u64()?, copy: r.u64()?, ok: r.bool()? },
        15 => Msg::RemoveHolder { key: r.key()?, version: r.u64()?, copy: r.u64()? },
        16 => {
            let (round, part, parts) = (r.u64()?, r.u32()?, r.u32()?);
            if parts == 0 || part >= parts {
                return Err(DecodeError::Count(parts as u64));
            }
            let n = r.count(40, ANNOUNCE_ENTRIES_MAX)?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                entries.push((r.key()?, r.u64()?, r.u64()?));
            }
            Msg::Announce { round, part, parts, entries }
        }
        17 => Msg::AnnounceAck,
        18 => {
            let op = r.u64()?;
            let n = r.count(24, DECODE_ENTRIES_MAX)?;
            let mut keys = Vec::with_capacity(n);
            for _ in 0..n {
                keys.push(r.key()?);
            }
            Msg::LookupReq { op, keys }
        }
        19 => {
            let op = r.u64()?;
            let n = r.count(12, DECODE_ENTRIES_MAX)?;
            let mut found = Vec::with_capacity(n);
            for _ in 0..n {
                found.push((r.u64()?, r.u32()?));
            }
            Msg::LookupResp { op, found }
        }
        20 => Msg::LocateReq { op: r.u64()?, key: r.key()?, copy: r.u64()? },
        t => return Err(DecodeError::Tag(t)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_msg() -> Vec<Msg> {
        let key = BlockKey { ns: 0x1122_3344_5566_7788, key: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10 };
        let slot = SlotRef { slot: 7, generation: 99 };
        let meta = SlotMeta { key, version: (3 << 32) | 5, generation: 99, checksum: 0xdead_beef };
        vec![
            Msg::PublishReq { op: 1, key, checksum: 2, copy: 3 },
            Msg::PublishResp { op: 1, key, result: PublishResult::Stored(9), copy: 3 },
            Msg::PublishResp { op: 1, key, result: PublishResult::Busy, copy: 4 },
            Msg::PublishAbort { op: 5, key },
            Msg::Invalidate { key, version: 6, change: 7 },
            Msg::InvalidateAck { key, version: 6, change: 7 },
            Msg::InvalidateReq { op: 8, key },
            Msg::InvalidateResp { op: 8, key, ok: true },
            Msg::InvalidateResp { op: 8, key, ok: false },
            Msg::LocateReq { op: 9, key, copy: 0 },
            Msg::LocateReq { op: 9, key, copy: 17 },
            Msg::LocateResp { op: 9, key, result: LocateResult::Found { version: 10, holder: 3 }, reg: None },
            Msg::LocateResp {
                op: 9,
                key,
                result: LocateResult::Found { version: 10, holder: 3 },
                reg: Some(Registration { key, version: 10, copy: 17 }),
            },
            Msg::LocateResp { op: 9, key, result: LocateResult::Miss, reg: None },
            Msg::LocateResp { op: 9, key, result: LocateResult::Busy, reg: None },
            Msg::GrantReq { op: 11, key, version: 12 },
            Msg::GrantResp {
                op: 11,
                result: GrantResult::Granted { slot, meta, lease_us: 50_000, grant: 13 },
                reg: None,
            },
            Msg::GrantResp {
                op: 11,
                result: GrantResult::Granted { slot, meta, lease_us: 50_000, grant: 13 },
                reg: Some(Registration { key, version: meta.version, copy: 18 }),
            },
            Msg::GrantResp { op: 11, result: GrantResult::Refused, reg: None },
            Msg::GrantResp {
                op: 11,
                result: GrantResult::Refused,
                reg: Some(Registration { key, version: 5, copy: 19 }),
            },
            Msg::GrantRelease { slot, grant: 13 },
            Msg::AddHolderReq { op: 14, key, version: 15, copy: 16 },
            Msg::AddHolderResp { op: 14, key, version: 15, copy: 16, ok: true },
            Msg::RemoveHolder { key, version: 15, copy: 16 },
            Msg::Announce {
                round: 7,
                part: 1,
                parts: 3,
                entries: vec![(key, 1, 2), (BlockKey { ns: 1, key: 2 }, 3, 4)],
            },
            Msg::Announce { round: 1, part: 0, parts: 1, entries: vec![] },
            Msg::AnnounceAck,
            Msg::LookupReq { op: 18, keys: vec![key, BlockKey { ns: 3, key: 4 }] },
            Msg::LookupReq { op: 19, keys: vec![] },
            Msg::LookupResp { op: 18, found: vec![(0, 0), ((2 << 32) | 1, 5)] },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        let b = Batch { epoch: 42, incarnation: 0xfeed, msgs: every_msg() };
        let bytes = b.encode();
        assert_eq!(Batch::decode(&bytes), Ok(b));
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        let bytes = Batch { epoch: 1, incarnation: 2, msgs: every_msg() }.encode();
        for cut in 0..bytes.len() {
            assert!(Batch::decode(&bytes[..cut]).is_err(), "prefix of {cut} bytes decoded");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Batch::decode(&longer), Err(DecodeError::Trailing(1)));
    }

    #[test]
    fn bad_tags_versions_and_counts_are_refused() {
        let mut bytes = Batch { epoch: 1, incarnation: 2, msgs: vec![Msg::AnnounceAck] }.encode();
        let last = bytes.len() - 1;
        bytes[last] = 200;
        assert_eq!(Batch::decode(&bytes), Err(DecodeError::Tag(200)));
        bytes[0] = 9;
        assert_eq!(Batch::decode(&bytes), Err(DecodeError::Version(9)));
        // A count claiming more messages than there are bytes.
        let mut huge = Batch { epoch: 1, incarnation: 2, msgs: vec![] }.encode();
        huge[17..21].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Batch::decode(&huge), Err(DecodeError::Count(_))));
    }
}

//! What an operation's `user_data` says: which connection (slot and generation), which
//! kind of operation ([`Tag`]) and which of several (an index).

/// Operation kinds, in the low byte of `user_data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    Recv = 1,
    Send = 2,
    SpliceHeader = 3,
    SpliceIn = 4,
    SpliceOut = 5,
    FileRead = 6,
    FileWrite = 7,
    Writable = 9,
    PipeIn = 10,
    PipeOut = 11,
    SpliceTail = 12,
}

impl Tag {
    fn from_u8(v: u8) -> Option<Tag> {
        Some(match v {
            1 => Tag::Recv,
            2 => Tag::Send,
            3 => Tag::SpliceHeader,
            4 => Tag::SpliceIn,
            5 => Tag::SpliceOut,
            6 => Tag::FileRead,
            7 => Tag::FileWrite,
            9 => Tag::Writable,
            10 => Tag::PipeIn,
            11 => Tag::PipeOut,
            12 => Tag::SpliceTail,
            _ => return None,
        })
    }
}

/// Identifies a connection slot and the generation living in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnKey {
    pub slot: u32,
    pub generation: u16,
}

impl ConnKey {
    /// `user_data` for an operation of this connection: slot (24 bits), generation (16),
    /// index (16), tag (8). The tag byte is never 0xff or 0xfe, so no operation's
    /// `user_data` is one the driver keeps for its own (`u64::MAX`, `u64::MAX - 1`).
    pub fn op(self, tag: Tag, index: u16) -> u64 {
        (u64::from(self.slot) << 40)
            | (u64::from(self.generation) << 24)
            | (u64::from(index) << 8)
            | tag as u64
    }

    /// The key alone, for the mailbox.
    pub fn packed(self) -> u64 {
        (u64::from(self.slot) << 16) | u64::from(self.generation)
    }

    /// The connection, operation kind and index `user_data` names.
    pub fn unpack_op(user_data: u64) -> (ConnKey, Option<Tag>, u16) {
        let key = ConnKey {
            slot: (user_data >> 40) as u32,
            generation: (user_data >> 24) as u16,
        };
        (key, Tag::from_u8(user_data as u8), (user_data >> 8) as u16)
    }

    /// The key [`ConnKey::packed`] packed.
    pub fn unpack(packed: u64) -> ConnKey {
        ConnKey {
            slot: (packed >> 16) as u32,
            generation: packed as u16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        let key = ConnKey {
            slot: 0xabcdef,
            generation: 0x1234,
        };
        let (k, tag, index) = ConnKey::unpack_op(key.op(Tag::FileWrite, 0x5678));
        assert_eq!((k, tag, index), (key, Some(Tag::FileWrite), 0x5678));
        assert_eq!(ConnKey::unpack(key.packed()), key);
    }
}

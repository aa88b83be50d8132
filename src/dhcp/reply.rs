//! Encodes a decided reply with dhcproto, then applies what old PXE ROMs need of the
//! bytes: option 53 first and 54 second (dhcproto writes options in numeric order, and
//! some ROMs read the message type only from the first option), and at least the
//! 300 bytes of a BOOTP message (some ROMs drop shorter replies).

use std::net::Ipv4Addr;

use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode, UnknownOption};
use dhcproto::{Decodable, Decoder, Encodable};

use super::decide::Reply;
use super::wire::{Checked, HEADER_LEN, MAGIC_COOKIE, decode_tlvs, encode_tlvs};

/// The smallest BOOTP message (RFC 951); shorter replies are padded.
pub const MIN_REPLY: usize = 300;

/// The request's option 82 (relay agent information), decoded by dhcproto, to echo back.
pub fn relay_info(request: &[u8]) -> Option<DhcpOption> {
    let msg = Message::decode(&mut Decoder::new(request)).ok()?;
    msg.opts().get(OptionCode::RelayAgentInformation).cloned()
}

pub fn encode(
    req: &Checked,
    reply: &Reply,
    server_ip: Ipv4Addr,
    relay: Option<DhcpOption>,
) -> Vec<u8> {
    let mut msg = Message::new_with_id(
        req.xid,
        Ipv4Addr::UNSPECIFIED,
        reply.yiaddr,
        reply.siaddr,
        req.giaddr,
        &req.chaddr,
    );
    msg.set_opcode(Opcode::BootReply);
    msg.set_hops(req.hops);
    if req.flags_broadcast {
        msg.set_flags(Flags::default().set_broadcast());
    }
    if reply.message_type == super::decide::ACK && reply.yiaddr.is_unspecified() {
        // INFORM and 4011 ACKs: the client keeps its address.
        msg.set_ciaddr(req.ciaddr);
    }
    if let Some(file) = &reply.file
        && file.len() < 128
    {
        msg.set_fname_str(file);
    }
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(MessageType::from(
        reply.message_type,
    )));
    opts.insert(DhcpOption::ServerIdentifier(server_ip));
    for (code, value) in &reply.options {
        opts.insert(DhcpOption::Unknown(UnknownOption::new(
            OptionCode::from(*code),
            value.clone(),
        )));
    }
    if let Some(relay) = relay {
        opts.insert(relay);
    }
    let bytes = msg.to_vec().expect("a reply we built encodes");
    reorder(bytes)
}

/// Puts 53 and 54 first (keeping 82 last, as RFC 3046 wants), and pads to `MIN_REPLY`.
fn reorder(bytes: Vec<u8>) -> Vec<u8> {
    let start = HEADER_LEN + 4;
    let Some(options) = decode_tlvs(&bytes[start..]) else {
        return bytes;
    };
    let rank = |code: u8| match code {
        53 => 0,
        54 => 1,
        82 => 3,
        _ => 2,
    };
    let mut codes: Vec<u8> = options.keys().copied().collect();
    codes.sort_by_key(|c| (rank(*c), *c));
    let items: Vec<(u8, &[u8])> = codes.iter().map(|c| (*c, options[c].as_slice())).collect();
    let mut out = bytes[..HEADER_LEN].to_vec();
    out.extend_from_slice(&MAGIC_COOKIE);
    out.extend(encode_tlvs(&items));
    out.push(255);
    if out.len() < MIN_REPLY {
        out.resize(MIN_REPLY, 0);
    }
    out
}

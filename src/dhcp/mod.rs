//! DHCPv4: proxyDHCP (boot information next to the site's DHCP) and authoritative mode
//! (pools, reservations, leases; a pool per relayed segment in `pools`). `wire` checks untrusted bytes, `classify` names the
//! client, `decide` answers (pure), `chain` remembers forced iPXE chainloads (pure), `leases` keeps a pool
//! (pure), `reply` encodes, `directory` is what DHCP asks of the node service and what it tells
//! it (traits), `requested` witnesses proxy-mode clients' addresses (pure), `server` moves datagrams and persists leases in batches.
//! On the boot segment's IPv6 side, `ra` (pure) and `ra_server` answer router
//! solicitations so that iPXE stops waiting for an IPv6 router.

pub mod balance;
pub mod chain;
pub mod classify;
pub mod decide;
pub mod directory;
pub mod exercise;
pub mod leases;
pub mod metrics;
pub mod pools;
pub mod ra;
pub mod ra_server;
pub mod reply;
pub mod requested;
pub mod server;
pub mod wire;

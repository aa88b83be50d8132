//! Booting over HTTP: the iPXE scripts nodes get. Pure rendering; the routes that serve
//! them, with boot records and tokens, come with issue #5.

pub mod attest;
pub mod script;
pub mod service;

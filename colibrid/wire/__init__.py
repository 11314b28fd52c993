"""The wire protocol (docs/protocol.md): frames, typed requests and events.

msgpack and the standard library only: colibrictl, the gateway and the daemon all use it."""

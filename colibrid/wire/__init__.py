"""The wire protocol (docs/protocol.md), defined once: colibrictl, the gateway and the daemon all use it.

    frames.py    a frame: the length prefix and one msgpack map; how each end checks one it reads
    requests.py  typed requests: what a client builds (to_wire), what the daemon parses (parse_request)
    events.py    typed events: what the daemon builds (to_wire), what a client reads (event_from_wire)
    errors.py    what each end raises: the daemon's ProtocolError (a code), a client's ClientErrors
    client.py    the blocking client connection: hello, request ids, each request's events
    sampling_params.py  the sampling parameters an ask carries, valid by construction

msgpack and the standard library only (tests/test_layers.py checks it), so a client installs
without anything the daemon needs.
"""

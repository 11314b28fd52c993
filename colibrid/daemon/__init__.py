"""colibrid, the daemon: lifecycle, config, listener, server, connections, the engine loop."""

"""colibrid, the daemon: lifecycle, config, listener, server, connections, scheduler."""

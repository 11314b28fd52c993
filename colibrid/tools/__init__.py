"""Entry points that are not the daemon: the converter, the verify command, the demo pack,
the block-device probe."""

"""What the daemon asks of the machine: memory and hugepages, cgroup limits, core
affinity, systemd notification, logging."""

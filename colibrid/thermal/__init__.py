"""The thermal watch: which NVMe drive the experts live on, how hot it is, and how hard
Colibri may read from it.

    discovery     experts file -> st_dev -> block device -> namespace -> controller (sysfs)
    hwmon         the controller's temperatures and limits, read fresh from sysfs each poll
    smart_log     the 512-byte SMART / Health Information log page, parsed by offset
    smart_source  where that page comes from: the admin ioctl, nvme-cli, smartctl, or nowhere
    policy        temperature -> normal / throttled / critical, with hysteresis (pure)
    watch         the daemon's task: polls, rescans, follows udev events, applies the policy
                  to the expert cache, and says what it is doing (status, STATUS=)

Consumer NVMe drives throttle themselves around 70-80 °C and their read latency then jumps
from ~100 µs to milliseconds; streaming experts is exactly the sustained load that heats
them. Backing off first (fewer reads in flight, no prefetch) costs less than the drive's own
throttling does. docs/thermal.md is the user's view of all this.
"""

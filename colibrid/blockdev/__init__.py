"""Raw block devices for a pack's experts region: the superblock that marks a device as holding
one, what sysfs says about a device, the signatures of what a device already holds, the rules
that keep colibri-convert off devices it must not overwrite, and finding the device that
carries a given pack id. Standard library only: the udev probe imports this package, at every
block device that appears, and must start fast."""

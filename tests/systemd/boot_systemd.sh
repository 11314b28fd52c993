#!/bin/sh
# Boots a real systemd as PID 1 of the current (new) PID + mount namespace, fenced off from the
# host: run as `unshare --pid --fork --mount --mount-proc --propagation private sh boot_systemd.sh
# WORK_DIR [CARRIED_DIR...]`. Everything systemd could write at boot is a private mount FIRST:
#   /tmp /run /var/lib /var/tmp /var/log  private tmpfs (its tmpfiles pass would clean the host's /tmp)
#   /etc                                  an overlay whose upper half is in the private /run
#   /root                                 a tmpfs, mode 0755 (the host's is 0700: the colibri user
#                                         could not reach a pyenv Python or a virtualenv there)
# and it boots into a target that pulls in journald only: nothing of sysinit.target runs
# (no sysctl, tmpfiles, udev trigger, random seed, utmp), so the host's state is not touched.
# WORK_DIR is copied to /run/colibri-test before /tmp is hidden. Each CARRIED_DIR (the checkout,
# the virtualenv, the base Python's installation, when they live under a directory hidden here)
# is bind-mounted back at the same path on top of the private mounts.
set -eu
work_dir=$1
shift

mount -t tmpfs -o mode=0755 colibri-test-run /run
cp -a "$work_dir" /run/colibri-test
# Held under the private /run while their originals are covered, then moved back into place.
index=0
for dir in "$@"; do
    index=$((index + 1))
    mkdir -p "/run/colibri-carried/$index"
    mount --bind "$dir" "/run/colibri-carried/$index"
done
mount -t tmpfs -o mode=1777 colibri-test-tmp /tmp
for dir in /var/lib /var/tmp /var/log; do mount -t tmpfs -o mode=0755 colibri-test "$dir"; done
mount -t tmpfs -o mode=0755 colibri-test-root /root
index=0
for dir in "$@"; do
    index=$((index + 1))
    mkdir -p "$dir"
    mount --move "/run/colibri-carried/$index" "$dir"
done
mkdir -p /run/etc-upper /run/etc-work
mount -t overlay colibri-test-etc -o lowerdir=/etc,upperdir=/run/etc-upper,workdir=/run/etc-work /etc

# The boot target: journald and nothing else. sysinit.target is replaced by an empty one and
# every unit that asks to be pulled in by it is masked (runtime masks in /run).
units=/run/systemd/system
mkdir -p $units /run/systemd/journald.conf.d
printf '[Journal]\nStorage=volatile\n' > /run/systemd/journald.conf.d/colibri-test.conf
printf '[Unit]\nDescription=Colibri test boot\nWants=systemd-journald.socket systemd-journald.service\n' \
    > $units/colibri-test.target
printf '[Unit]\nDescription=System Initialization (empty for the Colibri test)\n' > $units/sysinit.target
for wants in /lib/systemd/system/sysinit.target.wants /etc/systemd/system/sysinit.target.wants; do
    for unit in "$wants"/*; do
        name=$(basename "$unit")
        case $name in systemd-journald.service|\*) continue ;; esac
        ln -sf /dev/null "$units/$name"
    done
done

# `container=` makes systemd keep to the cgroup it was started in, as under systemd-nspawn.
exec env container=colibri-test /lib/systemd/systemd --system --unit=colibri-test.target

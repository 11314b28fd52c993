#!/bin/sh
# Boots a real systemd as PID 1 of the current (new) PID + mount namespace, fenced off from the
# host: run as `unshare --pid --fork --mount --mount-proc --propagation private sh boot_systemd.sh
# WORK_DIR PYTHON_ROOT`. Everything systemd could write at boot is a private mount FIRST:
#   /tmp /run /var/lib /var/tmp /var/log  private tmpfs (its tmpfiles pass would clean the host's /tmp)
#   /etc                                  an overlay whose upper half is in the private /run
#   /root                                 a tmpfs holding only PYTHON_ROOT, if given (pyenv lives in
#                                         /root, mode 0700, where the colibri user cannot reach it)
# and it boots into a target that pulls in journald only: nothing of sysinit.target runs
# (no sysctl, tmpfiles, udev trigger, random seed, utmp), so the host's state is not touched.
# WORK_DIR is copied to /run/colibri-test before /tmp is hidden. SOURCE_DIR, if given, is the
# checkout colibrid is imported from when it lives under a directory hidden here (a CI clone in
# /tmp): it is bind-mounted back at the same path on top of the private mounts.
set -eu
work_dir=$1
python_root=$2
source_dir=${3:-}

mount -t tmpfs -o mode=0755 colibri-test-run /run
cp -a "$work_dir" /run/colibri-test
if [ -n "$source_dir" ]; then
    mkdir -p /run/colibri-source
    mount --bind "$source_dir" /run/colibri-source
fi
mount -t tmpfs -o mode=1777 colibri-test-tmp /tmp
for dir in /var/lib /var/tmp /var/log; do mount -t tmpfs -o mode=0755 colibri-test "$dir"; done
if [ -n "$source_dir" ]; then
    mkdir -p "$source_dir"
    mount --move /run/colibri-source "$source_dir"
fi
mkdir -p /run/etc-upper /run/etc-work
mount -t overlay colibri-test-etc -o lowerdir=/etc,upperdir=/run/etc-upper,workdir=/run/etc-work /etc
if [ -n "$python_root" ]; then  # empty when the tests' Python does not live under /root
    mkdir -p /run/python-root
    mount --bind "$python_root" /run/python-root
    mount -t tmpfs -o mode=0755 colibri-test-root /root
    mkdir -p "$python_root"
    mount --move /run/python-root "$python_root"
fi

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

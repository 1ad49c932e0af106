#!/bin/sh
# A btrfs file system with quotas for paths.homes_dir (docs/sandbox.md §Disk), made in a file:
#   deploy/homes-btrfs.sh IMAGE SIZE MOUNTPOINT      e.g. /srv/hermes-homes.img 50G /srv/hermes-homes
# Needs root, btrfs-progs and a kernel with btrfs (Debian: apt-get install btrfs-progs).
# It makes IMAGE (sparse, SIZE), formats it btrfs, mounts it on MOUNTPOINT through a loop
# device and enables quotas. Keep it across reboots with an /etc/fstab line such as
#   /srv/hermes-homes.img  /srv/hermes-homes  btrfs  loop,noatime  0 0
# (quotas stay enabled: they are recorded in the file system). A block device or LVM volume
# of its own is better than an image on a busy disk: then run only the mkfs, mount and quota
# lines on it. Then set paths.homes_dir: MOUNTPOINT and give the service's user the folder.
set -eu
[ $# -eq 3 ] || { echo "usage: $0 IMAGE SIZE MOUNTPOINT" >&2; exit 2; }
image=$1 size=$2 mnt=$3
[ -e "$image" ] && { echo "$image exists: not overwritten" >&2; exit 1; }
truncate -s "$size" "$image"
mkfs.btrfs -q "$image"
mkdir -p "$mnt"
mount -o loop,noatime "$image" "$mnt"
btrfs quota enable "$mnt"
echo "btrfs with quotas on $mnt (image $image, $size)"

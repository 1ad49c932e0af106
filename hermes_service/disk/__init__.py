"""The disk a sandbox may write (docs/sandbox.md §Disk).

* :mod:`.quota` — what a home may use, the free-space floor, ``/health``'s disk check;
* :mod:`.watch` — the watcher of live sandboxes: quotas, the floor, space no home shows;
* :mod:`.btrfs` — btrfs subvolumes with qgroup limits per home (btrfs-progs);
* :mod:`.image` — a file system of its own per home: an ext4 image, loop-mounted;
* :mod:`.use` — what a home takes on disk: walked, and held open unnamed by its processes.

It may import :mod:`hermes_service.errors`, :mod:`hermes_service.instance` and the sandbox (a
:class:`Launch` to watch, its settings); the sandbox never imports it.
"""

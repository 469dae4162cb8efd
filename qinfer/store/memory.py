"""How much memory this process can still take: the machine's available memory, capped by its cgroup's limit."""

from pathlib import Path


def available_memory(cgroups: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
                     ) -> int | None:
    """Bytes the kernel could hand out now without swapping, or None where unknown: the system's
    ``MemAvailable``, or less where a memory cgroup (a container's or a job's limit) leaves less room."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    room = _cgroup_room(cgroups, membership)
    return room if free is None else free if room is None else min(free, room)


def _cgroup_room(cgroups: Path, membership: Path) -> int | None:
    """The least room under a memory limit of this process's cgroup or any cgroup above it (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``): limit - usage + the inactive page cache it can reclaim."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base, files = cgroups, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = cgroups / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        # Inside a container the cgroup's own folder is usually mounted as the root, so its path is not there.
        here = base / path.strip("/") if (base / path.strip("/")).is_dir() else base
        while True:
            room = _room(here, *files)
            if room is not None:
                rooms.append(room)
            if here == base or base not in here.parents:
                break
            here = here.parent
    return min(rooms) if rooms else None


def _room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2^63
            return None
        usage = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
        return max(0, int(limit) - usage + int(stat.get(inactive_key, 0)))
    except (OSError, ValueError):
        return None

"""Start one container's process inside a private mount namespace (run under `unshare -m`).

Reads a JSON spec (argv, env, cwd, mounts), bind-mounts each volume at its mountPath
(read-only where the pod says so), then execs the container's command. Standard library
only: it runs before anything of the pod is importable.
"""

import json
import os
import subprocess
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # Hold every source open first: a mount over /tmp (an emptyDir) would otherwise hide
    # sources that live under /tmp. /proc/<pid>/fd/N still names them after that, as long as
    # mount(8) is told not to canonicalize it back into a path (which would then resolve
    # inside the new /tmp).
    held = [os.open(m["source"], os.O_PATH) for m in spec["mounts"]]
    for mount, fd in zip(spec["mounts"], held):
        source, target = f"/proc/{os.getpid()}/fd/{fd}", mount["target"]
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                open(target, "a").close()
        subprocess.run(["mount", "--no-canonicalize", "--bind", source, target], check=True)
        if mount.get("readOnly"):
            subprocess.run(["mount", "--no-canonicalize", "-o", "remount,bind,ro", target], check=True)
    for fd in held:
        os.close(fd)
    os.chdir(spec.get("cwd") or "/")
    try:
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as e:  # what a container runtime reports as "executable not found"
        print(f"exec {spec['argv'][0]!r}: {e}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()

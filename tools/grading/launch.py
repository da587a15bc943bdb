"""Start one student's kernel sealed in a bubblewrap sandbox (run by the grader, never by a student).

    python tools/grading/launch.py CONFIG.json CONNECTION_FILE     (the kernel spec's command)

Two steps, both the grader's own code:

1. outside: copy the connection file into the run's ``ipc/`` folder with the
   socket path the kernel sees inside (``/ipc/k``), then re-run this program in a
   private mount namespace (``unshare --mount``; for a grader that is not root,
   also a user namespace);
2. inside that namespace (``--inner``): mount a ``tmpfs`` of the disk limit's size
   for everything the student may write, bind what the kernel reads to a staging
   folder it can reach (the Python installation may sit in a home folder the
   sandbox's uid cannot enter), set the resource limits, and ``exec`` bwrap as
   the sandbox's unprivileged uid. The process stays the one the grader
   started, so killing it kills the sandbox (``--die-with-parent``) and with it
   its PID namespace: every process a notebook started.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grading.sandbox import BOOK, IPC, WORKDIR, _lib_links  # noqa: E402


def outer(config_path: str, connection_file: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    scratch = Path(cfg["scratch"])
    info = json.loads(Path(connection_file).read_text())
    info["ip"] = f"{IPC}/k"
    ipc = scratch / "ipc"
    (ipc / "kernel.json").write_text(json.dumps(info))
    os.chown(ipc / "kernel.json", cfg["uid"], cfg["gid"])
    os.chmod(ipc / "kernel.json", 0o600)
    os.chown(ipc, cfg["uid"], cfg["gid"])
    if cfg["as_root"]:
        prefix = ["unshare", "--mount", "--propagation", "private"]
    else:
        prefix = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    os.execvp(prefix[0], [*prefix, sys.executable, __file__, "--inner", config_path])


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL)


def inner(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    scratch = Path(cfg["scratch"])
    uid, gid = cfg["uid"], cfg["gid"]
    limits = cfg["limits"]
    w = scratch / "w"
    w.mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={int(limits['disk_mb'])}m,mode=0755,nosuid,nodev", "tmpfs", str(w))
    for name in ("home", "exercises", "tmp"):
        (w / name).mkdir()
        os.chown(w / name, uid, gid)
    os.chmod(w / "tmp", 0o1777)
    files = scratch / "files"
    if files.is_dir():
        for f in files.iterdir():
            if f.is_file() and not f.is_symlink():
                shutil.copyfile(f, w / "exercises" / f.name)
                os.chown(w / "exercises" / f.name, uid, gid)
    stage = scratch / "stage"
    stage.mkdir(exist_ok=True)
    binds: list[str] = []
    for i, (host, inside) in enumerate([*cfg["read_only"], (cfg["checks_edition"], cfg["checks_target"])]):
        point = stage / str(i)
        point.mkdir(exist_ok=True)
        _mount("--bind", host, str(point))
        binds += ["--ro-bind", str(point), inside]
    etc = w / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(f"root:x:0:0::/:/bin/false\nstudent:x:{uid}:{gid}::{BOOK}/home:/bin/sh\n")
    (etc / "group").write_text(f"root:x:0:\nstudent:x:{gid}:\n")
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--hostname", "grading", "--ro-bind", "/usr", "/usr", *_lib_links(),
            "--dir", "/etc", "--ro-bind", str(etc / "passwd"), "/etc/passwd",
            "--ro-bind", str(etc / "group"), "/etc/group"]
    for name in ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf"):
        if os.path.exists(name):
            args += ["--ro-bind", name, name]
    # /dev is a tmpfs that bwrap makes writable by the sandbox's uid and sizes at the host's
    # default: read-only, so that a notebook cannot fill memory there (/dev/null still takes writes)
    # The private /tmp first, then the read-only trees on top of it: the repository (and so the package
    # and the virtual environment) may itself live under /tmp, as a CI clone often does.
    args += ["--bind", str(w / "tmp"), "/tmp", *binds, "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--bind", str(w / "home"), f"{BOOK}/home", "--bind", str(w / "exercises"), WORKDIR,
             "--bind", str(scratch / "ipc"), IPC,
             "--chdir", WORKDIR, "--uid", str(uid), "--gid", str(gid)]
    for key, value in cfg["env"].items():
        args += ["--setenv", key, value]
    args += ["--", cfg["python"], "-m", "ipykernel_launcher", "-f", f"{IPC}/kernel.json"]

    def limit(kind, value):
        resource.setrlimit(kind, (value, value))

    if limits["memory_mb"]:
        limit(resource.RLIMIT_AS, int(limits["memory_mb"]) * 1024 * 1024)
    limit(resource.RLIMIT_CPU, int(limits["cpu_seconds"]))
    limit(resource.RLIMIT_FSIZE, int(limits["disk_mb"]) * 1024 * 1024)
    limit(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    limit(resource.RLIMIT_CORE, 0)
    if cfg["as_root"]:
        # per uid: each job slot has its own, so this counts this sandbox's processes and threads only
        limit(resource.RLIMIT_NPROC, int(limits["processes"]))
        args = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", *args]
    os.execvp(args[0], args)


if __name__ == "__main__":
    if sys.argv[1] == "--inner":
        inner(sys.argv[2])
    else:
        outer(sys.argv[1], sys.argv[2])

"""The sealed run of one submission: a bubblewrap sandbox around the student's kernel.

Every submitted notebook runs in a kernel inside its own sandbox, built with
bubblewrap (``bwrap``, Debian package ``bubblewrap``; ``bash tools/system_deps.sh
bwrap`` installs it, and ``make grade`` runs that itself). Inside:

- the kernel runs as an unprivileged user (when the grader runs as root, each
  job slot has a uid of its own, :data:`UID_BASE` + slot, so the process limit
  counts one sandbox only), in its own user, PID, network, IPC, UTS and cgroup
  namespaces (``--unshare-all``): nothing started in it outlives it, it has no
  network interface but loopback, and it sees no process of the machine;
- its own session (``--new-session``: no access to the grader's terminal), an
  empty environment but for a few variables the grader sets (``--clearenv``);
- the system (``/usr``), the Python installation, the virtual environment and
  the ``fixedstate`` package are mounted read-only, each at its own path and
  nothing around it: the repository, ``solutions/``, the other submissions and
  the output folder are not in the sandbox at all, so ``fixedstate.__file__``
  leads nowhere but to the package;
- the package's ``checks`` are replaced by a grading edition: the self-checks
  answer "off while grading" and the stored numeric answers are removed (the
  grader, outside, holds what decides a grade: :mod:`grading.hidden`);
- the only writable places are the student's home (``/book/exercises`` is the
  working directory, with the files handed in next to the notebook) and
  ``/tmp``, both on one ``tmpfs`` of the sandbox's own with a size limit (the
  disk limit), private to this run;
- limits the kernel enforces: address space (memory), processes, CPU seconds
  per process, size of one file, open files; and the grader kills the whole
  sandbox at its wall-clock limit.

The kernel talks to the grader over Unix sockets in a directory of the run
(``/ipc`` inside); once the kernel has bound its sockets, the grader takes that
directory back (root-owned, read-only to the sandbox), so the student's code has
no writable place on the machine's disk.

This module builds the command line; :mod:`grading.launch` is the small trusted
program that sets the mounts and limits up and starts ``bwrap``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Limits", "Sandbox", "probe_sandbox", "SETUP_COMMAND", "UID_BASE", "grading_edition"]

#: The one command that sets the sandbox up on a fresh Debian-like machine.
SETUP_COMMAND = "bash tools/system_deps.sh bwrap"
#: Sandboxed kernels run as uid UID_BASE + slot (when the grader runs as root).
UID_BASE = 61000
#: Where the book's tree is rebuilt inside a sandbox: the notebook runs in /book/exercises.
BOOK = "/book"
WORKDIR = f"{BOOK}/exercises"
IPC = "/ipc"

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass
class Limits:
    memory_mb: int = 4096          # address space of each process (0: none)
    processes: int = 256           # processes and threads of the sandbox's user
    cpu_seconds: int = 600         # CPU seconds of each process
    disk_mb: int = 256             # the writable tmpfs (home, work dir, /tmp), and the largest file
    open_files: int = 512


@dataclass
class Sandbox:
    """How kernels are sealed: ``kind`` is ``bwrap`` or ``none`` (only with ``--no-sandbox``)."""
    kind: str
    description: str
    python: str = sys.executable
    as_root: bool = False
    problems: list[str] = field(default_factory=list)


def _bwrap_works() -> str:
    """An empty string when bwrap can build a sandbox here, else what went wrong."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not installed"
    try:
        r = subprocess.run([bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
                            "--proc", "/proc", "--dev", "/dev", *_lib_links(), "/usr/bin/true"],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap did not run: {type(exc).__name__}"
    if r.returncode != 0:
        return "bwrap cannot create namespaces here: " + r.stderr.decode(errors="replace").strip()[:300]
    return ""


def _lib_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin as on the machine (links into /usr on a merged-/usr system)."""
    out = []
    for name in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(name):
            out += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            out += ["--ro-bind", name, name]
    return out


def probe_sandbox(python: str = sys.executable, allow_none: bool = False) -> Sandbox:
    """The bubblewrap sandbox if it works here; else raise SystemExit naming the setup command
    (or, with ``allow_none``, a run without a sandbox, said loudly)."""
    if sys.platform.startswith("linux"):
        problem = _bwrap_works()
        if not problem and shutil.which("unshare"):
            root = os.geteuid() == 0
            who = (f"each job slot its own unprivileged uid ({UID_BASE} + slot)" if root
                   else "your own uid, in a user namespace")
            return Sandbox("bwrap", "each notebook sealed in a bubblewrap sandbox (own PID, network, user and IPC "
                                    f"namespaces, read-only system and package, private tmpfs; {who})",
                           python, root)
        problem = problem or "unshare (util-linux) is not installed"
    else:
        problem = f"bubblewrap needs Linux, and this is {sys.platform}"
    if allow_none:
        return Sandbox("none", f"NO SANDBOX ({problem}): each student's code runs with your account's rights",
                       python, False, [problem])
    raise SystemExit(f"grade: the sandbox that seals each notebook is not available: {problem}.\n"
                     f"Set it up with:\n    {SETUP_COMMAND}\n"
                     "(make grade runs it itself; --no-sandbox grades without one, which lets every "
                     "student's code do anything your account can)")


# --------------------------------------------------------------------------- the grading edition of checks

GRADING_EDITION = '''

# ---------------------------------------------------------------------------------------------------
# Grading edition (tools/grading/sandbox.py): inside the sandbox the self-checks are off and the stored
# answers are gone. What decides a grade is held by the grader, outside the student's kernel.
def _grading_off(*args, **kwargs):
    from fixedstate.checks._core import CheckResult
    return CheckResult("", False, "self-checks are off while grading: the grader runs its own cases")


for _name in [_n for _n in list(globals()) if _n.startswith("check_") and callable(globals()[_n])]:
    globals()[_name] = _grading_off
if isinstance(globals().get("ANSWERS"), dict):
    ANSWERS = {_k: {_kk: _vv for _kk, _vv in _v.items() if _kk in ("what", "unit", "tolerance", "relative")}
               for _k, _v in ANSWERS.items()}
'''


def grading_edition(dest: Path, package: Path | None = None) -> Path:
    """Write the grading edition of ``fixedstate/checks`` into ``dest`` (world-readable); return it."""
    package = package or _package_dir()
    src = package / "checks"
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name not in ("__init__.py", "_core.py"):
            text += GRADING_EDITION
        (dest / path.name).write_text(text, encoding="utf-8")
        os.chmod(dest / path.name, 0o644)
    os.chmod(dest, 0o755)
    return dest


def _package_dir() -> Path:
    import fixedstate
    return Path(fixedstate.__file__).resolve().parent


# --------------------------------------------------------------------------- the command line

def _read_only_paths(python: str) -> list[tuple[str, str]]:
    """(host path, sandbox path) of what the kernel needs read-only, beyond /usr."""
    prefix = Path(sys.prefix).resolve()
    base = Path(sys.base_prefix).resolve()
    exe = Path(python)
    pairs = []
    for p in {str(base), str(prefix)}:
        pairs.append((p, p))
    real = exe.resolve()
    if not any(str(real).startswith(p + os.sep) for p, _ in pairs) and not str(real).startswith("/usr/"):
        pairs.append((str(real.parent), str(real.parent)))
    package = _package_dir()
    pairs.append((str(package), str(package)))
    results = ROOT / "results"
    if results.is_dir():
        pairs.append((str(results), f"{BOOK}/results"))
    # the stdlib and site-packages, if they live outside both prefixes
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and not any(str(Path(p).resolve()).startswith(h + os.sep) or str(Path(p).resolve()) == h
                         for h, _ in pairs) and not p.startswith("/usr/"):
            pairs.append((str(Path(p).resolve()), str(Path(p).resolve())))
    return pairs


@dataclass
class LaunchConfig:
    """What :mod:`grading.launch` needs to start one sealed kernel (written as JSON by the grader)."""
    scratch: str                    # the run's folder (root-owned): ipc/, stage/, files/
    uid: int
    gid: int
    as_root: bool
    python: str
    read_only: list[tuple[str, str]]
    checks_edition: str
    checks_target: str              # where the package's checks/ are, inside the sandbox
    limits: dict
    env: dict


def launch_config(scratch: Path, slot: int, sandbox: Sandbox, limits: Limits, edition: Path) -> LaunchConfig:
    uid = UID_BASE + slot if sandbox.as_root else os.getuid()
    gid = UID_BASE + slot if sandbox.as_root else os.getgid()
    env = {"HOME": f"{BOOK}/home", "PATH": f"{Path(sys.prefix)}/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "MPLBACKEND": "Agg", "MPLCONFIGDIR": "/tmp/mpl", "IPYTHONDIR": f"{BOOK}/home/.ipython",
           "JUPYTER_RUNTIME_DIR": "/tmp/jupyter", "PYTHONDONTWRITEBYTECODE": "1", "FIXEDSTATE_GRADING": "1",
           "PYDEVD_DISABLE_FILE_VALIDATION": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "VIRTUAL_ENV": str(Path(sys.prefix))}
    for key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "FIXEDSTATE_FIGURES", "FIXEDSTATE_TIMING"):
        if key in os.environ:                  # numerics (see CONTRIBUTING.md), never secrets
            env[key] = os.environ[key]
    return LaunchConfig(scratch=str(scratch), uid=uid, gid=gid, as_root=sandbox.as_root, python=sandbox.python,
                        read_only=_read_only_paths(sandbox.python), checks_edition=str(edition),
                        checks_target=str(_package_dir() / "checks"), limits=asdict(limits), env=env)


def write_launch_config(cfg: LaunchConfig, path: Path) -> Path:
    path.write_text(json.dumps(asdict(cfg), indent=1))
    os.chmod(path, 0o600)
    return path


def kernel_argv(config_path: Path) -> list[str]:
    """The kernel spec's command: the trusted launcher, which then starts bwrap."""
    return [sys.executable, str(HERE / "launch.py"), str(config_path), "{connection_file}"]


#: How many job slots (and uids) the machine's grader runs may use at once, together.
MAX_SLOTS = 256


def claim_slots(n: int) -> tuple[list[int], list]:
    """Claim ``n`` job slots no other grader run on this machine holds (a lock file each, held open
    for the run): two runs at once then never share a sandbox uid, whose processes the grader kills
    between notebooks. Returns the slots and the open lock files (close them to release)."""
    import fcntl
    folder = Path(tempfile.gettempdir()) / f"fsgrade-slots-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    slots, handles = [], []
    for slot in range(MAX_SLOTS):
        if len(slots) == n:
            break
        handle = open(folder / f"{slot}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        slots.append(slot)
        handles.append(handle)
    if not slots:
        raise RuntimeError(f"all {MAX_SLOTS} grading slots of this machine are in use")
    return slots, handles

"""Run one submitted notebook in a sealed kernel; send it the grader's hidden cases.

The kernel is an ordinary IPython kernel of the grader's own Python, driven
through nbclient, started inside a bubblewrap sandbox (:mod:`grading.sandbox`,
:mod:`grading.launch`): its own user, PID and network namespaces, a read-only
system and package, a private tmpfs, kernel-enforced limits. It talks to the
grader over Unix sockets in the run's ``ipc/`` folder, which the grader takes
back once the kernel is up.

The student's code cells run one by one, each with a time limit; a cell that
raises or is interrupted does not stop the rest (as with nbgrader's autograde).
Their outputs are thrown away, but for the grader's own messages (a display
message of :data:`GRADE_MIME` carrying the run's nonce), which are plain data
judged outside (:mod:`grading.judge`).

A cell or check that outlives its time limit is interrupted; one that cannot
be interrupted, or that kills the kernel (a segfault, ``os._exit``, the memory
limit), is recorded, and the notebook is replayed in a new kernel without it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from .judge import exception_name
from .sandbox import UID_BASE, Limits, Sandbox, kernel_argv, launch_config, probe_sandbox, write_launch_config

__all__ = ["GRADE_MIME", "Outcome", "KernelSession", "Sandbox", "probe_sandbox", "Limits"]

GRADE_MIME = "application/x-fixedstate-grade+json"
#: Seconds an interrupted cell gets to stop before its kernel is killed.
GRACE = 3.0


@dataclass
class Outcome:
    status: str                      # ok | error | timeout | died | killed | unstarted
    elapsed: float
    error: str = ""                  # "ValueError: ..." for a cell that raised
    grades: list[dict] = field(default_factory=list)


class _Client(NotebookClient):
    """An nbclient client that keeps only error outputs and the grader's own messages."""

    def output(self, outs, msg, display_id, cell_index):
        kind = msg["msg_type"]
        if kind == "error" or (kind == "display_data" and GRADE_MIME in msg["content"].get("data", {})):
            return super().output(outs, msg, display_id, cell_index)
        return None


def _kernel_specs(root: Path, argv: list[str]) -> KernelSpecManager:
    spec_dir = root / "kernels" / "fixedstate-grade"
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "fixedstate grader", "language": "python",
        # a signal would reach the launcher, not the kernel in its own session: ask the kernel itself
        "interrupt_mode": "message", "metadata": {"debugger": False}}))
    return KernelSpecManager(kernel_dirs=[str(root / "kernels")], ensure_native_kernel=False)


def _short_error(out) -> str:
    """The exception's type name only (a builtin's, else "the notebook's own class"): never its text,
    which the student's code chose and which may carry the environment or a file's content."""
    return exception_name(out.get("ename"))


class KernelSession:
    """One sealed kernel for one notebook: start it, run code with time limits, kill it if need be.

    ``scratch`` is the run's root-owned folder: ``files/`` (the files handed in
    next to the notebook), ``ipc/`` (the kernel's sockets), ``kernels/`` (the spec).
    """

    def __init__(self, *, scratch: Path, sandbox: Sandbox, limits: Limits, slot: int, edition: Path | None,
                 nonce: str, python: str = sys.executable):
        self.nonce = nonce
        self.scratch, self.sandbox, self.limits, self.slot = scratch, sandbox, limits, slot
        self.edition, self.python = edition, python
        self.km: AsyncKernelManager | None = None
        self.client: _Client | None = None
        self.counter = 0

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "OPENBLAS_CORETYPE",
                                                             "OPENBLAS_L2_SIZE", "SYSTEMROOT", "TMPDIR")}
        env.update(MPLBACKEND="Agg", PYDEVD_DISABLE_FILE_VALIDATION="1", FIXEDSTATE_GRADING="1",
                   IPYTHONDIR=str(self.scratch / "ipython"), PYTHONDONTWRITEBYTECODE="1",
                   HOME=str(self.scratch / "home"))
        return env

    async def start(self, timeout: float = 60.0) -> None:
        await self.reap()                 # nothing of an earlier notebook of this slot may still count
        run = Path(tempfile.mkdtemp(prefix="k", dir=self.scratch))     # a fresh one for every (re)start
        self.counter += 1
        ipc = run / "ipc"
        ipc.mkdir()
        os.chmod(run, 0o755)
        if self.sandbox.kind == "bwrap":
            cfg = launch_config(run, self.slot, self.sandbox, self.limits, self.edition)
            cfg.scratch = str(run)
            files = self.scratch / "files"
            if files.is_dir():
                (run / "files").symlink_to(files)
            argv = kernel_argv(write_launch_config(cfg, run / "launch.json"))
            cwd = str(run)
        else:
            argv = [self.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            work = self.scratch / "work"
            work.mkdir(exist_ok=True)
            cwd = str(work)
        ksm = _kernel_specs(run, argv)
        self.km = AsyncKernelManager(kernel_name="fixedstate-grade", kernel_spec_manager=ksm, transport="ipc",
                                     ip=str(ipc / "k"))
        self.km.connection_file = str(run / "connection.json")
        self.client = _Client(nbformat.v4.new_notebook(), km=self.km, kernel_name="fixedstate-grade",
                              timeout=30, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
                              iopub_timeout=4, raise_on_iopub_timeout=False, startup_timeout=int(timeout),
                              resources={"metadata": {"path": cwd}})
        await asyncio.wait_for(self.client.async_start_new_kernel(
            cwd=cwd, env=self._env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), timeout)
        await asyncio.wait_for(self.client.async_start_new_kernel_client(), timeout)
        if self.sandbox.kind == "bwrap":
            # the sockets are bound: take the folder back, so the sandbox has no writable place on disk
            if self.sandbox.as_root:
                os.chown(ipc, 0, 0)
            os.chmod(ipc, 0o555)

    async def execute(self, source: str, index: int, timeout: float) -> Outcome:
        """Run ``source``; interrupt it after ``timeout`` s, kill the kernel if it does not stop."""
        assert self.client is not None
        cell = nbformat.v4.new_code_cell(source)
        self.client.nb.cells = [cell]          # nbclient stores the executed cell back at its index
        limit = max(1, math.ceil(timeout))
        self.client.timeout = limit
        t0 = monotonic()
        task = asyncio.ensure_future(self.client.async_execute_cell(cell, 0, store_history=False))
        done, _ = await asyncio.wait({task}, timeout=limit + GRACE)
        if not done:                    # interrupted at `limit` and still running: kill it
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - nbclient turns the cancellation into DeadKernelError
                pass
            await self.kill()
            return Outcome("killed", monotonic() - t0)
        try:
            task.result()
        except CellTimeoutError:
            await self.kill()
            return Outcome("killed", monotonic() - t0)
        except DeadKernelError:
            await self.kill()
            return Outcome("died", monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - a broken channel is a dead kernel to us
            await self.kill()
            return Outcome("died", monotonic() - t0, error=f"{type(exc).__name__}: {exc}")
        elapsed = monotonic() - t0
        grades = []
        errors = []
        for out in cell.outputs:
            if out.get("output_type") == "error":
                errors.append(out)
            elif out.get("output_type") == "display_data":
                data = out.get("data", {}).get(GRADE_MIME)
                if isinstance(data, str):
                    try:
                        data = json.loads(data)
                    except ValueError:
                        data = None
                if isinstance(data, dict) and data.get("nonce") == self.nonce:
                    grades.append(data)
        if not await self.alive():
            await self.kill()
            return Outcome("died", elapsed)
        if errors:
            last = errors[-1]
            if last.get("ename") == "KeyboardInterrupt" and elapsed >= limit - 0.5:
                return Outcome("timeout", elapsed, error=_short_error(last), grades=grades)
            return Outcome("error", elapsed, error=_short_error(errors[0]), grades=grades)
        if grades and grades[-1].get("status") == "interrupted" and elapsed >= limit - 0.5:
            return Outcome("timeout", elapsed, grades=grades)
        return Outcome("ok", elapsed, grades=grades)

    async def alive(self) -> bool:
        try:
            return bool(self.km is not None and await self.km.is_alive())
        except Exception:  # noqa: BLE001
            return False

    async def kill(self) -> None:
        """Stop the kernel and everything it started, now."""
        km, client = self.km, self.client
        self.km = self.client = None
        if client is not None and client.kc is not None:
            try:
                client.kc.stop_channels()
            except Exception:  # noqa: BLE001
                pass
        if km is None:
            return
        pgid = getattr(getattr(km, "provisioner", None), "pgid", None)
        try:
            await asyncio.wait_for(km.shutdown_kernel(now=True), 15)
        except Exception:  # noqa: BLE001
            pass
        if pgid and hasattr(os, "killpg"):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
        await self.reap()

    async def reap(self, wait: float = 20.0) -> None:
        """As root, the slot's uid belongs to its sandbox alone: kill whatever still runs under it and wait
        until nothing does (the PID namespace dies with its first process, but its processes take a
        moment to go, and the next notebook of this slot must not count them against its limit)."""
        if self.sandbox.kind != "bwrap" or not self.sandbox.as_root:
            return
        uid = UID_BASE + self.slot
        t0 = monotonic()
        while True:
            pids = processes_of(uid)
            if not pids or monotonic() - t0 > wait:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.kill()


def processes_of(uid: int) -> list[int]:
    """The ids of the processes whose real uid is ``uid`` (zombies included)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid == uid:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def scratch_dir() -> Path:
    """A short temporary path (Unix socket paths must stay under ~100 characters)."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    path = Path(tempfile.mkdtemp(prefix="fsgrade-", dir=base))
    os.chmod(path, 0o755)          # root-owned; the sandbox's uid only traverses it to its own binds
    return path

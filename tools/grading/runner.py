"""Run one submitted notebook in a fresh kernel, then grade it in that kernel.

The kernel is an ordinary IPython kernel of the grader's own Python (so it
imports the same ``fixedstate``), driven through nbclient. Before the student's
code runs, a preamble installs a small helper module in the kernel: it blocks
network connections from Python, caps the kernel's memory, and snapshots the
``fixedstate`` modules. The student's code cells then run one by one, each
with a time limit; a cell that raises or is interrupted does not stop the
rest (as with nbgrader's autograde). Their outputs are thrown away.

Then the grader calls the package's checks itself, in the same kernel, one
call per check: the call is the one the book's exercise notebook makes, with
the check function taken from the ``fixedstate.checks`` module (restored to
its snapshot, so a student's ``check_answer = ...`` or a patched module does not
matter) and the arguments evaluated in the student's namespace. The result
comes back as a display message tagged with a random token.

A cell or check that outlives its time limit is interrupted; one that cannot
be interrupted, or that kills the kernel (a segfault, ``os._exit``, the memory
limit), is recorded, and the notebook is replayed in a new kernel without it.

Network: when ``unshare`` can give the kernel a network namespace of its own
(Linux, user namespaces allowed), the kernel runs in one with no interface at
all and talks to the grader over Unix sockets; otherwise only the Python-level
block applies (``socket`` connections fail; a subprocess could still reach the
network).
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

__all__ = ["GRADE_MIME", "Outcome", "KernelSession", "Sandbox", "probe_sandbox"]

GRADE_MIME = "application/x-fixedstate-grade+json"
HELPER_MODULE = "_fixedstate_grader"
#: Seconds an interrupted cell gets to stop before its kernel is killed.
GRACE = 3.0

#: The helper installed in the kernel (as the module ``_fixedstate_grader``).
KERNEL_HELPER = r'''
import copy, importlib, socket, sys

_MISSING = object()
_state = {"nonce": "", "snapshot": [], "publish": None}


def _blocked(*args, **kwargs):
    raise OSError("network access is disabled while grading")


def setup(nonce, memory_mb, modules):
    from IPython.display import publish_display_data
    _state["nonce"] = nonce
    _state["publish"] = publish_display_data
    if memory_mb:
        try:
            import resource
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = int(memory_mb) * 1024 * 1024
            if hard != resource.RLIM_INFINITY:
                limit = min(limit, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        except Exception:
            pass
    for name in ("connect", "connect_ex", "sendto"):
        setattr(socket.socket, name, _blocked)
    socket.create_connection = _blocked
    socket.getaddrinfo = _blocked
    for module in ["fixedstate.checks._core", *modules]:
        importlib.import_module(module)
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == "fixedstate" or name.startswith("fixedstate.")):
            continue
        attrs = dict(vars(module))
        saved = {}
        if name.startswith("fixedstate.checks"):
            for key, value in attrs.items():
                if isinstance(value, dict) and not key.startswith("__"):
                    try:
                        saved[key] = copy.deepcopy(value)
                    except Exception:
                        pass
        _state["snapshot"].append((name, module, attrs, saved))


def _restore():
    for name, module, attrs, saved in _state["snapshot"]:
        sys.modules[name] = module
        current = vars(module)
        for key, value in attrs.items():
            if current.get(key, _MISSING) is not value:
                current[key] = value
        for key, value in saved.items():
            attrs[key].clear()
            attrs[key].update(copy.deepcopy(value))


def _emit(out):
    out["nonce"] = _state["nonce"]
    _state["publish"]({"application/x-fixedstate-grade+json": out, "text/plain": "graded"})


def run(module, function, thunk):
    out = {}
    try:
        _restore()
        check = getattr(sys.modules[module], function)
        try:
            args, kwargs = thunk()
        except NameError as exc:
            out = {"status": "undefined", "name": getattr(exc, "name", None) or "", "message": str(exc)}
        else:
            result = check(*args, **kwargs)
            result_type = sys.modules["fixedstate.checks._core"].CheckResult
            if not isinstance(result, result_type):
                raise TypeError(f"the check returned {type(result).__name__}, not a CheckResult")
            out = {"status": "ok", "passed": result.passed is True, "message": str(result.message),
                   "details": [str(d) for d in result.details], "exercise": str(result.exercise)}
    except KeyboardInterrupt:
        out = {"status": "interrupted"}
    except BaseException as exc:
        out = {"status": "error", "message": f"{type(exc).__name__}: {exc}"[:2000]}
    _emit(out)
'''

PREAMBLE = '''\
def __fixedstate_grader_install(source, nonce, memory_mb, modules):
    import sys, types
    module = types.ModuleType("{helper}")
    exec(compile(source, "<fixedstate grader>", "exec"), module.__dict__)
    sys.modules["{helper}"] = module
    module.setup(nonce, memory_mb, modules)
__fixedstate_grader_install({source!r}, {nonce!r}, {memory!r}, {modules!r})
del __fixedstate_grader_install
'''


@dataclass
class Sandbox:
    """How kernels are isolated from the network: a command prefix and the transport."""
    prefix: list[str]
    transport: str
    description: str


def probe_sandbox(python: str = sys.executable) -> Sandbox:
    """Use ``unshare`` for a network namespace if this machine allows it, else the Python-level block."""
    if sys.platform.startswith("linux") and shutil.which("unshare"):
        variants = [["unshare", "-n"], ["unshare", "-rn"]] if os.geteuid() == 0 else [["unshare", "-rn"]]
        for prefix in variants:
            try:
                ok = subprocess.run([*prefix, python, "-c", "import socket"], capture_output=True,
                                    timeout=30).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            if ok:
                return Sandbox(prefix, "ipc", f"no network: each kernel runs in its own network namespace "
                                              f"(`{' '.join(prefix)}`), and Python's socket connections "
                                              "are blocked too")
    return Sandbox([], "tcp", "network blocked in Python only (socket connections fail); `unshare` is not "
                              "available here, so a subprocess started by a notebook could still reach the network")


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


def _kernel_specs(root: Path, sandbox: Sandbox, python: str) -> KernelSpecManager:
    spec_dir = root / "kernels" / "fixedstate-grade"
    spec_dir.mkdir(parents=True, exist_ok=True)
    argv = [*sandbox.prefix, python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "fixedstate grader", "language": "python",
        "metadata": {"debugger": False}}))
    return KernelSpecManager(kernel_dirs=[str(root / "kernels")], ensure_native_kernel=False)


def _short_error(out) -> str:
    text = f"{out.get('ename', 'Error')}: {out.get('evalue', '')}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


class KernelSession:
    """One kernel for one notebook: start it, run code with time limits, kill it if need be."""

    def __init__(self, *, scratch: Path, workdir: Path, sandbox: Sandbox, nonce: str, memory_mb: int,
                 modules: list[str], python: str = sys.executable):
        self.scratch, self.workdir, self.sandbox = scratch, workdir, sandbox
        self.nonce, self.memory_mb, self.modules, self.python = nonce, memory_mb, modules, python
        self.km: AsyncKernelManager | None = None
        self.client: _Client | None = None
        self.counter = 0

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(MPLBACKEND="Agg", PYDEVD_DISABLE_FILE_VALIDATION="1", FIXEDSTATE_GRADING="1",
                   IPYTHONDIR=str(self.scratch / "ipython"), PYTHONDONTWRITEBYTECODE="1")
        for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
            env.pop(key, None)
        return env

    async def start(self, timeout: float = 60.0) -> None:
        ksm = _kernel_specs(self.scratch, self.sandbox, self.python)
        kwargs = {}
        if self.sandbox.transport == "ipc":
            kwargs = dict(transport="ipc", ip=str(self.workdir.parent / f"k{self.counter}"))
        self.counter += 1
        self.km = AsyncKernelManager(kernel_name="fixedstate-grade", kernel_spec_manager=ksm, **kwargs)
        self.client = _Client(nbformat.v4.new_notebook(), km=self.km, kernel_name="fixedstate-grade",
                              timeout=30, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
                              iopub_timeout=4, raise_on_iopub_timeout=False, startup_timeout=int(timeout),
                              resources={"metadata": {"path": str(self.workdir)}})
        await asyncio.wait_for(self.client.async_start_new_kernel(
            cwd=str(self.workdir), env=self._env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            timeout)
        await asyncio.wait_for(self.client.async_start_new_kernel_client(), timeout)
        preamble = PREAMBLE.format(helper=HELPER_MODULE, source=KERNEL_HELPER, nonce=self.nonce,
                                   memory=self.memory_mb, modules=self.modules)
        outcome = await self.execute(preamble, -1, timeout)
        if outcome.status != "ok":
            raise RuntimeError(f"the grader's preamble failed in the kernel: {outcome.status} {outcome.error}")

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

    async def stop(self) -> None:
        await self.kill()


def scratch_dir() -> Path:
    """A short temporary path (Unix socket paths must stay under ~100 characters)."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    return Path(tempfile.mkdtemp(prefix="fsgrade-", dir=base))

"""Ctrl-C in the ``hookax`` command: one line on stderr, exit status 130, no traceback, and never
a crash.

Python's own ``KeyboardInterrupt`` is not safe here. Raised while JAX is imported or while XLA
compiles, it unwinds through half-built C++ state, and the interpreter's exit then runs C++
destructors while a compiler thread is still working: the process dies of SIGSEGV. So the
command leaves with ``os._exit(130)`` after flushing its output: no destructor or finaliser
runs, and nothing can crash. It also cannot be swallowed (a ``KeyboardInterrupt`` raised inside
a callback or a ``__del__`` can be, and the command would go on).

Two ways lead there. The SIGINT handler runs in the main thread between two Python bytecodes;
a thread woken by the signal (:func:`signal.set_wakeup_fd`) acts even while the main thread is
inside XLA's compiler, so Ctrl-C is obeyed at once.

A harvest is the one exception (:func:`graceful`): there the main thread gets a
``KeyboardInterrupt``, so that the writer commits the batches it was handed before the command
reports how many are committed and exits. If that takes more than :data:`GRACE` seconds (the
main thread is compiling), or at a second Ctrl-C, the command exits at once: a killed harvest
still resumes exactly (:mod:`hookax._harvest.store`).

:func:`install` is called by ``import hookax`` when the process is the ``hookax`` command (its
first import: Ctrl-C while JAX loads is covered too); :func:`main <hookax._cli.main.main>` run
in-process (tests) catches ``KeyboardInterrupt`` and returns 130 instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

__all__ = [
    "GRACE",
    "describing",
    "exit_now",
    "graceful",
    "install",
    "installed",
    "message",
    "requested",
    "running_as_command",
]

GRACE = 3.0  # seconds a harvest gets to commit what it was handed, after Ctrl-C

_describe: list[Callable[[], str]] = []  # what was kept, for the one line (innermost last)
_state: dict[str, Any] = {"installed": False, "graceful": False, "since": None}
_exiting = threading.Lock()


def running_as_command() -> bool:
    """Whether this process is the ``hookax`` command (``hookax ...`` or ``python -m hookax``)."""
    args = iter(list(getattr(sys, "orig_argv", ()))[1:])  # the interpreter's options first
    for arg in args:
        if arg == "-m":
            return next(args, None) == "hookax"
        if arg.startswith("-m"):
            return arg == "-mhookax"
        if arg in ("-W", "-X"):
            next(args, None)
        elif arg.startswith("-c") or not arg.startswith("-") or arg == "-":
            break  # code, a script or stdin: the console script is a script too
    return os.path.basename(sys.argv[0] if sys.argv else "") in ("hookax", "hookax.exe")


def message(clear: bool = False) -> str:
    """The one line to print on Ctrl-C (after ``hookax: ``); ``clear``: forget what it says
    (the command is over)."""
    text = "interrupted"
    if _describe:
        with contextlib.suppress(Exception):  # the store could not be read: say what is sure
            text = f"interrupted: {_describe[-1]()}"
    if clear:
        _describe.clear()
    return text


def exit_now(flush: bool = True) -> NoReturn:
    """Print the line and end the process with status 130 (no finalisers run); ``flush``:
    flush stdout first (only in the main thread: another thread could wait forever for the
    lock of a write the main thread was in)."""
    with _exiting:  # one thread prints; another one waits here until the process ends
        if flush:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
        with contextlib.suppress(Exception):  # straight to the file: no lock of sys.stderr
            os.write(2, f"hookax: {message()}\n".encode())
        os._exit(130)


@contextlib.contextmanager
def describing(describe: Callable[[], str]) -> Iterator[None]:
    """Within, the Ctrl-C line says ``describe()`` (what was kept, how to go on); after a
    ``KeyboardInterrupt`` too, until :func:`message` is taken with ``clear``."""
    _describe.append(describe)
    try:
        yield
    except BaseException as e:
        if not requested(e):  # after Ctrl-C, the line printed further up says it
            _describe.remove(describe)
        raise
    _describe.remove(describe)


@contextlib.contextmanager
def graceful(describe: Callable[[], str]) -> Iterator[None]:
    """Within, Ctrl-C raises ``KeyboardInterrupt`` in the main thread (for :data:`GRACE`
    seconds, then the process exits), and its line says ``describe()``."""
    was = _state["graceful"]
    _state["graceful"] = True
    try:
        with describing(describe):
            yield
    finally:
        _state["graceful"] = was


def requested(e: BaseException | None = None) -> bool:
    """Whether Ctrl-C was pressed: the signal was seen, or ``e`` was caused by a
    ``KeyboardInterrupt`` (JAX turns one raised inside its C++ into a ``ValueError``)."""
    if _state["since"] is not None:
        return True
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        if isinstance(x, KeyboardInterrupt):
            return True
        seen.add(id(x))
        todo += [x.__cause__, x.__context__]
    return False


def _handler(signum: int, frame: Any) -> None:
    if not _state["graceful"] or _state["since"] is not None:
        exit_now()
    _state["since"] = time.monotonic()
    raise KeyboardInterrupt


def _watch(sock: socket.socket) -> None:
    while True:
        try:
            data = sock.recv(64)
        except InterruptedError:  # pragma: no cover - recv is retried by Python
            continue
        except OSError:  # pragma: no cover - the socket went away
            return
        if signal.SIGINT not in data:
            continue
        if _state["graceful"]:
            time.sleep(GRACE)  # the main thread commits what it was handed, and exits
        exit_now(flush=False)


def install() -> None:
    """Handle Ctrl-C as described above, for the rest of the process (main thread only)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _handler)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _state.update(installed=True, sockets=(reader, writer))
    threading.Thread(target=_watch, args=(reader,), name="hookax-ctrl-c", daemon=True).start()


def installed() -> bool:
    """Whether :func:`install` ran (this process is the command)."""
    return bool(_state["installed"])

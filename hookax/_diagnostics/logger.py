"""``hx.StatsLogger``: training statistics to TensorBoard event files, off the training thread.

Why this shape (measured, ``DESIGN.md`` point 19): writing each value as its own event
(``SummaryWriter.add_scalar``) costs 70-120 us a value, more than a small train step when a
model has a hundred statistics; one event holding every value of a step costs 6-8 us a value. And
reading a value from the device right after the step waits for the step to finish, so the
logger holds each step's values until the next one is logged (by then they are computed) and
fetches, formats and writes them on its own thread.

The writer is tensorboardX (the ``tensorboard`` extra): small, pure Python, maintained, and it
writes the files TensorBoard reads without TensorFlow or TensorBoard installed. The values are
also given as a flat ``{tag: float}`` dict (``as_dict``, ``callback=``) for any other logger.

Tags: ``"{kind}_{stat}/{key}"`` (``"grad_norm/layers/0"``; the model's own output is
``"(model)"``; layer 3 of a scanned stack ``"blocks/attn[3]"``, the suffix
``hx.harvest`` uses), so TensorBoard groups one statistic of every layer in one section;
scalars passed by name (``loss=``) keep their name.
"""

from __future__ import annotations

import glob
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .._util.errors import HookaxError
from .._util.extras import require

__all__ = ["ROOT", "StatsLogger", "as_dict", "read_events", "tag"]

ROOT = "(model)"  # how the model's own output (call-site key "") is named in tags


def tag(key: str, kind: str, stat: str) -> str:
    """The tag of one statistic: ``tag("layers/0", "grad", "norm") == "grad_norm/layers/0"``."""
    return f"{kind}_{stat}/{key or ROOT}"


def _index(shape: tuple[int, ...]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``("[i]...", index)`` for every element of an array of ``shape`` (``""`` for a scalar)."""
    for idx in np.ndindex(*shape):
        yield "".join(f"[{i}]" for i in idx), idx


def as_dict(stats: Mapping[str, Any] | None = None, **scalars: Any) -> dict[str, float]:
    """``stats`` of ``hx.value_grad_and_stats`` (and named scalars) as ``{tag: float}``.

    ``stats`` is an [`hx.Stats`][hookax.Stats] or any ``{key: {kind: {stat: value}}}`` mapping.

    A statistic with leading axes (one value per layer of a scanned stack, per call, per
    example) gives one tag per element: ``"act_norm/blocks/lin[3]"``. Values are fetched from the
    device (this waits for them).

    Examples:
      >>> import numpy as np
      >>> stats = {"blocks/lin": {"act": {"norm": np.array([1.0, 2.0])}, "grad": {}}}
      >>> as_dict(stats, loss=0.5)
      {'act_norm/blocks/lin[0]': 1.0, 'act_norm/blocks/lin[1]': 2.0, 'loss': 0.5}
    """
    import jax

    stats, scalars = jax.device_get((stats or {}, scalars))  # one transfer, then numpy slices
    out: dict[str, float] = {}
    for key, kinds in stats.items():
        for kind, values in kinds.items():
            for stat, value in values.items():
                value = np.asarray(value)
                for suffix, idx in _index(value.shape):
                    out[tag(f"{key}{suffix}", kind, stat)] = float(value[idx])
    for name, value in scalars.items():
        value = np.asarray(value)
        for suffix, idx in _index(value.shape):
            out[f"{name}{suffix}"] = float(value[idx])
    return out


class StatsLogger:
    """Write ``hx.value_grad_and_stats`` statistics every ``every`` steps, one TensorBoard
    event per step holding all of them, from a background thread.

    ``logger.due(step)`` says whether to run the step with statistics;
    ``logger.log(step, stats, loss=loss)`` hands the step's values over without waiting for them:
    they are fetched when the next step is logged (or at ``flush()``/``close()``), on the
    logger's thread, which writes them to ``logdir`` (tensorboardX) and calls
    ``callback(step, {tag: value})``. An error on that thread is raised by the next
    ``log``/``flush``/``close``.

    Args:
      logdir: folder of the event files (created); None writes no files (``callback`` only).
      every: the period of ``due()``.
      callback: called on the logger's thread with ``(step, as_dict(stats, **scalars))``.
      max_pending: steps that may wait for the thread before ``log()`` blocks.

    Examples:
      >>> import tempfile
      >>> import numpy as np
      >>> seen = []
      >>> logdir = tempfile.mkdtemp()
      >>> with StatsLogger(logdir, every=10, callback=lambda s, v: seen.append(s)) as log:
      ...     for step in range(25):
      ...         if log.due(step):
      ...             log.log(step, {"": {"act": {"norm": np.float32(step)}}}, loss=1.0)
      >>> seen
      [0, 10, 20]
      >>> read_events(log.logdir)["act_norm/(model)"]
      ([0, 10, 20], [0.0, 10.0, 20.0])
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str] | None,
        *,
        every: int = 1,
        callback: Callable[[int, dict[str, float]], Any] | None = None,
        max_pending: int = 16,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise HookaxError(f"hx.StatsLogger: every={every!r} must be an integer >= 1.")
        self.logdir = None if logdir is None else os.fspath(logdir)
        self.every = every
        self.callback = callback
        self._writer: Any = None
        if self.logdir is not None:
            require("tensorboardX", "tensorboard", "hx.StatsLogger (it writes TensorBoard files)")
            from tensorboardX.writer import FileWriter

            self._writer = FileWriter(self.logdir, max_queue=max_pending, flush_secs=30)
        self._held: tuple[int, Any, dict[str, Any]] | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="hx.StatsLogger", daemon=True)
        self._thread.start()

    @staticmethod
    def as_dict(stats: Mapping[str, Any] | None = None, **scalars: Any) -> dict[str, float]:
        """The statistics (and named scalars) as a flat ``{tag: float}`` dict, as the logger
        writes them: ``"act_norm/blocks/lin[3]"``, one tag per layer of a scanned stack."""
        return as_dict(stats, **scalars)

    def due(self, step: int) -> bool:
        """Whether ``step`` is one to measure: every ``every``-th step, from step 0."""
        return step % self.every == 0

    def log(self, step: int, stats: dict[str, Any] | None = None, **scalars: Any) -> None:
        """Hand over ``step``'s statistics (and named scalars: ``loss=loss``); returns at once.

        The arrays may still be computing: they are read when the next step is logged.
        """
        self._check()
        if self._closed:
            raise HookaxError("hx.StatsLogger: log() after close(). Fix: log inside the block.")
        if self._held is not None:
            self._queue.put(self._held)
        self._held = (int(step), stats, scalars)

    def flush(self) -> None:
        """Write everything logged so far (wait for the thread), then raise its error if any."""
        if self._held is not None:
            self._queue.put(self._held)
            self._held = None
        self._queue.join()
        if self._writer is not None:
            self._writer.flush()
        self._check()

    def close(self) -> None:
        """Flush and stop the thread; the event files are complete afterwards. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            if self._writer is not None:
                self._writer.close()

    def __enter__(self) -> StatsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            error.add_note(
                f"hookax: raised by hx.StatsLogger's thread while writing step {self._error_step}"
                f" to {self.logdir or 'its callback'}"
            )
            raise error

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after an error, drop the rest until it is raised
                    self._write(*item)
            except BaseException as e:  # handed to the training thread
                self._error, self._error_step = e, item[0]
            finally:
                self._queue.task_done()

    def _write(self, step: int, stats: Any, scalars: dict[str, Any]) -> None:
        values = as_dict(stats, **scalars)
        if self._writer is not None:
            from tensorboardX.proto.summary_pb2 import Summary

            rows = [Summary.Value(tag=t, simple_value=v) for t, v in values.items()]
            summary = Summary(value=rows)
            self._writer.add_summary(summary, step, time.time())
        if self.callback is not None:
            self.callback(step, values)


# ---- reading event files back ---------------------------------------------------------------


def _records(path: str) -> Iterator[bytes]:
    """The records of a TFRecord file, checked against their CRCs (a torn last record ends it)."""
    from tensorboardX.record_writer import masked_crc32c

    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            (crc,) = struct.unpack("<I", header[8:])
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                return  # a record still being written
            (data_crc,) = struct.unpack("<I", footer)
            if crc != masked_crc32c(header[:8]) or data_crc != masked_crc32c(data):
                raise HookaxError(f"{path}: a record fails its CRC check; the file is damaged.")
            yield data


def read_events(logdir: str | os.PathLike[str]) -> dict[str, tuple[list[int], list[float]]]:
    """``{tag: (steps, values)}`` of the scalar events in ``logdir``'s event files, in step order
    (a step written twice keeps its last value), tags in the order first seen."""
    require("tensorboardX", "tensorboard", "reading TensorBoard files")
    from tensorboardX.proto.event_pb2 import Event

    files = sorted(glob.glob(os.path.join(os.fspath(logdir), "**", "*tfevents*"), recursive=True))
    if not files:
        raise HookaxError(
            f"{os.fspath(logdir)!r} holds no TensorBoard event files (events.out.tfevents.*). "
            f"Fix: give the folder hx.StatsLogger(logdir) wrote."
        )
    found: dict[str, dict[int, float]] = {}
    for path in files:
        for data in _records(path):
            event = Event.FromString(data)
            for v in event.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    found.setdefault(v.tag, {})[int(event.step)] = float(v.simple_value)
    return {
        t: (sorted(by_step), [by_step[s] for s in sorted(by_step)]) for t, by_step in found.items()
    }

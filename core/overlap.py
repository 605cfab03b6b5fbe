"""A merge of a model config not checked before: written while its architecture check runs.

The architecture check (core/judge.py, core/hf_names.py) imports torch and transformers and
builds the config's model on the meta device: 3-5 CPU s once per config and installed
versions, against milliseconds once its answers are in the persistent cache
(core/archcache.py). A merge that finds them missing does not wait for it:

1. :func:`plan_first` plans with the cache only (:func:`core.archcache.cache_only`); when an
   answer is missing it makes a *speculative* plan instead (:func:`core.plan.plan_merge`: the
   checkpoint's own names, the usual tied copy dropped as config.json says) and starts a
   :class:`PendingPlan`: a second process (core/archworker.py) computes the check's answers
   into the cache while a thread waits for it, then makes the real plan (from the cache; or,
   when the cache is off or the worker failed, with the imports in that thread).
2. ``run_merge(spec, pending=...)`` writes the speculative plan's tensor files into its
   temporary folder meanwhile. Before anything else is written it takes the real plan
   (:meth:`PendingPlan.confirm`) and goes on only when the real plan writes the very same
   tensor files (:func:`same_writes`: file names, tensor order, names, shapes, dtypes and each
   tensor's source pieces); the index, config, card and the rest then come from the real plan.
3. Otherwise (a vision-language model's renamed tensors, fused experts cut, a head other than
   config.json names) the writing stops as soon as the real plan is known, its files are
   removed, and :func:`finish` writes the real plan; a real plan that refuses (weights that do
   not fit the model) refuses the merge with its own message. Nothing written on a guess is
   ever committed.

This is shardscope's own (no library overlaps a write with a check); the child process runs
beside the writer on a second core, where a thread importing transformers would hold the GIL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Callable

from . import archcache
from .errors import MergeCancelled, ShardscopeError
from .plan import MergeOptions, MergePlan


class PlanChanged(Exception):
    """The real plan writes other tensor files than the speculative one (``plan``: the real
    plan). Raised by :meth:`PendingPlan.confirm`; :func:`finish` then writes ``plan``."""

    def __init__(self, plan: MergePlan):
        super().__init__("the architecture check changed the plan")
        self.plan = plan


def same_writes(a: MergePlan, b: MergePlan) -> bool:
    """True when plans ``a`` and ``b`` write the same safetensors files byte for byte: the same
    files in order, each with the same tensors in order (name, shape, output dtype), read from
    the same source pieces with the same source dtype and layout, folded the same way (every
    input of core/execute.py's ``_Writer.write_tensor`` and of the header)."""
    if len(a.files) != len(b.files):
        return False
    for fa, fb in zip(a.files, b.files):
        if fa.name != fb.name or len(fa.tensors) != len(fb.tensors):
            return False
        for ta, tb in zip(fa.tensors, fb.tensors):
            if (ta.name != tb.name or tuple(ta.shape) != tuple(tb.shape)
                    or ta.dtype != tb.dtype or ta.source.dtype != tb.source.dtype
                    or ta.source.flat != tb.source.flat
                    or tuple(ta.source.piece_shape) != tuple(tb.source.piece_shape)
                    or ta.pieces != tb.pieces or ta.fold != tb.fold):
                return False
    return True


def plan_first(layout, options: MergeOptions, worker=None,
               on_phase: Callable[[str], None] | None = None,
               cancel: threading.Event | None = None
               ) -> tuple[MergePlan, "PendingPlan | None"]:
    """(plan, None) when the plan needs nothing that is not cached (the real plan); else
    (speculative plan, the :class:`PendingPlan` computing the real one). ``worker``: one
    :func:`start_worker` started earlier (on a :func:`likely_cold` guess), used or stopped
    here. ``on_phase``: receives the real plan's phase reports (core/phases.py) from its
    thread. ``cancel``: checked before the check is started (:class:`MergeCancelled`).
    Raises what :func:`core.plan.plan_merge` raises."""
    from . import plan_merge  # the package's name, looked up now (a test may wrap it)

    try:
        try:
            with archcache.cache_only():
                plan = plan_merge(layout, options)
            _stop(worker)
            return plan, None
        except archcache.ColdCache:
            pass
        try:
            spec = plan_merge(layout, options, speculative=True)
        except ShardscopeError:  # the real plan decides what is wrong (or that nothing is)
            _stop(worker)
            return plan_merge(layout, options), None
        if cancel is not None and cancel.is_set():  # an interrupt the planning let pass
            raise MergeCancelled("merge cancelled")
    except BaseException:
        _stop(worker)
        raise
    return spec, PendingPlan(layout, options, spec, worker, on_phase)


def _stop(proc) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def finish(plan: MergePlan, pending: "PendingPlan | None",
           run: Callable[[MergePlan, "PendingPlan | None"], object],
           cancel: threading.Event) -> tuple[MergePlan, object]:
    """Run ``run(plan, pending)`` (a front end's call of ``run_merge(plan, ...,
    pending=pending)``) and return (the real plan, its result): when the speculative plan
    proved wrong, its writing is dropped and ``run(real plan, None)`` writes the real one.
    ``cancel``: the user's cancel event. The worker process is stopped on every way out."""
    if pending is None:
        return plan, run(plan, None)
    try:
        try:
            result = run(plan, pending)
            return pending.plan, result
        except PlanChanged as e:
            real = e.plan
        except MergeCancelled:
            if cancel.is_set() or not pending.stale:
                raise
            real = pending.result(cancel)  # raises the real plan's refusal
    finally:
        pending.close()
    return real, run(real, None)


class PendingPlan:
    """The real plan of a merge written on a speculative one (module docstring): made by a
    thread that first waits for core/archworker.py (started here when the cache is on) to fill
    the cache. ``stale`` turns True as soon as the real plan is known to differ from ``spec``
    (or to fail); ``run_merge`` stops its writing then."""

    def __init__(self, layout, options: MergeOptions, spec: MergePlan, worker=None,
                 on_phase: Callable[[str], None] | None = None):
        self.layout, self.options, self.spec = layout, options, spec
        self.on_phase = on_phase
        self.plan: MergePlan | None = None
        self.error: BaseException | None = None
        self.stale = False
        #: seconds the merge waited for the real plan after writing (``confirm``)
        self.waited = 0.0
        self.done = threading.Event()
        self._closed = threading.Event()
        self.proc = worker if worker is not None else start_worker()
        if self.proc is not None:
            _ask(self.proc, spec.question)
        self._thread = threading.Thread(target=self._run, name="shardscope-check",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from . import plan_merge
        from .phases import reporting

        def stop_if_closed(text: str) -> None:  # each planning step: stop after close()
            if self._closed.is_set():
                raise MergeCancelled("merge cancelled")
            if text and self.on_phase is not None:
                self.on_phase(text)

        try:
            if self.proc is not None:
                code = self.proc.wait()
                if code and not self._closed.is_set() and self.on_phase is not None:
                    self.on_phase(f"the architecture check's worker process failed (exit "
                                  f"{code}): checking in this process")
            stop_if_closed("")
            with reporting(stop_if_closed):
                try:
                    with archcache.cache_only():
                        plan = plan_merge(self.layout, self.options)
                except archcache.ColdCache:  # no cache, or the worker failed: import here
                    plan = plan_merge(self.layout, self.options)
            self.plan = plan
            self.stale = not same_writes(self.spec, plan)
        except BaseException as e:  # noqa: BLE001 - handed to the merge's thread
            self.error = e
            self.stale = True
        finally:
            self.done.set()

    def result(self, cancel: threading.Event) -> MergePlan:
        """The real plan, waited for (``cancel`` checked every 0.1 s: MergeCancelled); raises
        the real plan's own error."""
        while not self.done.wait(0.1):
            if cancel.is_set():
                raise MergeCancelled("merge cancelled")
        if self.error is not None:
            raise self.error
        return self.plan

    def confirm(self, spec: MergePlan, cancel: threading.Event) -> MergePlan:
        """Called by ``run_merge`` once ``spec``'s tensor files are written: the real plan when
        it writes the same tensor files, else :class:`PlanChanged`; the real plan's error."""
        t0 = time.perf_counter()
        try:
            real = self.result(cancel)
        finally:
            self.waited = time.perf_counter() - t0
        if self.stale:
            raise PlanChanged(real)
        return real

    def close(self) -> None:
        """Stop the worker process (if running) and the thread's planning (at its next step)."""
        self._closed.set()
        _stop(self.proc)


class StopWhenStale:
    """An event for ``run_merge``'s workers: set when the user's ``cancel`` is, when the real
    plan proved the speculative one wrong (``pending.stale``), or by ``set()`` (a failure
    stopping the other workers, which does not set the user's event)."""

    def __init__(self, cancel: threading.Event, pending: PendingPlan):
        self.cancel, self.pending = cancel, pending
        self._own = threading.Event()

    def is_set(self) -> bool:
        return self._own.is_set() or self.cancel.is_set() or self.pending.stale

    def set(self) -> None:
        self._own.set()


def start_worker(preload: bool = False) -> "subprocess.Popen | None":
    """core/archworker.py started (``preload``: importing torch and transformers at once),
    waiting for its question on stdin; None when the cache is off (its answers would go
    nowhere) or it cannot be started (the real plan is then made in the thread)."""
    if archcache.cache_dir() is None:
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", f"{__package__}.archworker"]
                                + (["--preload"] if preload else []),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def likely_cold(path: str, hf_config: str | None = None,
                trust_remote_code: bool = False) -> bool:
    """A guess, before the checkpoint is read, that its merge will find the architecture
    check's answers missing: a config.json at ``hf_config``, else at ``PATH/huggingface``
    (verl, FSDP) or ``PATH`` itself, whose classes are not in the persistent cache. False
    when no config is found there, it is never cached (remote code) or the cache is off (a wrong guess costs only time: a
    worker started for nothing, or one started later)."""
    import os

    from .judge import facts_missing

    if archcache.cache_dir() is None:
        return False
    for d in ([hf_config] if hf_config else [os.path.join(path, "huggingface"), path]):
        if os.path.isfile(os.path.join(d, "config.json")):
            return facts_missing(d, trust_remote_code)
    return False


def _ask(proc, question: dict | None) -> None:
    """Send ``question`` to the worker ``proc`` (None: nothing to ask; it exits at EOF)."""
    try:
        if question is not None:
            proc.stdin.write((json.dumps(question) + "\n").encode())
        proc.stdin.close()
    except OSError:  # it died: the thread plans by itself
        pass

"""Imported by the forkserver that starts ShardedLoader's worker processes
(a preload module), and run by each of those processes at its start: each
ends when the process that started it does (PR_SET_PDEATHSIG), so that
none outlives a training script killed with SIGKILL."""
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(*_):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


die_with_parent()

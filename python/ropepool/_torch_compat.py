"""The private torch APIs ropepool's fast path uses, in one place, each with a public fallback.

The eager call of the torch op skips the dispatcher (``_op.py``) and is a few microseconds of
Python, so the cheapest getters count there; some of them are private. Each is looked up
here once, by name; when a torch release drops or renames one, the public path below takes
over (slower, same results) instead of ``import ropepool`` failing. ``PRIVATE_NAMES`` lists
them, so a test can hide them and check that the fallbacks give the same results.

Import this only when torch is installed.
"""

from __future__ import annotations

import torch
import torch.autograd.graph
import torch.utils.dlpack

try:  # a private module: the fast-path check below depends on it
    import torch.utils._python_dispatch as _python_dispatch
except ImportError:  # pragma: no cover - depends on the torch release
    _python_dispatch = None

#: (owner, attribute) of every private torch API this module uses.
PRIVATE_NAMES = (
    (torch._C, "_to_dlpack"),
    (torch._C, "_increment_version"),
    (torch._C, "_cuda_getCurrentRawStream"),
    (torch._C, "_cuda_getDevice"),
    (_python_dispatch, "_get_current_dispatch_mode"),
)


def _private(owner, name):
    return getattr(owner, name, None) if owner is not None else None


#: The private names this torch lacks: their public fallbacks are in use.
missing = tuple(name for owner, name in PRIVATE_NAMES if _private(owner, name) is None)


#: A tensor -> DLPack capsule, for the C++ side to import without a copy. The private
#: builtin is what torch.utils.dlpack.to_dlpack wraps.
to_dlpack = _private(torch._C, "_to_dlpack") or torch.utils.dlpack.to_dlpack

#: Tells autograd that the op wrote these tensors in place (bumps their version counters;
#: a no-op for inference-mode tensors). Takes a tuple of tensors. The public function is the
#: documented way for a custom kernel that writes through data_ptr (torch >= 2.1; the op's
#: torch.library.register_fake needs a newer torch anyway); it only adds a Python call.
increment_version = (_private(torch._C, "_increment_version")
                     or torch.autograd.graph.increment_version)

#: The raw cudaStream_t of torch's current stream on a device (an int). The private getter
#: is the one inductor's generated code uses, about 10x cheaper than the public wrapper.
current_raw_stream = (_private(torch._C, "_cuda_getCurrentRawStream")
                      or (lambda device: torch.cuda.current_stream(device).cuda_stream))

#: The index of the current CUDA device.
current_device = _private(torch._C, "_cuda_getDevice") or torch.cuda.current_device


class _UnknownMode:
    """Stands for "a dispatch mode may be active" when torch gives no way to ask."""

    def __repr__(self) -> str:
        return "<unknown dispatch mode>"


_UNKNOWN_MODE = _UnknownMode()


def _dispatch_mode_unknown():
    return _UNKNOWN_MODE


#: The innermost active TorchDispatchMode (e.g. FakeTensorMode), or None. torch has no
#: public equivalent: without the private function this answers "maybe one is active",
#: never None, so every call takes the dispatcher (correct under any mode, a few
#: microseconds slower) instead of skipping a mode that should have seen the op.
current_dispatch_mode = (_private(_python_dispatch, "_get_current_dispatch_mode")
                         or _dispatch_mode_unknown)

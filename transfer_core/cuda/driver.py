"""The small CUDA driver helpers the `cuda/` modules share, through cuda-python (S3b, S5a).

Loading cuda-python, `check_cu`, making the device's primary context current, device
attributes, device views of raw pointers and freeing on garbage collection. Importing this
module needs neither a GPU, cuda-python nor torch (`device_view` imports it); using it without
them raises `CudaError` naming the CUresult (CUDA_ERROR_NO_DEVICE when there is no driver at
all), or naming the `cuda` extra when cuda-python is missing.
"""

from __future__ import annotations

import logging
import threading
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any

from transfer_core.errors import CudaError
from transfer_core.optional import require_torch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def load_driver() -> ModuleType:
    """cuda-python's driver module (`cuda.bindings.driver`, or `cuda.cuda` before 12.6)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError as exc:
            raise CudaError("import cuda.bindings", "cuda-python is not installed "
                            "(pip install './transfer_core[cuda]')") from exc
    return driver


def check_cu(call: str, out: tuple[Any, ...]) -> Any:  # noqa: ANN401 - driver return types vary
    """Unpack a cuda-python `(CUresult, *values)` tuple, raising `CudaError` on failure.

    Returns None, the single value, or a tuple of values.
    """
    result, values = out[0], out[1:]
    if int(result) != 0:
        name = getattr(result, "name", str(result))
        raise CudaError(call, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def ensure_context(device: int) -> ModuleType:
    """Make `device`'s primary context (the one torch uses) current on this thread.

    The context is retained once per process and never released: torch shares it.
    """
    driver = load_driver()
    with _contexts_lock:
        context = _contexts.get(device)
        if context is None:
            try:
                out = driver.cuInit(0)
            except RuntimeError as exc:
                # cuda-python raises its own error when libcuda.so itself is missing.
                detail = f"CUDA_ERROR_NO_DEVICE (no NVIDIA driver: {exc})"
                raise CudaError("cuInit", detail) from exc
            check_cu("cuInit", out)
            handle = check_cu("cuDeviceGet", driver.cuDeviceGet(device))
            context = check_cu("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(handle))
            _contexts[device] = context
    check_cu("cuCtxSetCurrent", driver.cuCtxSetCurrent(context))
    return driver


def device_attribute(device: int, name: str) -> int:
    """One `CU_DEVICE_ATTRIBUTE_*` value of `device`, e.g. ``"CAN_MAP_HOST_MEMORY"``."""
    driver = ensure_context(device)
    attribute = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    handle = check_cu("cuDeviceGet", driver.cuDeviceGet(device))
    return int(check_cu("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attribute, handle)))


def cuda_available() -> bool:
    """Whether cuda-python can reach at least one device; never raises."""
    try:
        ensure_context(0)
    except CudaError as exc:
        logger.debug("CUDA unavailable: %s", exc)
        return False
    return True


class _CudaArray:
    """Exposes a raw device range through `__cuda_array_interface__` for `torch.as_tensor`.

    torch keeps this object alive as long as any tensor viewing it, and this object keeps
    `owner` alive, so memory freed by the owner's finalizer is never in use (see `free_on_gc`).
    """

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def device_view(
    ptr: int, nbytes: int, device: int, dtype: torch.dtype, owner: object
) -> torch.Tensor:
    """A 1-D CUDA tensor of `dtype` over ``[ptr, ptr + nbytes)`` on `device`, keeping `owner`.

    Built as bytes and re-viewed, since the array interface has no bfloat16.
    """
    torch = require_torch("transfer_core.cuda")
    raw = torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=torch.device("cuda", device))
    return raw.view(dtype)


def free_on_gc(owner: object, free: Any, *args: object) -> weakref.finalize:  # noqa: ANN401
    """Run `free(*args)` when `owner` is collected or when the returned finalizer is called.

    Not at interpreter exit: the driver may already be gone and the OS frees it anyway.
    """
    finalizer = weakref.finalize(owner, free, *args)
    finalizer.atexit = False
    return finalizer

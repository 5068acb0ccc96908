"""What torch has loaded, asked without loading it.

torch.compile's tracer (torch._dynamo) and DTensor each cost as much CPU to import as a third of
importing torch or more. A run that compiles nothing and shards nothing never needs them, yet
torch's optimizers, ``set_stance`` and an ``isinstance(t, DTensor)`` import them on first use.
Before torch._dynamo is loaded nothing is being compiled, and before DTensor is loaded no tensor
is one: the questions have their answer without the import
(docs/decisions.md#no-compiler-import).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def compiler_loaded() -> bool:
    """Whether torch.compile's tracer is loaded: until it is, nothing runs compiled."""
    return "torch._dynamo" in sys.modules


_DTENSOR = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    dtensor = sys.modules.get(_DTENSOR)
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_tensor(t: Any) -> Any:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled modules run eager inside (``torch.compiler.set_stance("force_eager")``)."""
    if not compiler_loaded():
        return contextlib.nullcontext()
    import torch

    stance: contextlib.AbstractContextManager[Any] = torch.compiler.set_stance("force_eager")
    return stance


def plain_beside_dtensors() -> contextlib.AbstractContextManager[Any]:
    """Plain tensors taken as replicated beside DTensor ones (``implicit_replication``); with
    DTensor not loaded, there are none to stand beside."""
    if _DTENSOR not in sys.modules:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()

"""meshrun's trainer (trainer.py; a job of it: job.py), and `meshrun.train(...)` itself.

The package is callable: ``meshrun.train(model_size="gpt-tiny", steps=2, nproc=2)`` runs the
`meshrun train` job from Python (api.py). Its name is the package's, so whichever of the two
an import leaves on ``meshrun``, the call works.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, config: str | None = None, **options: Any) -> Any:
        from .api import train

        return train(config, **options)


sys.modules[__name__].__class__ = _CallableModule

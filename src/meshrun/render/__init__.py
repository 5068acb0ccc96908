"""Job specs for the platforms in the documents, each a pure function of a RenderSpec.

The entry point of every spec is ``meshrun``: detection happens on the nodes, from the
variables each platform sets, so a spec never hard-codes ranks or addresses it cannot know.
"""

from .spec import TARGETS, RenderSpec, render

__all__ = ["RenderSpec", "TARGETS", "render"]

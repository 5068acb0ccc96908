"""One module per platform, each with ``NAME``, ``MARKERS``, ``detect(env, gpus) -> Topology | None``
and a subclass of :class:`.base.Platform` (the contract, which users' platforms extend too)
that carries them.

``detect`` returns None when the platform's marker variables are absent, a Topology when
they are present and consistent, and raises MeshrunError naming the variable when they are
present but wrong. Detectors are pure: they read only the mapping and the GPU count given.
"""

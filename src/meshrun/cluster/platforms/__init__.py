"""One module per platform, each with ``NAME`` and ``detect(env, gpus) -> Topology | None``.

``detect`` returns None when the platform's marker variables are absent, a Topology when
they are present and consistent, and raises MeshrunError naming the variable when they are
present but wrong. Detectors are pure: they read only the mapping and the GPU count given.
"""

"""The lab: measure honestly, show it live.

Submodules, lightest first: ``device`` (presets, versions), ``timing``, ``ceilings``,
``profile`` (needs pandas), ``plots`` (plotly), ``panel`` (ipywidgets), ``bench``.
Nothing is imported here, so ``import accel.lab.timing`` costs no plotly.
"""
